"""rl_engine.nn: drop-in RMSNorm / Linear (state-dict compatibility, numerics, invariance)."""

from __future__ import annotations

import pytest
import torch

from rl_engine import BackendUnavailableError
from rl_engine.nn import Linear, RMSNorm
from rl_engine.ops import det_gemm, rms_norm
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_state_dict_and_numerics(dtype):
    ref = torch.nn.RMSNorm(96, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ref.weight.normal_()
    mod = RMSNorm(96, eps=1e-5, dtype=dtype)
    mod.load_state_dict(ref.state_dict(), strict=True)
    assert set(mod.state_dict()) == {"weight"} and mod.weight.dtype == dtype
    x = torch.randn(3, 11, 96, dtype=dtype)
    y = mod(x)
    assert_bitwise(y, rms_norm(x, ref.weight.detach(), 1e-5), "module == functional")
    rtol, atol = tolerance(dtype)
    want = torch.nn.functional.rms_norm(x.double(), (96,), ref.weight.detach().double(), 1e-5)
    assert_close(y, want, rtol=rtol, atol=atol, what="RMSNorm vs float64")
    torch.nn.RMSNorm(96, dtype=dtype).load_state_dict(mod.state_dict(), strict=True)


def test_rmsnorm_residual_grad_and_attrs():
    mod = RMSNorm(64, eps=1e-6)
    assert mod.variance_epsilon == 1e-6 and "64, eps=1e-06" in repr(mod)
    x, r = torch.randn(7, 64), torch.randn(7, 64)
    y, s = mod(x, r)
    assert_bitwise(s, x + r, "residual sum")
    assert_bitwise(y, mod(x + r), "fused == unfused")
    y.sum().backward()
    assert mod.weight.grad is not None and mod.weight.grad.shape == (64,)
    with pytest.raises(ValueError, match="hidden_size"):
        RMSNorm(0)


def test_rmsnorm_row_invariance():
    mod = RMSNorm(200, dtype=torch.bfloat16)
    with torch.no_grad():
        mod.weight.normal_()
    x = torch.randn(129, 200, dtype=torch.bfloat16)
    with torch.no_grad():
        check_row_invariance(mod, x, counts=(1, 17, 33, 128), what="RMSNorm module")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_state_dict_and_numerics(dtype, bias):
    ref = torch.nn.Linear(48, 24, bias=bias, dtype=dtype)
    mod = Linear(48, 24, bias=bias, dtype=dtype)
    assert {k: v.shape for k, v in mod.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    mod.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(mod.state_dict(), strict=True)
    x = torch.randn(2, 9, 48, dtype=dtype)
    y = mod(x)
    assert y.shape == (2, 9, 24) and y.dtype == dtype
    b = None if ref.bias is None else ref.bias.detach()
    assert_bitwise(y.reshape(18, 24), det_gemm(x.reshape(18, 48), ref.weight.detach().t(), b), "")
    want = torch.nn.functional.linear(
        x.double(), ref.weight.detach().double(), None if b is None else b.double()
    )
    rtol, atol = tolerance(dtype)
    assert_close(y, want, rtol=rtol, atol=atol, what="Linear vs float64")


def test_linear_grads_vs_float64_and_init():
    torch.manual_seed(0)
    mod = Linear(33, 21)
    bound = 1 / 33**0.5
    assert mod.weight.abs().max() <= bound and mod.bias.abs().max() <= bound  # nn.Linear init
    assert "in_features=33, out_features=21, bias=True" in repr(mod)
    x = torch.randn(45, 33, requires_grad=True)
    g = torch.randn(45, 21)
    mod(x).backward(g)
    w64 = mod.weight.detach().double()
    x64 = x.detach().double()
    rtol, atol = tolerance(torch.float32, grad=True)
    assert_close(x.grad, g.double() @ w64, rtol=rtol, atol=atol, what="dx")
    assert_close(mod.weight.grad, g.double().t() @ x64, rtol=rtol, atol=atol, what="dW")
    assert_close(mod.bias.grad, g.double().sum(0), rtol=rtol, atol=atol, what="dbias")


def test_linear_row_invariance():
    mod = Linear(64, 40, dtype=torch.bfloat16)
    x = torch.randn(129, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        check_row_invariance(mod, x, counts=(1, 17, 33, 128), what="Linear module")


def test_linear_errors_and_backend_pin():
    mod = Linear(8, 4)
    with pytest.raises(ValueError, match="in_features=8"):
        mod(torch.randn(3, 7))
    with pytest.raises(TypeError, match="dtype"):
        mod(torch.randn(3, 8, dtype=torch.bfloat16))
    with pytest.raises(BackendUnavailableError, match="audit"):
        Linear(8, 4, backend="stock")(torch.randn(3, 8))
    with pytest.raises(BackendUnavailableError, match="audit"):
        RMSNorm(8, backend="stock")(torch.randn(3, 8))
