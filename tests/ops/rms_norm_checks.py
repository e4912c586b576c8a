"""Checks shared by the rms_norm suites: ``tests/ops/test_rms_norm.py`` (every provider the
registry lists for the CPU) and the rms_norm part of ``tests/ops/test_triton_elementwise.py``
(the Triton provider, on the GPU or in the interpreter). Each check takes the provider name and
the tensors, so a suite keeps its own shapes, device and tolerances."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_engine.ops import rms_norm
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import assert_close, tolerance

EPS = 1e-6


def rms64(r: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """float64 RMSNorm (differentiable): the numerics oracle."""
    r64 = r.double()
    return r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def check_backward(
    backend: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, *, dw_atol_scale: float = 1.0
) -> None:
    """Autograd dX / dW of ``rms_norm(x, w)`` (leaves that require grad) against ``g``: bitwise
    run to run, and close to float64 (the dW atol times ``dw_atol_scale``)."""

    def grads():
        x.grad = w.grad = None
        rms_norm(x, w, EPS, backend=backend).backward(g)
        return x.grad.clone(), w.grad.clone()

    gx, gw = grads()
    gx2, gw2 = grads()
    assert_bitwise(gx, gx2, "dx run-to-run")
    assert_bitwise(gw, gw2, "dw run-to-run")
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    rms64(x64, w64).backward(g.double())
    rtol, atol = tolerance(x.dtype, grad=True)
    assert_close(gx, x64.grad, rtol=rtol, atol=atol, what="dx")
    assert_close(gw, w64.grad, rtol=rtol, atol=atol * dw_atol_scale, what="dw")


def fused_rows(
    backend: str, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``idx -> cat(rms_norm(x[idx], w, residual=res[idx]))``: the fused forward of the rows
    ``idx`` (float indices, as the row-invariance check slices them), x and residual together."""

    def f(idx: torch.Tensor) -> torch.Tensor:
        i = idx.long()
        return torch.cat(rms_norm(x[i], w, EPS, res[i], backend=backend), dim=-1)

    return f


def dx_rows(
    backend: str,
    x: torch.Tensor,
    w0: torch.Tensor,
    res: torch.Tensor,
    gy: torch.Tensor,
    gs: torch.Tensor,
    *,
    fused: bool,
    wgrad: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``idx -> dX`` of the rows ``idx`` through the autograd: of ``rms_norm(x, w)`` against
    ``gy``, or (``fused``) of ``rms_norm(x, w, residual=res)`` against ``(gy, gs)``; ``wgrad``
    makes the weight a leaf too (the one-pass backward then runs where a provider has it)."""

    def dx(idx: torch.Tensor) -> torch.Tensor:
        i = idx.long()
        xi = x[i].clone().requires_grad_(True)
        w = w0.clone().requires_grad_(wgrad)
        if fused:
            y, s = rms_norm(xi, w, EPS, res[i], backend=backend)
            torch.autograd.backward([y, s], [gy[i], gs[i]])
        else:
            rms_norm(xi, w, EPS, backend=backend).backward(gy[i])
        return xi.grad

    return dx


def check_fused_equals_unfused(
    backend: str,
    x0: torch.Tensor,
    r0: torch.Tensor,
    w0: torch.Tensor,
    gy: torch.Tensor,
    gs: torch.Tensor,
    *,
    grad_s: bool,
) -> None:
    """``rms_norm(x, w, residual=r)`` and ``rms_norm(x + r, w)``: the same y, s and gradients of
    x, r and w, bitwise (``grad_s``: a gradient flows into ``s`` too)."""

    def run(fused):
        x, r, w = (t.clone().requires_grad_(True) for t in (x0, r0, w0))
        if fused:
            y, s = rms_norm(x, w, EPS, r, backend=backend)
        else:
            s = x + r
            y = rms_norm(s, w, EPS, backend=backend)
        outs, grads = ([y, s], [gy, gs]) if grad_s else ([y], [gy])
        torch.autograd.backward(outs, grads)
        return y, s, x.grad, r.grad, w.grad

    for a, b, name in zip(run(True), run(False), ["y", "s", "dx", "dresidual", "dweight"]):
        assert_bitwise(a, b, f"fused vs unfused {name}")
