"""Triton providers of moe_topk and moe_combine: bitwise the reference (their numerics family is
the reference's), across shapes, dtypes, ties, infinities and NaN, with autograd and CUDA graphs.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``) and skip otherwise; on
a CUDA device they run on the GPU (bf16 included) against the reference on the same device.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry
from rl_engine.ops import moe_combine, moe_topk
from rl_engine.ops.moe_combine import reference as combine_ref
from rl_engine.ops.moe_combine import triton as ct
from rl_engine.ops.moe_router import reference as topk_ref
from rl_engine.ops.moe_router import triton as rt
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from tests.conftest import DEVICE, ON_GPU, gpu, skip_unless_triton

pytestmark = skip_unless_triton(rt)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
SCORINGS = [("softmax", True), ("softmax", False), ("topk_softmax", False)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same_topk(logits: torch.Tensor, k: int, scoring: str, renorm: bool) -> None:
    w, ids = rt.moe_topk(logits, k, scoring, renorm)
    w_ref, ids_ref = topk_ref.moe_topk(logits, k, scoring, renorm)
    what = f"moe_topk {tuple(logits.shape)} {logits.dtype} k={k} {scoring} renorm={renorm}"
    assert_bitwise(ids, ids_ref, what + " ids")
    # NaN rows (a NaN logit): NaN at the same places, every other weight bitwise
    assert torch.equal(w.isnan(), w_ref.isnan()), what + " NaN places"
    assert_bitwise(w.nan_to_num(nan=0.0), w_ref.nan_to_num(nan=0.0), what + " weights")


# ------------------------------------------------------------------------------- moe_topk
@pytest.mark.parametrize("scoring,renorm", SCORINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (67, 16, 4), (5, 60, 6), (19, 128, 8), (3, 3, 3)])
def test_topk_triton_is_the_reference_bitwise(t, e, k, dtype, scoring, renorm):
    logits = (3 * torch.randn(t, e, generator=_gen(t * e + k))).to(device=DEVICE, dtype=dtype)
    _same_topk(logits, k, scoring, renorm)


@pytest.mark.parametrize("scoring,renorm", SCORINGS)
def test_topk_triton_special_values(scoring, renorm):
    g = _gen(7)
    logits = torch.randn(9, 24, generator=g)
    logits[0] = torch.round(logits[0])  # many ties
    logits[1] = 0.0  # all equal: ids 0..k-1
    logits[2, 3:9] = float("-inf")  # masked experts
    logits[3] = logits[3] * 1e4  # exp underflows to 0 for most experts
    logits[4, :] = float("-inf")  # a row of -inf
    logits[4, 5] = 1.0
    logits[5, 2] = float("nan")  # NaN sorts first, as in torch.sort
    logits[6, 0] = -0.0
    logits[6, 1] = 0.0
    logits[7] = 88.0 + torch.rand(24, generator=g)  # large logits: exp(d) with d near 0
    _same_topk(logits.to(DEVICE), 6, scoring, renorm)


def test_topk_triton_zero_rows_and_registry():
    w, ids = rt.moe_topk(torch.zeros(0, 8, device=DEVICE), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    prov = KernelRegistry.provider("moe_router", "triton")
    assert prov.numerics == "moe_router/native"  # the reference's family: same bits
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\]"):
        rt.moe_topk(torch.zeros(2, 8, device=DEVICE), 9)


@pytest.mark.parametrize("scoring,renorm", SCORINGS)
def test_topk_triton_autograd_and_row_invariance(scoring, renorm):
    x = torch.randn(40, 32, generator=_gen(3)).to(device=DEVICE)
    gw = torch.randn(40, 4, generator=_gen(4)).to(device=DEVICE)
    grads = []
    for backend in ("native", "triton"):
        xi = x.clone().requires_grad_(True)
        w, _ = moe_topk(xi, 4, scoring=scoring, renormalize=renorm, backend=backend)
        w.backward(gw)
        grads.append(xi.grad)
    assert_bitwise(grads[1], grads[0], "dlogits triton vs native")

    def fwd(t):
        w, ids = moe_topk(t, 4, scoring=scoring, renormalize=renorm, backend="triton")
        return torch.cat([w, ids.float()], dim=1)

    check_row_invariance(fwd, x, counts=(1, 2, 17, 33), what="moe_topk triton")


# ----------------------------------------------------------------------------- moe_combine
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", ["none", "plain", "gated"])
@pytest.mark.parametrize("t,k,h", [(1, 1, 8), (21, 4, 40), (7, 8, 2048), (33, 2, 1)])
def test_combine_triton_is_the_reference_bitwise(t, k, h, shared, dtype):
    g = _gen(t + k + h)
    y = torch.randn(t, k, h, generator=g).to(device=DEVICE, dtype=dtype)
    w = torch.rand(t, k, generator=g).to(DEVICE)
    sh = torch.randn(t, h, generator=g).to(device=DEVICE, dtype=dtype)
    gate = (4 * torch.randn(t, 1, generator=g)).to(device=DEVICE, dtype=dtype)
    kw = {}
    if shared != "none":
        kw["shared"] = sh
    if shared == "gated":
        kw["shared_gate"] = gate
    out = ct.moe_combine(y, w, **kw)
    assert_bitwise(out, combine_ref.moe_combine(y, w, **kw), f"moe_combine {t},{k},{h} {shared}")


def test_combine_triton_strided_inputs_and_autograd():
    g = _gen(12)
    base = torch.randn(9, 3, 2 * 24, generator=g).to(device=DEVICE)
    y = base[:, :, ::2]  # non-contiguous hidden stride
    w = torch.rand(3, 9, generator=g).to(DEVICE).t()  # transposed weights
    sh = torch.randn(9, 24, generator=g).to(DEVICE)
    gate = torch.randn(9, 1, generator=g).to(DEVICE)
    assert_bitwise(
        ct.moe_combine(y, w, sh, gate), combine_ref.moe_combine(y, w, sh, gate), "strided"
    )
    grads = []
    for backend in ("native", "triton"):
        leaves = [a.clone().requires_grad_(True) for a in (y, w, sh, gate)]
        moe_combine(leaves[0], leaves[1], shared=leaves[2], shared_gate=leaves[3],
                    backend=backend).square().sum().backward()  # fmt: skip
        grads.append([a.grad for a in leaves])
    for a, b, name in zip(grads[1], grads[0], ("dy", "dw", "dshared", "dgate"), strict=True):
        assert_bitwise(a, b, f"{name} triton vs native")


def test_combine_triton_zero_tokens():
    out = ct.moe_combine(torch.zeros(0, 2, 8, device=DEVICE), torch.zeros(0, 2, device=DEVICE))
    assert out.shape == (0, 8)


# ------------------------------------------------------------------------------ CUDA graphs
@gpu
def test_topk_and_combine_replay_in_a_cuda_graph():
    g = _gen(21)
    logits = torch.randn(16, 128, generator=g).to(device="cuda", dtype=torch.bfloat16)
    y = torch.randn(16, 8, 256, generator=g).to(device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # warm up (compile) outside the capture
        w, ids = rt.moe_topk(logits, 8, "softmax", True)
        out = ct.moe_combine(y, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = rt.moe_topk(logits, 8, "softmax", True)
        out = ct.moe_combine(y, w)
    logits.copy_(torch.randn(16, 128, generator=g).to(device="cuda", dtype=torch.bfloat16))
    y.copy_(torch.randn(16, 8, 256, generator=g).to(device="cuda", dtype=torch.bfloat16))
    graph.replay()
    w_ref, ids_ref = topk_ref.moe_topk(logits, 8, "softmax", True)
    assert_bitwise(ids, ids_ref, "replayed ids")
    assert_bitwise(w, w_ref, "replayed weights")
    assert_bitwise(out, combine_ref.moe_combine(y, w_ref), "replayed combine")
