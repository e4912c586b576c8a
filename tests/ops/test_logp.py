"""logp: numerics vs float64 (forward, dlogits), bitwise row invariance, tiles, errors, opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import logp
from rl_engine.ops.logp.reference import VOCAB_TILE
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import backend_fixture
from tests.ops._vocab import forward_grid

DTYPES = [torch.float32, torch.bfloat16]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("logp", device="cpu")


def _ref64(logits, tokens, temperature):
    z = logits.double() / temperature
    return torch.log_softmax(z, -1).gather(1, tokens.long()[:, None])[:, 0]


def _row_tokens(rows, vocab):
    """Token ids that are a function of each row alone (so padded / sliced batches agree)."""
    return (rows[:, 0].detach().float().abs() * 1000).long() % vocab


@forward_grid
def test_numerics_vs_float64(backend, dtype, shape, temperature):
    t, v = shape
    logits = (4 * torch.randn(t, v)).to(dtype)
    tokens = torch.randint(0, v, (t,))
    out = logp(logits, tokens, temperature, backend=backend)
    assert out.dtype == torch.float32 and out.shape == (t,)
    rtol, atol = FP32_OUT
    assert_close(out, _ref64(logits, tokens, temperature), rtol=rtol, atol=atol, what="logp")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_grad_vs_float64(backend, dtype, temperature):
    v = 2 * VOCAB_TILE + 33
    logits = (3 * torch.randn(13, v)).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, v, (13,))
    g = torch.randn(13)
    logp(logits, tokens, temperature, backend=backend).backward(g)
    assert logits.grad.dtype == dtype
    x64 = logits.detach().double().requires_grad_(True)
    _ref64(x64, tokens, temperature).backward(g.double())
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(logits.grad, x64.grad, rtol=rtol, atol=atol, what="dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    v = VOCAB_TILE + 77
    x = (3 * torch.randn(300, v)).to(dtype)
    check_row_invariance(
        lambda r: logp(r, _row_tokens(r, v), 0.7, backend=backend), x, what=f"logp {dtype}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_dx(backend, dtype):
    v = VOCAB_TILE + 77
    x = (3 * torch.randn(199, v)).to(dtype)

    def dx(rows):
        rows = rows.clone().requires_grad_(True)
        grad = rows[:, 1].detach().float() + 0.5  # upstream grad: a function of the row
        logp(rows, _row_tokens(rows, v), 0.7, backend=backend).backward(grad)
        return rows.grad

    check_row_invariance(dx, x, counts=(1, 2, 17, 31, 33, 199), what=f"logp dlogits {dtype}")


def test_backward_run_to_run(backend):
    x = torch.randn(21, 3000, dtype=torch.bfloat16)
    tokens = torch.randint(0, 3000, (21,))

    def grad():
        xi = x.clone().requires_grad_(True)
        logp(xi, tokens, 1.1, backend=backend).sum().backward()
        return xi.grad

    assert_bitwise(grad(), grad(), "dlogits run-to-run")


def test_minus_inf_vocab_padding_is_transparent(backend):
    # vLLM pads the LM-head vocabulary; padded columns at -inf must not change a single bit.
    x = torch.randn(11, 1500)
    tokens = torch.randint(0, 1500, (11,))
    padded = torch.cat([x, torch.full((11, 3 * VOCAB_TILE), -math.inf)], dim=1)
    assert_bitwise(logp(padded, tokens, backend=backend), logp(x, tokens, backend=backend), "pad")
    # a whole leading tile at -inf: the online rescaling starts from -inf without NaN
    lead = torch.cat([torch.full((11, VOCAB_TILE), -math.inf), x], dim=1)
    out = logp(lead, tokens + VOCAB_TILE, backend=backend)
    assert torch.isfinite(out).all()
    assert_close(out, _ref64(x, tokens, 1.0), rtol=FP32_OUT[0], atol=FP32_OUT[1], what="-inf")
    xi = padded.clone().requires_grad_(True)
    logp(xi, tokens, backend=backend).sum().backward()
    assert torch.equal(xi.grad[:, 1500:], torch.zeros_like(xi.grad[:, 1500:]))


def test_strided_and_int32(backend):
    base = torch.randn(2100, 30)
    x = base.t()  # [30, 2100], non-contiguous
    tokens = torch.randint(0, 2100, (30,))
    ref = logp(x.contiguous(), tokens, 0.9, backend=backend)
    assert_bitwise(logp(x, tokens, 0.9, backend=backend), ref, "strided")
    assert_bitwise(logp(x, tokens.int(), 0.9, backend=backend), ref, "int32 tokens")


def test_compile_matches_eager(backend):
    x, tokens = torch.randn(9, 1100), torch.randint(0, 1100, (9,))
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda a, b: logp(a, b, 0.8, backend=backend), fullgraph=True, backend="eager"
    )
    assert_bitwise(f(x, tokens), logp(x, tokens, 0.8, backend=backend), "compile vs eager")


def test_opcheck():
    x, tokens = torch.randn(5, 1030), torch.randint(0, 1030, (5,))
    torch.library.opcheck(torch.ops.rl_engine.logp.default, (x, tokens, 0.7, "native"))
    lse = torch.logsumexp(x / 0.7, -1)
    torch.library.opcheck(
        torch.ops.rl_engine.logp_backward.default, (x, tokens, 0.7, lse, torch.randn(5), "native")
    )


def test_stock_only_in_audit_mode():
    x, tokens = torch.randn(4, 100), torch.randint(0, 100, (4,))
    with pytest.raises(BackendUnavailableError, match="not batch invariant"):
        logp(x, tokens, backend="stock")
    config.set_mode("audit")
    out = logp(x, tokens, 0.5, backend="stock")
    assert_close(out, _ref64(x, tokens, 0.5), rtol=FP32_OUT[0], atol=FP32_OUT[1], what="stock")
    assert any(r["provider"] == "stock" for r in KernelRegistry.report())


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (
            (torch.randn(3, 5).double(), torch.zeros(3, dtype=torch.long)),
            TypeError,
            "not supported",
        ),
        ((torch.randn(3, 5), torch.zeros(3)), TypeError, "int64 or int32"),
        ((torch.randn(3, 5), torch.zeros(4, dtype=torch.long)), ValueError, "one per row"),
        ((torch.randn(3, 5), torch.zeros(3, 1, dtype=torch.long)), ValueError, "dims"),
        ((torch.randn(15), torch.zeros(3, dtype=torch.long)), ValueError, "dims"),
        (
            (torch.randn(3, 5), torch.zeros(3, dtype=torch.long, device="meta")),
            ValueError,
            "device",
        ),
        ((torch.randn(3, 0), torch.zeros(3, dtype=torch.long)), ValueError, "empty vocabulary"),
        ((torch.randn(3, 5), torch.tensor([0, 5, 1])), ValueError, r"\[0, 5\)"),
        ((torch.randn(3, 5), torch.tensor([0, -1, 1])), ValueError, r"\[0, 5\)"),
        ((torch.randn(3, 5), torch.zeros(3, dtype=torch.long), 0.0), ValueError, "> 0"),
        ((torch.randn(3, 5), torch.zeros(3, dtype=torch.long), -1.0), ValueError, "> 0"),
        ((torch.randn(3, 5), torch.zeros(3, dtype=torch.long), math.inf), ValueError, "finite"),
        (
            (torch.randn(3, 5), torch.zeros(3, dtype=torch.long), torch.tensor([1.0, 2.0])),
            TypeError,
            "Python float or a one-element",
        ),
        (([[1.0]], torch.zeros(1, dtype=torch.long)), TypeError, "Tensor"),
    ],
)
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        logp(*args, backend="native")


def test_unknown_backend_raises():
    with pytest.raises(BackendUnavailableError, match="names no provider"):
        logp(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), backend="nope")


def test_self_test():
    from rl_engine.selftest import self_test

    self_test("logp", "cpu")


def test_tensor_temperature_and_leading_dims(backend):
    """Inputs users pass: a 0-d tensor temperature, [B, T, V] logits with [B, T] tokens."""
    from rl_engine.ops import entropy

    g = torch.Generator().manual_seed(5)
    x = 3 * torch.randn(2, 3, VOCAB_TILE + 9, generator=g)
    tok = torch.randint(0, x.shape[-1], (2, 3), generator=g)
    flat = logp(x.reshape(6, -1), tok.reshape(6), 0.7, backend=backend)
    got = logp(x, tok, torch.tensor(0.7), backend=backend)
    assert got.shape == (2, 3)
    assert_bitwise(got.reshape(6), flat, "[B, T, V] vs [B*T, V], tensor temperature")
    ent = entropy(x, torch.tensor(0.7, dtype=torch.float64), backend=backend)
    assert_bitwise(ent.reshape(6), entropy(x.reshape(6, -1), 0.7, backend=backend), "entropy")
    xg = x.clone().requires_grad_(True)
    logp(xg, tok, 0.7, backend=backend).sum().backward()
    assert xg.grad.shape == x.shape
    with pytest.raises(ValueError, match="leading shape"):
        logp(x, tok.reshape(6), 0.7, backend=backend)
    with pytest.raises(TypeError, match="one-element floating tensor"):
        logp(x, tok, torch.tensor([0.7, 0.8]), backend=backend)
