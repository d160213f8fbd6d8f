"""A branch-free sort of at most 128 int32 values for the compiled kernel (lcp/kernel.py).

The kernel's commonest selection at N = 1M, k = 10 is the 10 smallest ids of a group of ~15 rows (the
rows sharing the query's first two bytes). An insertion sort of 15 random ids mispredicts a branch on
most of its steps (0.27 µs per set of 10–32 ids in a numba loop, 4,096 sets, CPU time), and a
rank-counting sort in plain numba is not vectorised (0.22–0.38 µs). A bitonic sorting network on one
LLVM vector of 16 or 32 int32 lanes has no data-dependent branch at all: log2(n)·(log2(n) + 1)/2 stages
(10 for 16 lanes, 15 for 32), each a lane permutation, a min, a max and a blend, which LLVM lowers to
AVX2 registers (0.06 µs per set, same benchmark). Numba has no SIMD intrinsics, so the network is
emitted as LLVM IR through `numba.extending.intrinsic`. 64 and 128 lanes (21 and 28 stages, in 8 and 16
AVX2 registers) sort the ~76 ids of S_2 that k = 100 and 1000 queries at N = 5M read (lcp/kernel.py,
`_sort_ids`), where an LSD radix sort took ~1.4 µs per query.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.core.extending import intrinsic

INT32_MAX = 2**31 - 1  # pads a set shorter than the lanes: sorts after every id


def _bitonic_codegen(lanes: int):
    """Codegen sorting arr[:lanes] (int32, contiguous) ascending in place: Batcher's bitonic network.

    Stage (size, dist): lane i is compared with lane i ^ dist; it keeps the smaller value when its
    block of `size` lanes is ascending ((i & size) == 0) and i is the lower of the pair ((i & dist)
    == 0), or when neither holds; else the larger."""

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        i32 = ir.IntType(32)
        vec = ir.VectorType(i32, lanes)
        ptr = builder.bitcast(array.data, vec.as_pointer())
        v = builder.load(ptr, align=4)
        size = 2
        while size <= lanes:
            dist = size >> 1
            while dist > 0:
                other = builder.shuffle_vector(v, v, ir.Constant(vec, [i ^ dist for i in range(lanes)]))
                less = builder.icmp_signed("<", v, other)
                low, high = builder.select(less, v, other), builder.select(less, other, v)
                keep = [i if ((i & dist) == 0) == ((i & size) == 0) else lanes + i for i in range(lanes)]
                v = builder.shuffle_vector(low, high, ir.Constant(vec, keep))
                dist >>= 1
            size <<= 1
        builder.store(v, ptr, align=4)
        return context.get_dummy_value()

    return codegen


def _typed(arr: types.Type) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int32 and arr.ndim == 1 and arr.layout == "C"


def _sorter(lanes: int):
    """An intrinsic sorting arr[:lanes] ascending in place; arr: contiguous int32 [>= lanes] (not checked:
    the caller sizes it)."""

    @intrinsic
    def sort(typingctx, arr):
        return (types.void(arr), _bitonic_codegen(lanes)) if _typed(arr) else None

    sort.__doc__ = f"Sort arr[:{lanes}] ascending in place; arr: contiguous int32 [>= {lanes}] (not checked)."
    return sort


sort16, sort32, sort64, sort128 = (_sorter(lanes) for lanes in (16, 32, 64, 128))
