"""silu_and_mul: numerics vs float64, row invariance (fwd + dX), errors, opcheck."""

from __future__ import annotations

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import silu_and_mul
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import backend_fixture

DTYPES = [torch.float32, torch.bfloat16]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("silu_and_mul", device="cpu")


def _ref64(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    a, b = x[..., :d].double(), x[..., d:].double()
    return a * torch.sigmoid(a) * b


def _inputs(shape, dtype):
    x = 4 * torch.randn(shape, dtype=torch.float32)
    if x.numel() >= 4:  # saturated and zero gates
        x.view(-1)[:4] = torch.tensor([0.0, -30.0, 30.0, -100.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (33, 2 * 760), (17, 2 * 1128), (0, 64), (2, 5, 258)])
def test_numerics_vs_float64(backend, dtype, shape):
    x = _inputs(shape, dtype)
    y = silu_and_mul(x, backend=backend)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2)
    rtol, atol = tolerance(dtype)
    assert_close(y, _ref64(x), rtol=rtol, atol=atol, what=f"silu_and_mul {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_numerics_and_determinism(backend, dtype):
    x = _inputs((45, 2 * 96), dtype).requires_grad_(True)
    g = torch.randn(45, 96, dtype=dtype)

    def grad():
        x.grad = None
        silu_and_mul(x, backend=backend).backward(g)
        return x.grad.clone()

    gx = grad()
    assert_bitwise(gx, grad(), "dx run-to-run")
    x64 = x.detach().double().requires_grad_(True)
    _ref64(x64).backward(g.double())
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(gx, x64.grad, rtol=rtol, atol=atol, what="dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    x = _inputs((300, 2 * 380), dtype)
    check_row_invariance(lambda t: silu_and_mul(t, backend=backend), x, what="silu_and_mul fwd")
    # 3-d input: a row of the flattened tokens does not depend on how they are grouped
    full = silu_and_mul(x, backend=backend)
    assert_bitwise(
        silu_and_mul(x.reshape(3, 100, -1), backend=backend).reshape(300, -1), full, "3d"
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_dx(backend, dtype):
    x = _inputs((199, 2 * 200), dtype)
    gy = torch.randn(199, 200, dtype=dtype)

    def dx(idx):  # rows addressed by index so that x and the gradient are sliced together
        i = idx.long()
        xi = x[i].clone().requires_grad_(True)
        silu_and_mul(xi, backend=backend).backward(gy[i])
        return xi.grad

    counts = (1, 17, 31, 33, 64, 65, 128, 129, 199)
    check_row_invariance(dx, torch.arange(199.0), counts=counts, what="silu_and_mul dX")


def test_strided_input(backend):
    x = torch.randn(40, 2 * 2 * 48)[::2, ::2]
    assert_bitwise(
        silu_and_mul(x, backend=backend), silu_and_mul(x.contiguous(), backend=backend), "strided"
    )


def test_compile_matches_eager(backend):
    x = torch.randn(9, 32)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(lambda t: silu_and_mul(t, backend=backend), fullgraph=True, backend="eager")
    assert_bitwise(f(x), silu_and_mul(x, backend=backend), "compile vs eager")


def test_opcheck():
    x, g = torch.randn(5, 8, requires_grad=True), torch.randn(5, 4)
    torch.library.opcheck(torch.ops.rl_engine.silu_and_mul.default, (x, "native"))
    torch.library.opcheck(
        torch.ops.rl_engine.silu_and_mul_backward.default, (g, x.detach(), "native")
    )


def test_default_resolution_and_stock_audit_only():
    assert KernelRegistry.get_op("silu_and_mul", device="cpu").provider.name == "native"
    x = torch.randn(4, 8)
    with pytest.raises(BackendUnavailableError, match="audit"):
        silu_and_mul(x, backend="stock")
    config.set_mode("audit")
    assert_close(silu_and_mul(x, backend="stock"), _ref64(x), rtol=1e-5, atol=1e-5, what="stock")


@pytest.mark.parametrize(
    "x, exc, match",
    [
        (torch.randn(3, 4).double(), TypeError, "not supported"),
        (torch.ones(3, 4, dtype=torch.int32), TypeError, "not supported"),
        (torch.randn(3, 5), ValueError, "even"),
        (torch.tensor(1.0), ValueError, "at least 1 dim"),
        ([[1.0, 2.0]], TypeError, "Tensor"),
    ],
)
def test_errors(x, exc, match):
    with pytest.raises(exc, match=match):
        silu_and_mul(x, backend="native")


def test_unknown_backend():
    with pytest.raises(BackendUnavailableError, match="names no provider"):
        silu_and_mul(torch.randn(2, 4), backend="nope")
