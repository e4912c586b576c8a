"""rms_norm: numerics vs float64, row invariance (fwd + dX), fused residual == unfused, dW order,
errors, opcheck."""

from __future__ import annotations

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import rms_norm
from rl_engine.ops.det_gemm.reference import det_gemm_wgrad
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import backend_fixture
from tests.ops.rms_norm_checks import (
    EPS,
    check_backward,
    check_fused_equals_unfused,
    dx_rows,
    fused_rows,
)
from tests.ops.rms_norm_checks import rms64 as _ref64

DTYPES = [torch.float32, torch.bfloat16]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("rms_norm", device="cpu")


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (33, 760), (17, 1128), (0, 64), (2, 5, 129), (3, 1)])
def test_numerics_vs_float64(backend, dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    y = rms_norm(x, w, EPS, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    rtol, atol = tolerance(dtype)
    assert_close(y, _ref64(x, w), rtol=rtol, atol=atol, what=f"rms_norm {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_numerics(backend, dtype):
    x, res = torch.randn(31, 200, dtype=dtype), torch.randn(31, 200, dtype=dtype)
    w = torch.randn(200, dtype=dtype)
    y, s = rms_norm(x, w, 1e-5, res, backend=backend)
    assert_bitwise(s, x + res, "residual sum in x.dtype")
    rtol, atol = tolerance(dtype)
    assert_close(y, _ref64(s, w, 1e-5), rtol=rtol, atol=atol, what="fused rms_norm")


def test_mixed_weight_dtype(backend):
    x, w = torch.randn(9, 64, dtype=torch.bfloat16), torch.randn(64)
    y = rms_norm(x, w, backend=backend)
    assert y.dtype == torch.bfloat16
    assert_close(y, _ref64(x, w), rtol=1e-2, atol=1e-2, what="bf16 x, fp32 weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_numerics_and_determinism(backend, dtype):
    x = torch.randn(45, 96, dtype=dtype, requires_grad=True)
    w = torch.randn(96, dtype=dtype, requires_grad=True)
    check_backward(backend, x, w, torch.randn(45, 96, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    w = torch.randn(760, dtype=dtype)
    x = torch.randn(300, 760, dtype=dtype)
    check_row_invariance(lambda t: rms_norm(t, w, backend=backend), x, what="rms_norm fwd")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_fused_forward(backend, dtype):
    w = torch.randn(128, dtype=dtype)
    x, res = torch.randn(199, 128, dtype=dtype), torch.randn(199, 128, dtype=dtype)
    f = fused_rows(backend, x, w, res)
    check_row_invariance(f, torch.arange(199.0), what="fused rms_norm fwd")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_dx(backend, dtype, fused):
    w = torch.randn(200, dtype=dtype)
    x, res = torch.randn(199, 200, dtype=dtype), torch.randn(199, 200, dtype=dtype)
    gy, gs = torch.randn(199, 200, dtype=dtype), torch.randn(199, 200, dtype=dtype)
    dx = dx_rows(backend, x, w, res, gy, gs, fused=fused)
    counts = (1, 17, 31, 33, 64, 65, 128, 129, 199)
    check_row_invariance(dx, torch.arange(199.0), counts=counts, what=f"dX fused={fused}")


@pytest.mark.parametrize("grad_s", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_unfused_bitwise(backend, dtype, grad_s):
    x0, r0 = torch.randn(67, 72, dtype=dtype), torch.randn(67, 72, dtype=dtype)
    w0 = torch.randn(72, dtype=dtype)
    gy, gs = torch.randn(67, 72, dtype=dtype), torch.randn(67, 72, dtype=dtype)
    check_fused_equals_unfused(backend, x0, r0, w0, gy, gs, grad_s=grad_s)


def test_weight_grad_order_and_zero_padding(backend):
    x, g = torch.randn(50, 24), torch.randn(50, 24)
    w = torch.randn(24, requires_grad=True)

    def dw(xx, gg):
        w.grad = None
        rms_norm(xx, w, EPS, backend=backend).backward(gg)
        return w.grad.clone()

    base = dw(x, g)
    for pad in (1, 14, 40):
        xp, gp = torch.cat([x, torch.zeros(pad, 24)]), torch.cat([g, torch.zeros(pad, 24)])
        assert_bitwise(dw(xp, gp), base, f"dW with {pad} zero rows")
    # 3-d input: rows are the flattened leading dims, in order
    assert_bitwise(dw(x.reshape(2, 25, 24), g.reshape(2, 25, 24)), base, "dW of [2, 25, H]")
    if backend == "native":
        # the documented order is the one of det_gemm's weight gradient (16-row chunks, in order)
        from rl_engine.ops.rms_norm.reference import _rstd

        expected = det_gemm_wgrad(torch.ones(50, 1), g * (x * _rstd(x, EPS)))[0]
        assert_bitwise(base, expected, "dW order == det_gemm wgrad order")


def test_strided_input(backend):
    x = torch.randn(40, 2 * 96)[::2, ::2]
    w = torch.randn(96)
    assert_bitwise(
        rms_norm(x, w, backend=backend), rms_norm(x.contiguous(), w, backend=backend), "strided"
    )


def test_compile_matches_eager(backend):
    x, r, w = torch.randn(9, 32), torch.randn(9, 32), torch.randn(32)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda a, b, c: rms_norm(a, c, EPS, b, backend=backend), fullgraph=True, backend="eager"
    )
    for got, want, n in zip(f(x, r, w), rms_norm(x, w, EPS, r, backend=backend), "ys"):
        assert_bitwise(got, want, f"compile vs eager {n}")


@pytest.mark.parametrize("case", ["plain", "fused", "fused+grad_s", "x-only"])
def test_eager_path_equals_custom_ops(backend, case):
    """Eager calls run the provider under a plain autograd function (less host time); compiled
    graphs run the custom ops. Forward and every gradient: equal bits."""
    g = torch.Generator().manual_seed(5)
    x, r, w, gy, gs = (
        torch.randn(*s, generator=g) for s in ((13, 40),) * 2 + ((40,),) + ((13, 40),) * 2
    )
    ops = torch.ops.rl_engine

    def run(eager):
        xl, rl, wl = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone()
        wl.requires_grad_(case != "x-only")
        leaves = [xl, wl] if case != "x-only" else [xl]
        if case.startswith("fused"):
            leaves.insert(1, rl)
            y, s = (
                rms_norm(xl, wl, EPS, rl, backend=backend)
                if eager
                else ops.fused_add_rms_norm(xl, rl, wl, EPS, backend)
            )
            outs, grads = ((y, s), (gy, gs)) if case == "fused+grad_s" else ((y,), (gy,))
        else:
            y = (
                rms_norm(xl, wl, EPS, backend=backend)
                if eager
                else ops.rms_norm(xl, wl, EPS, backend)
            )
            outs, grads = (y,), (gy,)
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads))

    for got, want in zip(run(True), run(False), strict=True):
        assert_bitwise(got, want, f"eager path vs custom ops ({case})")


def test_opcheck():
    x, r, w, g = torch.randn(5, 7), torch.randn(5, 7), torch.randn(7), torch.randn(5, 7)
    ops = torch.ops.rl_engine
    torch.library.opcheck(ops.rms_norm.default, (x.requires_grad_(), w, EPS, "native"))
    torch.library.opcheck(ops.fused_add_rms_norm.default, (x, r, w, EPS, "native"))
    torch.library.opcheck(ops.rms_norm_dx.default, (g, x.detach(), w, EPS, "native"))
    torch.library.opcheck(ops.rms_norm_wgrad.default, (g, x.detach(), EPS, "native"))


def test_fused_backward_is_a_provider_capability():
    """triton has the one-pass backward; native does not (its autograd runs rms_norm_dx and
    rms_norm_wgrad), and the fused backward op asked of native names the reason."""
    assert "backward" in KernelRegistry.provider("rms_norm", "triton").extras
    assert "backward" not in KernelRegistry.provider("rms_norm", "native").extras
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(NotImplementedError, match="no fused backward"):
        torch.ops.rl_engine.rms_norm_backward(x, x, w, None, EPS, "native")


def test_default_resolution_and_stock_audit_only():
    assert KernelRegistry.get_op("rms_norm", device="cpu").provider.name == "native"
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(BackendUnavailableError, match="audit"):
        rms_norm(x, w, backend="stock")
    config.set_mode("audit")
    y = rms_norm(x, w, backend="stock")
    assert_close(y, _ref64(x, w), rtol=1e-5, atol=1e-5, what="stock")


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.randn(3, 4).double(), torch.randn(4).double()), TypeError, "not supported"),
        ((torch.randn(3, 4), torch.ones(4, dtype=torch.int64)), TypeError, "weight"),
        ((torch.randn(3, 4), torch.randn(5)), ValueError, "weight has 5"),
        ((torch.randn(3, 4), torch.randn(4, 1)), ValueError, "dims"),
        ((torch.randn(3, 4), torch.randn(4, device="meta")), ValueError, "device"),
        ((torch.randn(3, 0), torch.randn(0)), ValueError, "hidden size"),
        ((torch.tensor(1.0), torch.randn(1)), ValueError, "at least 1 dim"),
        (([[1.0]], torch.randn(1)), TypeError, "Tensor"),
        ((torch.randn(3, 4), torch.randn(4), -1.0), ValueError, "eps"),
        ((torch.randn(3, 4), torch.randn(4), float("nan")), ValueError, "eps"),
        ((torch.randn(3, 4), torch.randn(4), "1e-6"), TypeError, "eps"),
        ((torch.randn(3, 4), torch.randn(4), EPS, torch.randn(3, 5)), ValueError, "residual shape"),
        (
            (torch.randn(3, 4), torch.randn(4), EPS, torch.randn(3, 4).bfloat16()),
            TypeError,
            "residual dtype",
        ),
        (
            (torch.randn(3, 4), torch.randn(4), EPS, torch.randn(3, 4, device="meta")),
            ValueError,
            "device",
        ),
    ],
)
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        rms_norm(*args, backend="native")


def test_unknown_backend():
    with pytest.raises(BackendUnavailableError, match="names no provider"):
        rms_norm(torch.randn(2, 4), torch.randn(4), backend="nope")
