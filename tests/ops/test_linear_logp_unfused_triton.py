"""linear_logp's opt-in ``unfused`` provider: the resolved det_gemm's logits, then the Triton
log-softmax, so that ``linear_logp[unfused] == logp[triton](det_gemm(h, W.t()))`` bitwise (what a
rollout computes on its logits) with any det_gemm family, the opt-in cuda one included.

Runs where the Triton kernels do: on a GPU, and on the CPU in the interpreter suite (its CPU
det_gemm is the native one); on a CPU without the interpreter only the refusal test runs."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.drift.metrics import logp_families
from rl_engine.ops import det_gemm, entropy, linear_logp, logp
from rl_engine.ops.det_gemm import cuda as gemm_cuda
from rl_engine.ops.linear_logp import unfused
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import DEVICE

PROV = KernelRegistry.provider("linear_logp", "unfused")
REASON = PROV.why_not(DEVICE, triton_interpret=config.settings().triton_interpret)
runnable = pytest.mark.skipif(
    REASON is not None, reason=f"linear_logp[unfused] on {DEVICE}: {REASON}"
)
# the interpreter suite runs fp32 / fp16 on small shapes; bf16 on the GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# det_gemm families the logits come from: the default resolution, and the opt-in cuda family
# where its library runs (an SM90 GPU)
GEMMS = [None] + (
    ["cuda"] if gemm_cuda.PROVIDER.why_not(DEVICE, triton_interpret=False) is None else []
)
VOCAB = 1100  # a 1024-column tile and a partial one
TEMP = 0.7


@pytest.fixture(params=GEMMS, ids=lambda g: g or "resolved")
def gemm(request, monkeypatch):
    """det_gemm pinned for the whole test (both the provider's logits and the composition)."""
    if request.param is not None:
        monkeypatch.setenv("RL_ENGINE_BACKEND_DET_GEMM", request.param)
    config.reload()
    yield request.param
    monkeypatch.delenv("RL_ENGINE_BACKEND_DET_GEMM", raising=False)
    config.reload()


def _inputs(t, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h) * 3).to(dtype)
    tokens = torch.randint(0, v, (t,), generator=g)
    return hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE)


def _dtypes(gemm):
    return [d for d in DTYPES if gemm != "cuda" or d != torch.float32]  # cuda: 16-bit wgrad


def test_opt_in_its_family_and_its_reason():
    assert PROV.opt_in and PROV.invariant
    assert PROV.numerics == "linear_logp/unfused-v1024[logp/triton-v1024]"
    assert logp_families([{"op": "linear_logp", "numerics": PROV.numerics}]) == [
        "logp/triton-v1024"
    ]
    assert KernelRegistry.get_op("linear_logp", device=DEVICE).provider.name != "unfused"
    h, w, t = _inputs(3, 8, 40, torch.float32)
    if REASON is None:
        linear_logp(h, w, t, backend="unfused")
    else:  # never another provider in its place
        with pytest.raises(BackendUnavailableError, match="Triton kernels need a CUDA device"):
            linear_logp(h, w, t, backend="unfused")


@runnable
@pytest.mark.parametrize("chunk", [unfused.TOKEN_CHUNK, 5])
def test_triton_equals_logp_of_det_gemm(gemm, monkeypatch, chunk):
    monkeypatch.setattr(unfused, "TOKEN_CHUNK", chunk)
    for dtype in _dtypes(gemm):
        h, w, t = _inputs(13, 32, VOCAB, dtype)
        lp, ent = linear_logp(h, w, t, TEMP, True, backend="unfused")
        logits = det_gemm(h, w.t())  # the same det_gemm resolution
        what = f"{dtype}, det_gemm {gemm or 'resolved'}, chunk {chunk}"
        assert_bitwise(lp, logp(logits, t, TEMP, backend="triton"), f"logp ({what})")
        assert_bitwise(ent, entropy(logits, TEMP, backend="triton"), f"entropy ({what})")
        assert_bitwise(linear_logp(h, w, t, TEMP, backend="unfused"), lp, f"no entropy ({what})")
        for i in (0, 6, 12):
            alone = linear_logp(h[i : i + 1], w, t[i : i + 1], TEMP, backend="unfused")
            assert_bitwise(alone, lp[i : i + 1], f"row {i} alone ({what})")


@runnable
@pytest.mark.parametrize("chunk", [unfused.TOKEN_CHUNK, 5])
def test_triton_grads_equal_autograd_of_the_composition(gemm, monkeypatch, chunk):
    """dhidden == autograd through ``logp[triton](det_gemm(h, W.t()))`` for any chunking;
    dweight too where one chunk holds every token (above, the chunk partials are added)."""
    monkeypatch.setattr(unfused, "TOKEN_CHUNK", chunk)
    for dtype in _dtypes(gemm):
        h, w, t = _inputs(13, 32, VOCAB, dtype)
        g = torch.randn(13, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        (linear_logp(h1, w1, t, TEMP, backend="unfused") * g).sum().backward()
        h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        (logp(det_gemm(h2, w2.t()), t, TEMP, backend="triton") * g).sum().backward()
        what = f"{dtype}, det_gemm {gemm or 'resolved'}, chunk {chunk}"
        assert h1.grad.dtype == w1.grad.dtype == dtype
        assert_bitwise(h1.grad, h2.grad, f"dhidden ({what})")
        if chunk >= 13:
            assert_bitwise(w1.grad, w2.grad, f"dweight ({what})")
        else:
            rtol, atol = tolerance(dtype, grad=True)
            assert_close(w1.grad, w2.grad, rtol=rtol, atol=atol, what=f"dweight ({what})")


@runnable
def test_triton_grads_with_entropy_vs_float64(gemm, monkeypatch):
    monkeypatch.setattr(unfused, "TOKEN_CHUNK", 5)
    for dtype in _dtypes(gemm):
        h, w, t = _inputs(11, 24, VOCAB, dtype, seed=3)
        gen = torch.Generator().manual_seed(4)
        g_lp, g_ent = (torch.randn(11, generator=gen).to(DEVICE) for _ in range(2))
        hi, wi = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = linear_logp(hi, wi, t, TEMP, True, backend="unfused")
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
        z = h64 @ w64.t()
        z = z + (det_gemm(h, w.t()).double() - z).detach()  # the forward's rounded logits
        lsm = torch.log_softmax(z / TEMP, -1)
        lp64, ent64 = lsm.gather(1, t[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
        ((lp64 * g_lp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
        rtol, atol = tolerance(dtype, grad=True)
        what = f"{dtype}, det_gemm {gemm or 'resolved'}"
        assert_close(hi.grad, h64.grad, rtol=rtol, atol=atol, what=f"dhidden ({what})")
        assert_close(wi.grad, w64.grad, rtol=rtol, atol=atol, what=f"dweight ({what})")


@runnable
def test_triton_dweight_deterministic_and_zero_padding_invariant(monkeypatch):
    monkeypatch.setattr(unfused, "TOKEN_CHUNK", 4)
    for dtype in DTYPES:
        h, w, t = _inputs(10, 16, VOCAB, dtype, seed=5)

        def dw(hh, tt, w=w):
            wi = w.clone().requires_grad_(True)
            g = torch.ones(hh.shape[0], device=DEVICE)
            (linear_logp(hh, wi, tt, TEMP, backend="unfused") * g).sum().backward()
            return wi.grad

        first = dw(h, t)
        assert_bitwise(dw(h, t), first, f"run to run ({dtype})")
        padded = torch.cat([h, torch.zeros_like(h[:3])])
        # zero hidden rows add zero gradient rows only where their logp gradient is zero too
        ones_then_zero = torch.cat([torch.ones(10), torch.zeros(3)]).to(DEVICE)
        wi = w.clone().requires_grad_(True)
        tp = torch.cat([t, t[:3]])
        (linear_logp(padded, wi, tp, TEMP, backend="unfused") * ones_then_zero).sum().backward()
        assert_bitwise(wi.grad, first, f"appended rows with zero gradient ({dtype})")
