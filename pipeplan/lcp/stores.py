"""Non-temporal (streaming) stores for the compiled kernel's results (lcp/kernel.py).

At k = 1000 and batch 4096 a call writes 65.5 MB of results (two [B, k] int64 arrays), far beyond the
caches: a plain store first reads each line it writes (read-for-ownership), then writes it back — two
transfers per line. A store marked `!nontemporal` (x86: `movnti`) goes to memory through the
write-combining buffers without that read: in a numba microbenchmark writing [4096, 1000] int64 twice,
0.73 against 1.08 µs per query (CPU time, median of 5). Numba has no such store, so it is emitted as
LLVM IR through `numba.extending.intrinsic`. Streaming stores are weakly ordered: `fence` (a sequentially
consistent LLVM fence, `mfence` on x86) orders them before whatever the caller does next. numba's on-disk
cache tracks only lcp/kernel.py: after editing this file, touch lcp/kernel.py so that the kernel recompiles."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.extending import intrinsic


def _stream_codegen(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1], args[2]])
    value = context.cast(builder, args[3], signature.args[3], signature.args[0].dtype)
    store = builder.store(value, ptr)
    store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
    return context.get_dummy_value()


@intrinsic
def stream(typingctx, arr, row, col, value):
    """arr[row, col] = value (2-D array) as a non-temporal store; no bounds check (the caller's indices)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 2 and isinstance(value, types.Integer)):
        return None
    return types.void(arr, types.intp, types.intp, value), _stream_codegen


def _fence_codegen(context, builder, signature, args):
    builder.fence("seq_cst")
    return context.get_dummy_value()


@intrinsic
def fence(typingctx):
    """A sequentially consistent fence: every earlier (streaming) store is visible before any later one."""
    return types.void(), _fence_codegen
