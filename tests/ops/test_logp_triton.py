"""Triton providers of logp, entropy and linear_logp: numerics vs float64, bitwise row
invariance (forward and dX), fusion transparency, deterministic / zero-padding-invariant dweight,
memory bound, registry and errors.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16) and skip
otherwise; on a CUDA device they run on the GPU (fp32 / fp16 / bf16, plus a real-size bf16 case).
Chunk constants are patched small in the interpreter so that every chunk boundary is crossed.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import det_gemm, entropy, linear_logp, logp
from rl_engine.ops.det_gemm import triton as gemm_triton
from rl_engine.ops.entropy import triton as ent_triton
from rl_engine.ops.linear_logp import triton as ll_triton
from rl_engine.ops.logp import triton as lp_triton
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import DEVICE, ON_GPU, TRITON_DTYPES, gpu, skip_unless_triton, triton_runnable
from tests.ops._vocab import LargestTensor

RUNNABLE = triton_runnable(lp_triton)
needs_triton = skip_unless_triton(lp_triton)
DTYPES = TRITON_DTYPES
TILE = lp_triton.VOCAB_TILE
# Small chunks (interpreter) so that a few dozen rows cross every boundary. The weight-gradient
# chunks must be multiples of the kernels' token step (16 in the interpreter, up to 64 on the
# GPU); the backward blocks are multiples of them.
_SMALL_CHUNK = 8
_SMALL_WGRAD = 128 if ON_GPU else 32
_SMALL_DH = _SMALL_WGRAD // 2
_SMALL_SLICE = 256


def _patch_wgrad_chunks(monkeypatch):
    monkeypatch.setattr(gemm_triton, "WGRAD_CHUNK", _SMALL_WGRAD)
    monkeypatch.setattr(ll_triton, "DH_CHUNK", _SMALL_DH)


@pytest.fixture
def small_chunks(monkeypatch):
    _patch_wgrad_chunks(monkeypatch)
    monkeypatch.setattr(ll_triton, "TOKEN_CHUNK", _SMALL_CHUNK)
    monkeypatch.setattr(ll_triton, "BWD_TOKEN_CHUNK", _SMALL_WGRAD)
    monkeypatch.setattr(ll_triton, "VOCAB_SLICE", _SMALL_SLICE)
    return _SMALL_CHUNK


def _logits(t, v, dtype, *, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(t, v, generator=g)).to(dtype).to(DEVICE)


def _lm_inputs(t, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h) * 3).to(dtype).to(DEVICE)
    tokens = torch.randint(0, v, (t,), generator=g).to(DEVICE)
    return hidden, weight, tokens


def _row_tokens(rows, vocab):
    """Token ids that are a function of each row alone (so padded / sliced batches agree)."""
    return (rows[:, 0].detach().float().abs() * 1000).long() % vocab


def _ref64(z64, tokens=None):
    lsm = torch.log_softmax(z64, -1)
    p = lsm.exp()
    ent = -torch.where(p > 0, p * lsm, torch.zeros_like(p)).sum(-1)  # 0 * -inf -> 0
    lp = lsm.gather(1, tokens.long()[:, None])[:, 0] if tokens is not None else None
    return lp, ent


def _gemm(h, w):
    return det_gemm(h, w.t(), backend="triton")


# --------------------------------------------------------------------- registry / availability
def test_registry_and_availability():
    for op, mod in (("logp", lp_triton), ("entropy", ent_triton), ("linear_logp", ll_triton)):
        p = KernelRegistry.provider(op, "triton")
        assert p is mod.PROVIDER and p.invariant and {"forward", "backward"} <= set(p.extras)
        reason = p.why_not("cpu", triton_interpret=False)
        assert reason is not None and "TRITON_INTERPRET=1" in reason
        assert "not supported" in (p.available("rocm", triton_interpret=True) or "")
        assert KernelRegistry.providers(op, "cuda")[0].name == "triton"
    assert lp_triton.PROVIDER.numerics == "logp/triton-v1024"
    assert ent_triton.PROVIDER.numerics == "entropy/triton-v1024"
    fam = ll_triton.PROVIDER.numerics
    assert "det_gemm/triton" in fam and "logp/triton-v1024" in fam
    # the CPU default stays the reference
    assert KernelRegistry.get_op("logp", device="cpu").provider.name == "native"


def test_unavailable_backend_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    x, tok = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        logp(x, tok, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        entropy(x, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        linear_logp(torch.randn(2, 3), torch.randn(5, 3), tok, backend="triton")
    if lp_triton.triton is not None:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            lp_triton.logp(x, tok, 1.0)
        with pytest.raises(RuntimeError, match="not supported"):
            lp_triton.check_device(torch.empty(2, 2, device="meta"))


@needs_triton
def test_direct_call_errors():
    x = torch.randn(3, 5, device=DEVICE)
    with pytest.raises(TypeError, match="not supported"):
        lp_triton.logp(x.double(), torch.zeros(3, dtype=torch.long, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="one per row"):
        lp_triton.logp(x, torch.zeros(4, dtype=torch.long, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="> 0"):
        ent_triton.entropy(x, 0.0)
    with pytest.raises(ValueError, match="disagree on H"):
        ll_triton.linear_logp(
            x,
            torch.randn(7, 4, device=DEVICE),
            torch.zeros(3, dtype=torch.long, device=DEVICE),
            1.0,
        )
    if not ON_GPU:  # the range check is a device-side assert on CUDA
        with pytest.raises(ValueError, match=r"\[0, 5\)"):
            lp_triton.logp(x, torch.tensor([0, 5, 1]), 1.0)


# --------------------------------------------------------------------- logp / entropy
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (9, 2 * TILE + 1), (3, lp_triton.SEGMENT + 77), (0, 10)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_vs_float64(dtype, shape, temperature):
    t, v = shape
    x = _logits(t, v, dtype)
    tok = torch.randint(0, v, (t,)).to(DEVICE)
    lp = logp(x, tok, temperature, backend="triton")
    ent = entropy(x, temperature, backend="triton")
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (t,)
    lp64, ent64 = _ref64(x.double() / temperature, tok)
    rtol, atol = FP32_OUT
    assert_close(lp, lp64, rtol=rtol, atol=atol, what=f"logp {dtype} {shape}")
    assert_close(ent, ent64, rtol=rtol, atol=atol, what=f"entropy {dtype} {shape}")


@needs_triton
def test_minus_inf_columns_and_peaked_rows():
    v = 3000
    x = torch.zeros(4, v)
    x[1, 17] = 100.0  # max in the first tile
    x[2, 2999] = 60.0  # max in the last tile: the rescaling of u matters
    x[3, : 2 * TILE] = -math.inf  # leading tiles at -inf: starts from -inf without NaN
    x = x.to(DEVICE)
    tok = torch.tensor([0, 17, 2999, 2500], device=DEVICE)
    lp, ent = logp(x, tok, backend="triton"), entropy(x, backend="triton")
    lp64, ent64 = _ref64(x.double(), tok)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert_close(lp, lp64, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="peaked logp")
    assert_close(ent, ent64, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="peaked entropy")
    padded = torch.cat([x, torch.full((4, TILE + 5), -math.inf, device=DEVICE)], 1)
    assert_bitwise(logp(padded, tok, backend="triton"), lp, "vocab padding at -inf")
    xi = padded.clone().requires_grad_(True)
    (logp(xi, tok, backend="triton").sum() + entropy(xi, backend="triton").sum()).backward()
    assert torch.equal(xi.grad[:, v:], torch.zeros_like(xi.grad[:, v:]))
    assert torch.isfinite(xi.grad).all()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_dlogits_vs_float64(dtype):
    v = 2 * TILE + 33
    x = _logits(13, v, dtype, scale=3.0)
    tok = torch.randint(0, v, (13,)).to(DEVICE)
    g1, g2 = torch.randn(13).to(DEVICE), torch.randn(13).to(DEVICE)
    xi = x.clone().requires_grad_(True)
    ((logp(xi, tok, 0.6, backend="triton") * g1).sum()).backward()
    xe = x.clone().requires_grad_(True)
    ((entropy(xe, 0.6, backend="triton") * g2).sum()).backward()
    assert xi.grad.dtype == xe.grad.dtype == dtype
    x64 = x.double().requires_grad_(True)
    lp64, ent64 = _ref64(x64 / 0.6, tok)
    d_lp = torch.autograd.grad((lp64 * g1.double()).sum(), x64, retain_graph=True)[0]
    d_ent = torch.autograd.grad((ent64 * g2.double()).sum(), x64)[0]
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(xi.grad, d_lp, rtol=rtol, atol=atol, what="logp dlogits")
    assert_close(xe.grad, d_ent, rtol=rtol, atol=atol, what="entropy dlogits")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_logp_entropy(dtype):
    v = TILE + 77
    x = _logits(40, v, dtype, scale=3.0)
    counts = (1, 2, 17, 33)

    def fwd(r):
        lp = logp(r, _row_tokens(r, v), 0.7, backend="triton")
        return torch.stack([lp, entropy(r, 0.7, backend="triton")], 1)

    def dx(r):
        r = r.clone().requires_grad_(True)
        g = r[:, 1].detach().float() + 0.5  # upstream grad: a function of the row
        lp = logp(r, _row_tokens(r, v), 0.7, backend="triton")
        ent = entropy(r, 0.7, backend="triton")
        ((lp * g).sum() + (ent * g * 0.25).sum()).backward()
        return r.grad

    check_row_invariance(fwd, x, counts=counts, what=f"logp/entropy {dtype}")
    check_row_invariance(dx, x, counts=counts, what=f"logp/entropy dlogits {dtype}")


@needs_triton
def test_strided_int32_and_misaligned():
    base = torch.randn(2100, 30).to(DEVICE)
    x = base.t()  # [30, 2100], non-contiguous
    tok = torch.randint(0, 2100, (30,)).to(DEVICE)
    ref = logp(x.contiguous(), tok, 0.9, backend="triton")
    assert_bitwise(logp(x, tok, 0.9, backend="triton"), ref, "strided")
    assert_bitwise(logp(x, tok.int(), 0.9, backend="triton"), ref, "int32 tokens")
    flat = torch.randn(31 * 2101 + 1).to(DEVICE)
    odd = flat[1:].view(31, 2101)  # base and row stride not 16-byte aligned
    assert_bitwise(
        entropy(odd, backend="triton"), entropy(odd.clone(), backend="triton"), "misaligned"
    )


@needs_triton
def test_opcheck():
    x, tok = torch.randn(5, 1030).to(DEVICE), torch.randint(0, 1030, (5,)).to(DEVICE)
    g = torch.randn(5).to(DEVICE)
    torch.library.opcheck(torch.ops.rl_engine.logp.default, (x, tok, 0.7, "triton"))
    torch.library.opcheck(torch.ops.rl_engine.entropy.default, (x, 0.7, "triton"))
    lp, lse = torch.ops.rl_engine.logp(x, tok, 0.7, "triton")
    ent, _ = torch.ops.rl_engine.entropy(x, 0.7, "triton")
    torch.library.opcheck(
        torch.ops.rl_engine.logp_backward.default, (x, tok, 0.7, lse, g, "triton")
    )
    torch.library.opcheck(
        torch.ops.rl_engine.entropy_backward.default, (x, 0.7, lse, ent, g, "triton")
    )
    h, w, t = _lm_inputs(5, 8, 1030, torch.float32)
    op = torch.ops.rl_engine.linear_logp.default
    torch.library.opcheck(op, (h, w, t, 0.7, True, "triton"))
    lp, ent, lse = op(h, w, t, 0.7, True, "triton")
    torch.library.opcheck(
        torch.ops.rl_engine.linear_logp_backward.default,
        (h, w, t, 0.7, lse, ent, g, g, True, True, "triton"),
    )


# --------------------------------------------------------------------- linear_logp
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, temperature", [(1000, 1.0), (2 * TILE + 1, 0.7)])
@pytest.mark.parametrize("chunked", [False, True])
def test_fusion_transparent(dtype, vocab, temperature, chunked, monkeypatch):
    if chunked:  # token chunk boundaries inside the batch (17 rows: 8 + 8 + 1)
        monkeypatch.setattr(ll_triton, "TOKEN_CHUNK", _SMALL_CHUNK)
    hidden, weight, tokens = _lm_inputs(17, 24, vocab, dtype)
    lp, ent = linear_logp(hidden, weight, tokens, temperature, True, backend="triton")
    logits = _gemm(hidden, weight)
    assert_bitwise(lp, logp(logits, tokens, temperature, backend="triton"), "logp(det_gemm)")
    assert_bitwise(ent, entropy(logits, temperature, backend="triton"), "entropy(det_gemm)")
    lp_only = linear_logp(hidden, weight, tokens, temperature, backend="triton")
    assert_bitwise(lp_only, lp, "without entropy")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_logp_grads_vs_float64(dtype, small_chunks):
    t, h, v = 19, 32, 2 * TILE + 17  # 3 forward token chunks; backward: 2 x 9 blocks (CPU)
    hidden, weight, tokens = _lm_inputs(t, h, v, dtype)
    g_lp, g_ent = torch.randn(t).to(DEVICE), torch.randn(t).to(DEVICE)
    hi, wi = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = linear_logp(hi, wi, tokens, 0.7, True, backend="triton")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert hi.grad.dtype == wi.grad.dtype == dtype
    logits = _gemm(hidden, weight)
    lp64, ent64 = _ref64(logits.double() / 0.7, tokens)
    assert_close(lp, lp64, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="logp")
    assert_close(ent, ent64, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="entropy")
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    z = h64 @ w64.t()
    z = z + (logits.double() - z).detach()  # the forward's rounding of the logits
    lp64, ent64 = _ref64(z / 0.7, tokens)
    ((lp64 * g_lp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(hi.grad, h64.grad, rtol=rtol, atol=atol, what="dhidden")
    assert_close(wi.grad, w64.grad, rtol=rtol, atol=atol, what="dweight")


@needs_triton
def test_logp_only_and_hidden_only_grads(small_chunks):
    hidden, weight, tokens = _lm_inputs(9, 16, 1100, torch.float32)
    hi, wi = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    linear_logp(hi, wi, tokens, 1.2, backend="triton").sum().backward()
    hj = hidden.clone().requires_grad_(True)
    linear_logp(hj, weight, tokens, 1.2, backend="triton").sum().backward()
    assert_bitwise(hj.grad, hi.grad, "dhidden with / without dweight")
    wj = weight.clone().requires_grad_(True)
    linear_logp(hidden, wj, tokens, 1.2, backend="triton").sum().backward()
    assert_bitwise(wj.grad, wi.grad, "dweight with / without dhidden")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_logp_row_invariance(dtype, small_chunks):
    _, weight, _ = _lm_inputs(1, 16, TILE + 77, dtype)  # two vocabulary slices
    x = torch.randn(18, 16).to(dtype).to(DEVICE)
    v = weight.shape[0]
    # counts straddle the (patched) token chunk of 8: 7, 8, 9, 17
    counts = (1, 7, 8, 9, 17)

    def fwd(rows):
        lp, ent = linear_logp(rows, weight, _row_tokens(rows, v), 0.7, True, backend="triton")
        return torch.stack([lp, ent], 1)

    def dx(rows):
        rows = rows.clone().requires_grad_(True)
        lp, ent = linear_logp(rows, weight, _row_tokens(rows, v), 0.7, True, backend="triton")
        g = rows[:, 1].detach().float() + 0.5
        ((lp * g).sum() + (ent * g * 0.25).sum()).backward()
        return rows.grad

    check_row_invariance(fwd, x, counts=counts, what=f"linear_logp {dtype}")
    if ON_GPU or dtype == torch.float32:  # the interpreter's time goes to fp32 (same code path)
        check_row_invariance(dx, x, counts=counts, what=f"linear_logp dhidden {dtype}")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_dweight_deterministic_and_zero_padding_invariant(dtype, small_chunks, monkeypatch):
    hidden, weight, tokens = _lm_inputs(11, 16, 1100, dtype)
    g = torch.randn(11).to(DEVICE)

    def dw(h, t, gg):
        wi = weight.clone().requires_grad_(True)
        linear_logp(h, wi, t, 0.8, backend="triton").backward(gg)
        return wi.grad

    base = dw(hidden, tokens, g)
    assert_bitwise(dw(hidden, tokens, g), base, "dweight run-to-run")
    for pad in (1, 7):  # within the last token chunk, and a new chunk of zero rows
        hp = torch.cat([hidden, torch.zeros(pad, 16, dtype=dtype, device=DEVICE)])
        tp = torch.cat([tokens, torch.zeros(pad, dtype=tokens.dtype, device=DEVICE)])
        gp = torch.cat([g, torch.randn(pad).to(DEVICE)])  # any upstream grad: zero hidden rows
        assert_bitwise(dw(hp, tp, gp), base, f"dweight with {pad} zero rows")
    if not ON_GPU and dtype != torch.float32:
        return  # interpreter time: the slice check below runs for fp32 (same code path)
    # dweight does not depend on the vocabulary slice (column-invariant weight gradient)
    monkeypatch.setattr(ll_triton, "VOCAB_SLICE", 2 * TILE)
    assert_bitwise(dw(hidden, tokens, g), base, "dweight vs vocabulary slice")


def _backward_vs_wgrad(t, h, v, dtype, temperature=0.7):
    """linear_logp's backward against the weight-gradient kernel applied once to the full
    dlogits [T, V] (the module docstring's identities), both ways, with entropy gradients."""
    hidden, weight, tokens = _lm_inputs(t, h, v, dtype, seed=3)
    g_lp = torch.randn(t).to(DEVICE)
    g_ent = torch.randn(t).to(DEVICE)
    _, ent, lse = ll_triton.linear_logp_forward(hidden, weight, tokens, temperature, True)
    dh, dw = ll_triton.linear_logp_backward(
        hidden, weight, tokens, temperature, lse, ent, g_lp, g_ent, True, True
    )
    dlogits = lp_triton.vocab_backward(
        _gemm(hidden, weight),
        temperature,
        lse,
        tokens=tokens,
        grad_logp=g_lp,
        entropy=ent,
        grad_entropy=g_ent,
    )
    want_dw = gemm_triton.det_gemm_wgrad(dlogits, hidden).to(dtype)
    assert_bitwise(dw, want_dw, "dweight == det_gemm_wgrad(dlogits, hidden)")
    want_dh = gemm_triton.det_gemm_wgrad(dlogits.t(), weight, chunk=ll_triton.DH_CHUNK).to(dtype)
    assert_bitwise(dh, want_dh, "dhidden == det_gemm_wgrad(dlogits.t(), weight, DH_CHUNK)")


@needs_triton
@pytest.mark.parametrize("blocks", [(1, 1), (2, 1), (1, 3), (3, 2)])
def test_backward_blocks_are_wgrad_chunks(blocks, monkeypatch):
    # at small chunks: 2.5 token chunks and 3.3 vocabulary chunks' worth of columns (3 token
    # partials, 7 vocabulary partials, the last ones short); backward blocks of 1-3 chunks
    # each way. Every size gives the bits of one weight-gradient product over everything: the
    # blocks continue the running sum chunk by chunk (``accumulate``)
    _patch_wgrad_chunks(monkeypatch)
    chunk = _SMALL_WGRAD
    t, v = 2 * chunk + chunk // 2, 3 * chunk + 5
    monkeypatch.setattr(ll_triton, "BWD_TOKEN_CHUNK", blocks[0] * chunk)
    monkeypatch.setattr(ll_triton, "VOCAB_SLICE", blocks[1] * _SMALL_DH)
    _backward_vs_wgrad(t, 8, v, torch.float32)


@needs_triton
def test_backward_blocks_must_be_whole_chunks(monkeypatch):
    _patch_wgrad_chunks(monkeypatch)
    monkeypatch.setattr(ll_triton, "BWD_TOKEN_CHUNK", _SMALL_WGRAD)
    monkeypatch.setattr(ll_triton, "VOCAB_SLICE", _SMALL_DH + 1)
    with pytest.raises(ValueError, match="must be a positive multiple of WGRAD_CHUNK"):
        _backward_vs_wgrad(5, 8, 40, torch.float32)


def test_shipped_backward_blocks_are_wgrad_chunks():
    assert ll_triton.BWD_TOKEN_CHUNK % gemm_triton.WGRAD_CHUNK == 0
    for h in (64, 2048, 3000, 4096, 5120):  # auto slices: whole chunks, no more than H (or one)
        vs = ll_triton._vocab_slice(h)
        assert vs % ll_triton.DH_CHUNK == 0 and (vs <= h or vs == ll_triton.DH_CHUNK)


@gpu
def test_gpu_backward_blocks_are_wgrad_chunks_bf16():
    # shipped blocks on the GPU's kernels (TMA plans): two token blocks of two chunks each (the
    # last one short), five vocabulary slices (the last one short)
    c = gemm_triton.WGRAD_CHUNK
    assert ll_triton.BWD_TOKEN_CHUNK == 2 * c
    _backward_vs_wgrad(3 * c + 100, 256, 2 * c + 1029, torch.bfloat16)


@needs_triton
def test_never_materialises_logits(small_chunks):
    t, h, v = 20, 8, 1100
    hidden, weight, tokens = _lm_inputs(t, h, v, torch.float32)
    with LargestTensor("nbytes") as seen:
        lp, ent, lse = ll_triton.linear_logp_forward(hidden, weight, tokens, 0.9, True)
        g = torch.ones_like(lp)
        ll_triton.linear_logp_backward(hidden, weight, tokens, 0.9, lse, ent, g, g, True, True)
    # the largest (bytes; the interpreter copies buffers as bytes): a logits block, or [T, H] /
    # [V, H] (dhidden, dweight), all fp32 here
    assert seen.nbytes <= 4 * max(_SMALL_CHUNK * v, t * h, v * h), f"largest {seen.shape}"
    assert seen.nbytes < 4 * t * v // 2


# --------------------------------------------------------------------- GPU only (bf16, real size)
@gpu
def test_gpu_shipped_chunk_boundaries_bf16():
    chunk = ll_triton.TOKEN_CHUNK
    hidden, weight, _ = _lm_inputs(chunk + 9, 256, 3 * TILE + 5, torch.bfloat16)
    v = weight.shape[0]

    def fwd(rows):
        lp, ent = linear_logp(rows, weight, _row_tokens(rows, v), 0.8, True, backend="triton")
        return torch.stack([lp, ent], 1)

    check_row_invariance(
        fwd, hidden, counts=(1, 17, chunk - 1, chunk, chunk + 1), what="shipped chunk"
    )
    tok = _row_tokens(hidden, v)
    logits = _gemm(hidden, weight)
    assert_bitwise(
        fwd(hidden)[:, 0], logp(logits, tok, 0.8, backend="triton"), "fusion, shipped chunk"
    )


@gpu
def test_gpu_real_size_bf16():
    t, h, v = 2048, 2048, 151936
    hidden, weight, tokens = _lm_inputs(t, h, v, torch.bfloat16)
    lp, ent = linear_logp(hidden, weight, tokens, 0.7, True, backend="triton")
    logits = _gemm(hidden, weight)
    assert_bitwise(lp, logp(logits, tokens, 0.7, backend="triton"), "real size fusion logp")
    assert_bitwise(ent, entropy(logits, 0.7, backend="triton"), "real size fusion entropy")
    for k in (1, 333):
        lpk, entk = linear_logp(hidden[:k], weight, tokens[:k], 0.7, True, backend="triton")
        assert_bitwise(lpk, lp[:k], f"real size first {k} rows")
        assert_bitwise(entk, ent[:k], f"real size entropy first {k} rows")
    lp64, ent64 = _ref64(logits.double() / 0.7, tokens)
    assert_close(lp, lp64, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="real size logp")
    assert_close(ent, ent64, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="real size entropy")
    del logits, lp64, ent64
    g = torch.randn(t, device=DEVICE)

    def grads(n):
        hi = hidden[:n].clone().requires_grad_(True)
        wi = weight.clone().requires_grad_(True)
        linear_logp(hi, wi, tokens[:n], 0.7, backend="triton").backward(g[:n])
        return hi.grad, wi.grad

    dh, dw = grads(t)
    dh2, dw2 = grads(t)
    assert_bitwise(dh2, dh, "real size dhidden run-to-run")
    assert_bitwise(dw2, dw, "real size dweight run-to-run")
    assert_bitwise(grads(777)[0], dh[:777], "real size dhidden first 777 rows")
    assert torch.isfinite(dh.float()).all() and torch.isfinite(dw.float()).all()


@needs_triton
def test_strided_token_columns_regression():
    """Tokens taken as a column of a [B, T] id matrix (stride T): a rollout computing the log-prob
    of step i as ``logp(logits, seq[:, i])`` once read the wrong ids for rows > 0."""
    torch.manual_seed(7)
    seq = torch.randint(0, 300, (5, 9), device=DEVICE)
    col = seq[:, 4]
    assert col.stride(0) != 1
    x = torch.randn(5, 300, device=DEVICE)
    h, w = torch.randn(5, 16, device=DEVICE), torch.randn(300, 16, device=DEVICE)
    for backend in ("triton", "native"):
        assert_bitwise(
            logp(x, col, 0.8, backend=backend),
            logp(x, col.contiguous(), 0.8, backend=backend),
            f"logp strided tokens ({backend})",
        )
        hi = h.clone().requires_grad_(True)
        hj = h.clone().requires_grad_(True)
        a = linear_logp(hi, w, col, 0.8, backend=backend)
        b = linear_logp(hj, w, col.contiguous(), 0.8, backend=backend)
        assert_bitwise(a, b, f"linear_logp strided tokens ({backend})")
        a.sum().backward()
        b.sum().backward()
        assert_bitwise(hi.grad, hj.grad, f"linear_logp strided tokens backward ({backend})")
