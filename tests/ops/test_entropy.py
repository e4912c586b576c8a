"""entropy: numerics vs float64 (forward, dlogits), bitwise row invariance, errors, opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, config
from rl_engine.ops import entropy, logp
from rl_engine.ops.logp.reference import VOCAB_TILE, VocabLogSumExp, temperature_tensor
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import backend_fixture
from tests.ops._vocab import forward_grid

DTYPES = [torch.float32, torch.bfloat16]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("entropy", device="cpu")


def _ref64(logits, temperature):
    z = logits.double() / temperature
    return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


@forward_grid
def test_numerics_vs_float64(backend, dtype, shape, temperature):
    t, v = shape
    logits = (4 * torch.randn(t, v)).to(dtype)
    out = entropy(logits, temperature, backend=backend)
    assert out.dtype == torch.float32 and out.shape == (t,)
    rtol, atol = FP32_OUT
    assert_close(out, _ref64(logits, temperature), rtol=rtol, atol=atol, what="entropy")


def test_peaked_and_uniform_rows(backend):
    v = 3000
    uniform = torch.zeros(2, v)
    peaked = torch.zeros(2, v)
    peaked[:, 17] = 100.0  # the max sits in the first tile; later tiles are tiny
    late = torch.zeros(2, v)
    late[:, 2999] = 60.0  # the max arrives in the last tile: rescaling of u matters
    x = torch.cat([uniform, peaked, late])
    out = entropy(x, backend=backend)
    assert_close(out, _ref64(x, 1.0), rtol=FP32_OUT[0], atol=FP32_OUT[1], what="peaked")
    assert abs(out[0].item() - math.log(v)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_grad_vs_float64(backend, dtype, temperature):
    v = 2 * VOCAB_TILE + 33
    logits = (3 * torch.randn(13, v)).to(dtype).requires_grad_(True)
    g = torch.randn(13)
    entropy(logits, temperature, backend=backend).backward(g)
    assert logits.grad.dtype == dtype
    x64 = logits.detach().double().requires_grad_(True)
    _ref64(x64, temperature).backward(g.double())
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(logits.grad, x64.grad, rtol=rtol, atol=atol, what="dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    x = (3 * torch.randn(300, VOCAB_TILE + 77)).to(dtype)
    check_row_invariance(lambda r: entropy(r, 0.7, backend=backend), x, what=f"entropy {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_dx(backend, dtype):
    x = (3 * torch.randn(199, VOCAB_TILE + 77)).to(dtype)

    def dx(rows):
        rows = rows.clone().requires_grad_(True)
        entropy(rows, 0.7, backend=backend).backward(rows[:, 1].detach().float() + 0.5)
        return rows.grad

    check_row_invariance(dx, x, counts=(1, 2, 17, 31, 33, 199), what=f"entropy dlogits {dtype}")


def test_backward_run_to_run(backend):
    x = torch.randn(21, 3000, dtype=torch.bfloat16)

    def grad():
        xi = x.clone().requires_grad_(True)
        entropy(xi, 1.1, backend=backend).sum().backward()
        return xi.grad

    assert_bitwise(grad(), grad(), "dlogits run-to-run")


def test_same_lse_as_logp():
    # entropy and logp share the vocabulary reduction: the lse of both custom ops is bitwise equal
    x, tokens = torch.randn(7, 2500), torch.randint(0, 2500, (7,))
    _, lse_e = torch.ops.rl_engine.entropy(x, 0.9, "native")
    _, lse_l = torch.ops.rl_engine.logp(x, tokens, 0.9, "native")
    assert_bitwise(lse_e, lse_l, "entropy lse vs logp lse")
    state = VocabLogSumExp(7, x.device, with_entropy=False)
    state.add(x, temperature_tensor(0.9, x.device))
    assert_bitwise(state.lse(), lse_l, "shared reduction")
    assert_bitwise(logp(x, tokens, 0.9), torch.ops.rl_engine.logp(x, tokens, 0.9, "native")[0], "")


def test_minus_inf_vocab_padding_is_transparent(backend):
    x = torch.randn(11, 1500)
    padded = torch.cat([x, torch.full((11, 3 * VOCAB_TILE), -math.inf)], dim=1)
    assert_bitwise(entropy(padded, backend=backend), entropy(x, backend=backend), "pad")
    lead = torch.cat([torch.full((11, VOCAB_TILE), -math.inf), x], dim=1)
    out = entropy(lead, backend=backend)
    assert_close(out, _ref64(x, 1.0), rtol=FP32_OUT[0], atol=FP32_OUT[1], what="leading -inf")
    xi = padded.clone().requires_grad_(True)
    entropy(xi, backend=backend).sum().backward()
    assert torch.isfinite(xi.grad).all()
    assert torch.equal(xi.grad[:, 1500:], torch.zeros_like(xi.grad[:, 1500:]))


def test_strided(backend):
    x = torch.randn(2100, 30).t()
    assert_bitwise(entropy(x, backend=backend), entropy(x.contiguous(), backend=backend), "strided")


def test_compile_matches_eager(backend):
    x = torch.randn(9, 1100)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(lambda a: entropy(a, 0.8, backend=backend), fullgraph=True, backend="eager")
    assert_bitwise(f(x), entropy(x, 0.8, backend=backend), "compile vs eager")


def test_opcheck():
    x = torch.randn(5, 1030)
    torch.library.opcheck(torch.ops.rl_engine.entropy.default, (x, 0.7, "native"))
    ent, lse = torch.ops.rl_engine.entropy(x, 0.7, "native")
    torch.library.opcheck(
        torch.ops.rl_engine.entropy_backward.default, (x, 0.7, lse, ent, torch.randn(5), "native")
    )


def test_stock_only_in_audit_mode():
    x = torch.randn(4, 100)
    with pytest.raises(BackendUnavailableError, match="not batch invariant"):
        entropy(x, backend="stock")
    config.set_mode("audit")
    out = entropy(x, 0.5, backend="stock")
    assert_close(out, _ref64(x, 0.5), rtol=FP32_OUT[0], atol=FP32_OUT[1], what="stock")


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.randn(3, 5).double(),), TypeError, "not supported"),
        ((torch.randn(3, 5).long(),), TypeError, "not supported"),
        ((torch.randn(15),), ValueError, "dims"),
        ((torch.randn(3, 0),), ValueError, "empty vocabulary"),
        ((torch.randn(3, 5), 0.0), ValueError, "> 0"),
        ((torch.randn(3, 5), -2.0), ValueError, "> 0"),
        ((torch.randn(3, 5), math.nan), ValueError, "finite"),
        ((torch.randn(3, 5), "1.0"), TypeError, "Python float"),
        (([[1.0]],), TypeError, "Tensor"),
    ],
)
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        entropy(*args, backend="native")


def test_self_test():
    from rl_engine.selftest import self_test

    self_test("entropy", "cpu")


def test_unsupported_device_raises():
    from rl_engine import NoInvariantProviderError

    with pytest.raises(NoInvariantProviderError, match="meta"):
        entropy(torch.randn(3, 5, device="meta"))
