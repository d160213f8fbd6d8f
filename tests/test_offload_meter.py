"""Activation offload keeps nothing on the device and the meter counts what autograd keeps (issue #44): a
storage autograd saves twice is offloaded once (not copied out and kept), and a new storage at an address a
freed one used is a new storage (counted, and offloaded)."""

from __future__ import annotations

import pytest
import torch

from pipeplan.runtime.memory import SavedTensors, apply_policy, param_storages
from pipeplan.runtime.stages import build_model
from tests.test_runtime_model import ARGS, batches


class Truth(torch.autograd.graph.saved_tensors_hooks):
    """Ground truth: every storage autograd saves (held alive, so no address is reused), parameters apart."""

    def __init__(self, params: set[int]):
        self.storages: dict[int, int] = {}
        self.params = params

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in self.params:
                self.storages[id(s)] = s.nbytes()
                self.keep.append(s)
            return t

        self.keep: list = []
        super().__init__(pack, lambda t: t)


def forward(policy: str, share: float):
    torch.manual_seed(0)
    model = apply_policy(build_model(ARGS), policy)
    tokens, labels = batches(1)[0]
    params = param_storages(model)
    truth = Truth(params)
    meter = SavedTensors(params, share)
    packed: list = []
    pack = meter._pack
    meter_pack = lambda t: packed.append(pack(t)) or packed[-1]  # noqa: E731
    meter.pack_hook = meter_pack
    with truth:
        model(tokens)  # the truth, on a separate forward with every storage held
    with meter:
        out = model(tokens)
    return model, meter, truth, packed, out, labels, params


@pytest.mark.parametrize("policy", ["none", "selective"])
def test_share_one_leaves_no_activation_on_the_device(policy):
    _model, meter, truth, packed, _out, _labels, params = forward(policy, 1.0)
    resident = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in packed
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params}
    assert resident == {}  # every saved activation went to host memory
    assert meter.device_bytes == 0
    assert meter.host_bytes == sum(truth.storages.values())  # each storage once, none missed


@pytest.mark.parametrize("policy", ["none", "selective"])
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_the_meter_counts_each_saved_storage_once(policy, share):
    _model, meter, truth, _packed, _out, _labels, _params = forward(policy, share)
    assert meter.device_bytes + meter.host_bytes == sum(truth.storages.values())


def test_offloaded_forward_gives_the_same_gradients():
    from torch.nn.functional import cross_entropy

    grads = {}
    for share in (0.0, 1.0):
        model, meter, _truth, _packed, out, labels, _params = forward("none", share)
        meter.prefetch()
        cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
        grads[share] = {n: p.grad for n, p in model.named_parameters()}
    for n, g in grads[0.0].items():
        torch.testing.assert_close(grads[1.0][n], g, rtol=0, atol=0, msg=n)
