"""linear_logp: fusion transparency (bitwise == logp(det_gemm)), numerics vs float64 (forward,
dhidden, dweight), row invariance, deterministic dweight, memory bound, errors, opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import det_gemm, entropy, linear_logp, logp
from rl_engine.ops.linear_logp import reference as ll_ref
from rl_engine.ops.linear_logp import stock as ll_stock
from rl_engine.ops.logp.reference import VOCAB_TILE
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import backend_fixture
from tests.ops._vocab import LargestTensor

DTYPES = [torch.float32, torch.bfloat16]
# (TOKEN_CHUNK, VOCAB_CHUNK) work tiles: the shipped ones and smaller ones that split the
# tokens / vocabulary into several chunks (the forward must not depend on them)
CHUNKS = [(ll_ref.TOKEN_CHUNK, ll_ref.VOCAB_CHUNK), (7, VOCAB_TILE), (64, 2 * VOCAB_TILE)]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("linear_logp", device="cpu")


@pytest.fixture
def chunks(monkeypatch, request):
    tc, vc = request.param
    monkeypatch.setattr(ll_ref, "TOKEN_CHUNK", tc)
    monkeypatch.setattr(ll_ref, "VOCAB_CHUNK", vc)
    return tc, vc


def _inputs(t, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h) * 3).to(dtype)
    tokens = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, tokens


def _row_tokens(rows, vocab):
    """Token ids that are a function of each row alone (so padded / sliced batches agree)."""
    return (rows[:, 0].detach().float().abs() * 1000).long() % vocab


def _ref64(z64, tokens):
    """(logp, entropy) in float64 from float64 scaled logits."""
    lsm = torch.log_softmax(z64, -1)
    return lsm.gather(1, tokens[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


# ------------------------------------------------------------------ fusion transparency
@pytest.mark.parametrize("chunks", CHUNKS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "vocab, temperature", [(1000, 1.0), (VOCAB_TILE, 0.7), (2 * VOCAB_TILE + 1, 1.3), (5000, 0.7)]
)
def test_fusion_transparent(backend, chunks, dtype, vocab, temperature):
    hidden, weight, tokens = _inputs(11, 24, vocab, dtype)
    lp, ent = linear_logp(hidden, weight, tokens, temperature, True, backend=backend)
    logits = det_gemm(hidden, weight.t(), backend=backend)  # same provider family on both sides
    assert_bitwise(
        lp, logp(logits, tokens, temperature, backend=backend), "linear_logp vs logp(det_gemm)"
    )
    assert_bitwise(
        ent, entropy(logits, temperature, backend=backend), "entropy vs entropy(det_gemm)"
    )
    assert_bitwise(linear_logp(hidden, weight, tokens, temperature, backend=backend), lp, "no ent")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fusion_transparent_large_vocab(backend, dtype):
    hidden, weight, tokens = _inputs(3, 16, 50257, dtype)  # GPT-2 vocab: 49 tiles + 81 columns
    tokens[0] = 50256
    lp, ent = linear_logp(hidden, weight, tokens, 0.9, True, backend=backend)
    logits = det_gemm(hidden, weight.t(), backend=backend)
    assert_bitwise(lp, logp(logits, tokens, 0.9, backend=backend), "V=50257 logp")
    assert_bitwise(ent, entropy(logits, 0.9, backend=backend), "V=50257 entropy")


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8, 7), (33, 64, 1000), (17, 37, 2 * VOCAB_TILE + 5)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_numerics_vs_float64(backend, dtype, shape, temperature):
    t, h, v = shape
    hidden, weight, tokens = _inputs(t, h, v, dtype)
    lp, ent = linear_logp(hidden, weight, tokens, temperature, True, backend=backend)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (t,)
    rtol, atol = FP32_OUT
    # the contract: logp of the logits rounded to hidden.dtype, computed exactly
    logits = det_gemm(hidden, weight.t(), backend=backend)
    lp64, ent64 = _ref64(logits.double() / temperature, tokens)
    assert_close(lp, lp64, rtol=rtol, atol=atol, what="logp vs fp64 of det_gemm logits")
    assert_close(ent, ent64, rtol=rtol, atol=atol, what="entropy vs fp64 of det_gemm logits")
    # end to end against float64 everywhere: the logits' rounding to hidden.dtype dominates.
    # Each scaled logit is within u * max|z| of the exact one (u: one ulp of hidden.dtype, i.e.
    # twice the rounding error, covering the fp32 accumulation too), and logp / entropy move by
    # at most twice the largest logit error.
    lp64, ent64 = _ref64(hidden.double() @ weight.double().t() / temperature, tokens)
    rtol, atol = tolerance(dtype, k=h)
    if dtype != torch.float32:
        atol = 2 * torch.finfo(dtype).eps * logits.abs().max().item() / temperature + FP32_OUT[1]
    assert_close(lp, lp64, rtol=rtol, atol=atol, what="logp end to end")
    assert_close(ent, ent64, rtol=rtol, atol=atol, what="entropy end to end")


def _grads64(hidden, weight, tokens, temperature, g_lp, g_ent, backend="native"):
    """float64 (dhidden, dweight); logits rounded to ``dtype`` as the forward does."""
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    z = h64 @ w64.t()
    # keep the forward's rounding of the logits (not differentiated: straight-through)
    z = z + (det_gemm(hidden, weight.t(), backend=backend).double() - z).detach()
    lp, ent = _ref64(z / temperature, tokens)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return h64.grad, w64.grad


@pytest.mark.parametrize("chunks", CHUNKS[:2], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grads_vs_float64(backend, chunks, dtype, temperature):
    hidden, weight, tokens = _inputs(23, 48, 2 * VOCAB_TILE + 17, dtype)
    g_lp, g_ent = torch.randn(23), torch.randn(23)
    hi = hidden.clone().requires_grad_(True)
    wi = weight.clone().requires_grad_(True)
    lp, ent = linear_logp(hi, wi, tokens, temperature, True, backend=backend)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert hi.grad.dtype == wi.grad.dtype == dtype
    dh64, dw64 = _grads64(
        hidden, weight, tokens, temperature, g_lp.double(), g_ent.double(), backend
    )
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(hi.grad, dh64, rtol=rtol, atol=atol, what="dhidden")
    assert_close(wi.grad, dw64, rtol=rtol, atol=atol, what="dweight")


@pytest.mark.parametrize("return_entropy", [False, True])
def test_logp_only_grads(backend, return_entropy):
    hidden, weight, tokens = _inputs(9, 24, 1500, torch.float32)
    g = torch.randn(9)
    hi = hidden.clone().requires_grad_(True)
    wi = weight.clone().requires_grad_(True)
    out = linear_logp(hi, wi, tokens, 1.2, return_entropy, backend=backend)
    assert isinstance(out, tuple) == return_entropy
    (out[0] if return_entropy else out).backward(g)
    dh64, dw64 = _grads64(hidden, weight, tokens, 1.2, g.double(), 0.0, backend)
    rtol, atol = tolerance(torch.float32, grad=True)
    assert_close(hi.grad, dh64, rtol=rtol, atol=atol, what="dhidden")
    assert_close(wi.grad, dw64, rtol=rtol, atol=atol, what="dweight")


def test_grad_wrt_hidden_only(backend):
    hidden, weight, tokens = _inputs(9, 24, 1500, torch.float32)
    hi = hidden.clone().requires_grad_(True)
    linear_logp(hi, weight, tokens, backend=backend).sum().backward()
    hj = hidden.clone().requires_grad_(True)
    wj = weight.clone().requires_grad_(True)
    linear_logp(hj, wj, tokens, backend=backend).sum().backward()
    assert_bitwise(hi.grad, hj.grad, "dhidden with / without dweight")


# ------------------------------------------------------------------ invariance
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    # 280 rows straddle the shipped TOKEN_CHUNK = 256 (counts 255, 256, 257)
    assert ll_ref.TOKEN_CHUNK == 256
    _, weight, _ = _inputs(1, 16, VOCAB_TILE + 77, dtype)
    x = torch.randn(260, 16).to(dtype)
    v = weight.shape[0]

    def fwd(rows):
        lp, ent = linear_logp(rows, weight, _row_tokens(rows, v), 0.7, True, backend=backend)
        return torch.stack([lp, ent], 1)

    counts = (1, 2, 17, 31, 33, 255, 256, 257)
    check_row_invariance(fwd, x, counts=counts, what=f"linear_logp {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_dx(backend, dtype, monkeypatch):
    monkeypatch.setattr(ll_ref, "TOKEN_CHUNK", 16)  # several token chunks in a 33-row batch
    _, weight, _ = _inputs(1, 24, VOCAB_TILE + 77, dtype)
    x = torch.randn(33, 24).to(dtype)
    v = weight.shape[0]

    def dx(rows):
        rows = rows.clone().requires_grad_(True)
        lp, ent = linear_logp(rows, weight, _row_tokens(rows, v), 0.7, True, backend=backend)
        g = rows[:, 1].detach().float() + 0.5  # upstream grads: functions of the row
        ((lp * g).sum() + (ent * g * 0.25).sum()).backward()
        return rows.grad

    check_row_invariance(dx, x, counts=(1, 2, 16, 17, 31, 33), what=f"dhidden {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dweight_deterministic_and_zero_padding_invariant(backend, dtype, monkeypatch):
    monkeypatch.setattr(ll_ref, "TOKEN_CHUNK", 16)
    hidden, weight, tokens = _inputs(37, 24, 1100, dtype)
    g = torch.randn(37)

    def dw(h, t, gg):
        wi = weight.clone().requires_grad_(True)
        linear_logp(h, wi, t, 0.8, backend=backend).backward(gg)
        return wi.grad

    base = dw(hidden, tokens, g)
    assert_bitwise(dw(hidden, tokens, g), base, "dweight run-to-run")
    for pad in (1, 11, 40):  # within the last chunk, and new chunks of zero rows
        hp = torch.cat([hidden, torch.zeros(pad, 24, dtype=dtype)])
        tp = torch.cat([tokens, torch.zeros(pad, dtype=tokens.dtype)])
        gp = torch.cat([g, torch.randn(pad)])  # any upstream grad: the rows' hidden is zero
        assert_bitwise(dw(hp, tp, gp), base, f"dweight with {pad} zero rows")


# ------------------------------------------------------------------ memory bound
def _run(impl, hidden, weight, tokens):
    lp, ent, lse = impl.linear_logp_forward(hidden, weight, tokens, 0.9, True)
    g = torch.ones_like(lp)
    impl.linear_logp_backward(hidden, weight, tokens, 0.9, lse, ent, g, g, True, True)


def test_never_materialises_logits(monkeypatch):
    tc, vc = 32, VOCAB_TILE
    monkeypatch.setattr(ll_ref, "TOKEN_CHUNK", tc)
    monkeypatch.setattr(ll_ref, "VOCAB_CHUNK", vc)
    t, h, v = 256, 16, 2100
    hidden, weight, tokens = _inputs(t, h, v, torch.float32)
    with LargestTensor() as native:
        _run(ll_ref, hidden, weight, tokens)
    # everything the op creates is a logits block, or [T, H] / [V, H] sized (dhidden, dweight)
    assert native.numel <= max(tc * vc, t * h, v * h), f"largest tensor {native.shape}"
    assert native.numel < t * v // 10
    # the check can fail: the stock provider holds [T, V] logits
    with LargestTensor() as stock:
        _run(ll_stock, hidden, weight, tokens)
    assert stock.numel >= t * v, f"stock largest tensor {stock.shape}"


# ------------------------------------------------------------------ misc
def test_strided_int32_and_empty(backend):
    hidden, weight, tokens = _inputs(12, 20, 1300, torch.float32)
    ref = linear_logp(hidden, weight, tokens, backend=backend)
    w_strided = weight.t().contiguous().t()  # [V, H] with strides (1, V)
    h_strided = torch.stack([hidden, hidden], 2)[:, :, 1]  # strides (40, 2)
    assert not w_strided.is_contiguous() and not h_strided.is_contiguous()
    assert_bitwise(linear_logp(h_strided, w_strided, tokens, backend=backend), ref, "strided")
    assert_bitwise(linear_logp(hidden, weight, tokens.int(), backend=backend), ref, "int32")
    empty = linear_logp(hidden[:0], weight, tokens[:0], 1.0, True, backend=backend)
    assert empty[0].shape == empty[1].shape == (0,)


def test_compile_matches_eager(backend):
    hidden, weight, tokens = _inputs(9, 16, 1100, torch.float32)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda a, b, c: linear_logp(a, b, c, 0.8, True, backend=backend),
        fullgraph=True,
        backend="eager",
    )
    eager = linear_logp(hidden, weight, tokens, 0.8, True, backend=backend)
    for x, y in zip(f(hidden, weight, tokens), eager):
        assert_bitwise(x, y, "compile vs eager")


def test_opcheck():
    hidden, weight, tokens = _inputs(5, 8, 1030, torch.float32)
    op = torch.ops.rl_engine.linear_logp.default
    torch.library.opcheck(op, (hidden, weight, tokens, 0.7, True, "native"))
    torch.library.opcheck(op, (hidden, weight, tokens, 0.7, False, "native"))
    lp, ent, lse = op(hidden, weight, tokens, 0.7, True, "native")
    g = torch.randn(5)
    torch.library.opcheck(
        torch.ops.rl_engine.linear_logp_backward.default,
        (hidden, weight, tokens, 0.7, lse, ent, g, g, True, True, "native"),
    )
    torch.library.opcheck(
        torch.ops.rl_engine.linear_logp_backward.default,
        (hidden, weight, tokens, 0.7, lse, ent, g, None, True, False, "native"),
    )


def test_stock_only_in_audit_mode():
    hidden, weight, tokens = _inputs(4, 8, 100, torch.float32)
    with pytest.raises(BackendUnavailableError, match="not batch invariant"):
        linear_logp(hidden, weight, tokens, backend="stock")
    config.set_mode("audit")
    lp = linear_logp(hidden, weight, tokens, 0.5, backend="stock")
    ref = linear_logp(hidden, weight, tokens, 0.5, backend="native")
    assert_close(lp, ref, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="stock vs native")


_H, _W, _T = torch.randn(3, 8), torch.randn(50, 8), torch.tensor([0, 1, 2])


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((_H.double(), _W.double(), _T), TypeError, "not supported"),
        ((_H, _W.bfloat16(), _T), TypeError, "one dtype"),
        ((_H, torch.randn(50, 9), _T), ValueError, "disagree on H"),
        ((_H, _W, _T.float()), TypeError, "int64 or int32"),
        ((_H, _W, _T[:2]), ValueError, "one per row"),
        ((_H[0], _W, _T), ValueError, "dims"),
        ((_H, _W.to("meta"), _T), ValueError, "device"),
        ((_H, _W, _T.to("meta")), ValueError, "device"),
        ((_H, _W[:0], _T), ValueError, "empty vocabulary"),
        ((_H, _W, torch.tensor([0, 50, 1])), ValueError, r"\[0, 50\)"),
        ((_H, _W, torch.tensor([0, -3, 1])), ValueError, r"\[0, 50\)"),
        ((_H, _W, _T, 0.0), ValueError, "> 0"),
        ((_H, _W, _T, -0.5), ValueError, "> 0"),
        ((_H, _W, _T, math.inf), ValueError, "finite"),
        ((_H, _W, _T, None), TypeError, "Python float"),
        ((_H, _W, _T, 1.0, 1), TypeError, "return_entropy"),
    ],
)
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        linear_logp(*args, backend="native")


def test_temperature_is_checked_once_at_the_public_entry(backend, monkeypatch):
    """The trainer path (``linear_logp`` -> its provider) validates the temperature once, at the
    public entry, and trusts it inside (the provider's forward does not check again); each
    provider module's own public function still checks a direct call."""
    from rl_engine.ops.logp import reference as logp_ref

    calls = []
    real = logp_ref.check_temperature

    def counting(t):
        calls.append(t)
        real(t)

    monkeypatch.setattr(ll_ref, "check_temperature", counting)
    monkeypatch.setattr(logp_ref, "check_temperature", counting)
    linear_logp(_H, _W, _T, 0.7, backend=backend)
    assert calls == [0.7]
    calls.clear()
    linear_logp(_H, _W, _T, 0.7, return_entropy=True, backend=backend)
    assert calls == [0.7]
    fn = KernelRegistry.provider("linear_logp", backend).fn
    with pytest.raises(ValueError, match="finite and > 0"):
        fn(_H, _W, _T, -1.0, False)


def test_bad_chunk_config_raises(monkeypatch):
    monkeypatch.setattr(ll_ref, "VOCAB_CHUNK", VOCAB_TILE + 1)
    with pytest.raises(ValueError, match="multiple of VOCAB_TILE"):
        linear_logp(_H, _W, _T, backend="native")


def test_self_test():
    from rl_engine.selftest import self_test

    self_test("linear_logp", "cpu")
