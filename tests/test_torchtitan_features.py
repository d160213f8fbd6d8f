"""torchtitan's training features in the cost model (issue #12): op-level selective checkpointing, eager vs
compiled element-wise kernels, Float8 linears. Each is checked against a count done by hand from torchtitan's
own code (9dec370: models/llama/model.py, models/norms.py, parallelisms/parallelize_llama.py)."""

from __future__ import annotations

import pytest

from pipeplan.sim.config import parse_scenario
from pipeplan.sim.cost_model import device_spec
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.layer_ops import layer_times, op_checkpoint_bytes, projections
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.step import resolve_schedule

# Llama 3.1 8B as torchtitan's Table 1 runs it: b = 2, s = 8192, one GPU's share of FSDP
H, H_KV, F, A, S, B = 4096, 1024, 14336, 32, 8192, 2
T = B * S


def llama(training=None, parallel=None, memory=None, device=None):
    return parse_scenario({
        "pipeline": {"stages": 1, "microbatches": 1},
        "model": {"layers": 32, "hidden": H, "ffn_hidden": F, "heads": A, "kv_heads": 8, "vocab": 128256,
                  "seq_len": S},
        "training": {"micro_batch_size": B, **(training or {})},
        "parallel": {"tp": 1, **(parallel or {})},
        "device": {"preset": "H100-HBM2e-96GB-500W", **(device or {})},
        "memory": {"fragmentation": 0, **(memory or {})},
    })


def test_op_level_policy_saves_every_other_mm_of_torchtitans_order():
    """wq, wk, wv, wo, w1, w3, w2: the 1st, 3rd, 5th and 7th aten.mm are saved (wq, wv, w1, w2)."""
    saved = [n for _, n, _, keep in projections(llama()) if keep]
    assert saved == [H, H_KV, F, H]


def test_op_level_checkpoint_is_input_plus_saved_outputs_plus_flash_output_and_lse():
    expected = 2 * T * (H + H + H_KV + F + H) + 2 * T * H + 4 * A * T  # input, 4 mm outputs, SDPA out + LSE
    assert op_checkpoint_bytes(llama()) == pytest.approx(expected)
    sc = llama(memory={"recompute": "selective-op"})
    costs = build_cost_table(sc)
    plan = build_memory_plan(sc, costs, resolve_schedule(sc))
    loss_side = costs.activation_bytes[0] - 32 * costs.detail.layer_activation_bytes[0]  # embedding, head, logits
    assert plan.kept_bytes[0] == pytest.approx(32 * expected + loss_side)


def test_op_level_recompute_sits_between_selective_and_full():
    times = {}
    for policy in ("selective", "selective-op", "full"):
        sc = llama(memory={"recompute": policy})
        costs = build_cost_table(sc)
        times[policy] = float(build_memory_plan(sc, costs, resolve_schedule(sc)).recompute_s[0])
    assert times["selective"] < times["selective-op"] < times["full"]


def _layer(sc):
    return layer_times(sc, device_spec(sc), None)  # tp = 1: no link needed


def test_eager_elementwise_bytes_follow_torchtitans_kernels():
    """Eager minus compiled forward time is exactly the extra bytes of the unfused kernels over HBM bandwidth:
    two RMSNorms (28 + 4e - 2e per element), RoPE on Q and K (16 + 2e - 2e), SiLU * up (5e - 3e), and the
    copies eager makes: K and V repeated to all heads (read h_kv, write h each), the attention output made
    contiguous (read and write h)."""
    e = 2
    extra = (2 * (28 + 4 * e - 2 * e) * T * H + 16 * T * (H + H_KV) + 2 * e * T * F
             + 2 * e * T * (H_KV + H) + 2 * e * T * H)
    eager, fused = _layer(llama(training={"compile": False})), _layer(llama(training={"compile": True}))
    assert eager.forward_s - fused.forward_s == pytest.approx(extra / 2400e9)
    assert eager.backward_input_s - fused.backward_input_s == pytest.approx(2 * extra / 2400e9)


def test_eager_keeps_fp32_norm_and_rope_copies_and_repeated_kv():
    sc_e, sc_c = llama(training={"compile": False}), llama()
    kept_e, kept_c = (build_cost_table(s).detail.layer_activation_bytes[0] for s in (sc_e, sc_c))
    assert kept_e - kept_c == pytest.approx(2 * 4 * T * H + 4 * T * (H + H_KV) + 2 * 2 * T * (H - H_KV))


def test_float8_linears_run_gemms_at_the_fp8_rate_plus_the_casts():
    """W's GEMMs find their operands cast by F and I (torchao writes both layouts), so they run at 2x the peak
    times the device's fp8_gemm_ratio; F and I carry the cast kernels."""
    bf16, fp8 = _layer(llama()), _layer(llama(training={"float8_linears": True}))
    ratio = llama().device.resolved()["fp8_gemm_ratio"]
    assert fp8.backward_weight_s == pytest.approx(bf16.backward_weight_s / (2 * ratio), rel=0.02)
    fast_hbm = _layer(llama(training={"float8_linears": True}, device={"hbm_gbps": 1e9}))  # casts at the floor
    assert fp8.forward_s - fast_hbm.forward_s > 0  # F pays for its casts' bytes


def test_float8_linears_need_fp8_tensor_cores():
    with pytest.raises(ScenarioError, match=r"training\.float8_linears"):
        build_cost_table(llama(training={"float8_linears": True}, device={"preset": "A100-80GB"}))



@pytest.mark.parametrize("attention,sp", [("flash", True), ("eager", True), ("flash", False)])
def test_float8_tensor_parallel_keeps_every_linear_input_in_float8(attention, sp):
    """torchao's Float8ColwiseParallel and Float8RowwiseParallel cast a linear's input to float8 before the
    matmul, and Float8Linear saves the input it is given (matmul_with_hp_or_float8_args): with DTensor TP the
    QKV and MLP-up inputs are kept whole at 1 byte, and so are the out-proj and down-projection inputs, at 1 byte
    on their TP shard. Flash SDPA keeps its e-byte output beside the out-proj's float8 copy; eager attention's
    output is kept by the out-proj alone. A deferred W (its stash) keeps the same GEMM inputs."""
    e, t = 2, 8
    par = {"tp": t, "tp_style": "dtensor", "sequence_parallel": sp}
    base = {"attention": attention}
    bf16 = build_cost_table(llama(training=base, parallel=par)).detail
    fp8 = build_cost_table(llama(training={**base, "float8_linears": True}, parallel=par)).detail
    col = 2 * T * H * (1 - e)  # QKV and MLP-up inputs: e bytes whole (gathered, or replicated without SP) -> 1
    down = (1 - e) * T * F / t
    out_proj = T * H / t if attention == "flash" else (1 - e) * T * H / t
    assert fp8.layer_activation_bytes[0] - bf16.layer_activation_bytes[0] == pytest.approx(col + down + out_proj)
    stash = col + (1 - e) * T * (H + F) / t
    per_layer = (fp8.weight_stash_bytes[0] - bf16.weight_stash_bytes[0]) / fp8.layers[0]
    assert per_layer == pytest.approx(stash)
