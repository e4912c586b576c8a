"""``benchmarks/bench_moe_train.py`` times its blocks on a GPU only; here its construction runs on
the CPU at a tiny shape (hidden 64, 8 experts, top-2, FFN 32, bf16): megatron-core's own
``MoELayer`` (the experts class Megatron picks on this machine; the allgather dispatcher, since
alltoall needs CUDA streams) and rl_engine's ``RLMoELayer``, both loaded with the HF block's
weights, one forward + backward each.

* rl_engine's Megatron layer == the rl_engine-patched HF block bitwise: output, input gradient
  and every weight gradient (router, ``[gate; up]``, down);
* megatron's own layer computes the same block (close) but not the same bits (the control: the
  bitwise comparison above can tell two implementations apart);
* the weight loader refuses an experts class it does not know.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_moe_train as bench  # noqa: E402

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU suite (native providers)"),
]

SHAPE = dict(hidden=64, experts=8, top_k=2, ffn=32)
T = 37  # odd token count: some experts get no token at top-2 of 8


@pytest.fixture(scope="module", autouse=True)
def _shim():
    """``megatron_block`` installs the CPU shim (one-process model-parallel state); undone
    after the module."""
    from rl_engine.adapters.megatron.cpu_shim import uninstall

    yield
    uninstall()


@pytest.fixture(scope="module")
def runs():
    """Each block's (output, input gradient, {router, w13, w2 gradients}) after one step."""
    from rl_engine.adapters import hf

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, SHAPE["hidden"], generator=gen).to(torch.bfloat16)
    g = torch.randn(1, T, SHAPE["hidden"], generator=gen).to(torch.bfloat16)
    model, block = bench.hf_block(None, SHAPE, "cpu", torch.bfloat16)
    impl = bench.megatron_expert_impl()
    layers = {
        kind: bench.megatron_block(
            kind, block, SHAPE, "cpu", torch.bfloat16, dispatcher="allgather"
        )  # fmt: skip
        for kind in ("megatron", "rl_engine")
    }
    hf.patch_model(model)
    out = {}
    for name, mod, meg in (("hf", block, False), *((k, v, True) for k, v in layers.items())):
        y, xx = bench.fwd_bwd(mod, x, g, megatron=meg)()
        out[name] = (y.detach().reshape(T, -1), xx.grad.reshape(T, -1), _weight_grads(mod))
    return impl, layers, out


def _weight_grads(mod: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Router [E, H], ``[gate; up]`` [E, 2I, H] and down [E, H, I] gradients of any block."""
    if hasattr(mod, "gate"):  # the HF block
        w = (mod.gate.weight, mod.experts.gate_up_proj, mod.experts.down_proj)
        return dict(zip(("router", "w13", "w2"), (p.grad for p in w), strict=True))
    experts = mod.experts
    if hasattr(experts, "local_experts"):  # megatron's SequentialMLP
        w13 = torch.stack([m.linear_fc1.weight.grad for m in experts.local_experts])
        w2 = torch.stack([m.linear_fc2.weight.grad for m in experts.local_experts])
    else:  # RLMoELayer's stacked experts
        w13, w2 = experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad
    return {"router": mod.router.weight.grad, "w13": w13, "w2": w2}


def test_builds_both_megatron_layers(runs):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from rl_engine.adapters.megatron import RLMoELayer

    impl, layers, out = runs
    assert impl in bench.EXPERT_IMPLS
    assert isinstance(layers["megatron"], MoELayer)
    assert type(layers["megatron"].experts).__name__ == impl
    assert layers["megatron"].config.moe_token_dispatcher_type == "allgather"
    assert isinstance(layers["rl_engine"], RLMoELayer)
    for name in ("megatron", "rl_engine"):
        y, dx, dw = out[name]
        assert y.shape == dx.shape == (T, SHAPE["hidden"]) and y.dtype == torch.bfloat16
        assert dw["w13"].shape == (8, 64, 64) and dw["w2"].shape == (8, 64, 32)
        assert all(t.abs().sum() > 0 for t in dw.values()), name


def test_rl_engine_megatron_equals_patched_hf_bitwise(runs):
    _, _, out = runs
    (ya, dxa, dwa), (yb, dxb, dwb) = out["rl_engine"], out["hf"]
    assert torch.equal(ya, yb), (ya - yb).float().abs().max()
    assert torch.equal(dxa, dxb), (dxa - dxb).float().abs().max()
    bad = [k for k in dwa if not torch.equal(dwa[k], dwb[k])]
    assert not bad, {k: (dwa[k] - dwb[k]).float().abs().max().item() for k in bad}


def test_control_megatron_own_layer_close_not_bitwise(runs):
    _, _, out = runs
    (ya, dxa, dwa), (yb, dxb, dwb) = out["megatron"], out["hf"]
    # the same math in bf16, rounded at other points: outputs ~5e-3, gradients larger
    for got, want, tol in ((ya, yb, 1e-4), (dxa, dxb, 1e-2),
                           *((dwa[k], dwb[k], 5e-2) for k in dwa)):  # fmt: skip
        err = (got - want).float().abs()
        assert err.max() < tol, (err.max().item(), err.mean().item())
    assert not torch.equal(ya, yb), "megatron's own MoE layer happened to match rl_engine's bits"


def test_load_hf_weights_refuses_unknown_experts(runs):
    _, layers, _ = runs
    block = bench.hf_block(None, SHAPE, "cpu", torch.bfloat16)[1]
    layer = layers["rl_engine"]
    saved, layer.experts = layer.experts, torch.nn.Linear(2, 2)
    try:
        with pytest.raises(TypeError, match="unknown Megatron experts class Linear"):
            bench.load_hf_weights(layer, block)
    finally:
        layer.experts = saved
