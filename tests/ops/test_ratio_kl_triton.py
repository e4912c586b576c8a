"""Triton provider of ratio_kl: numerics vs the native reference, invariance, registry, errors.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16 inputs) and
skip otherwise; on a CUDA device they run on the GPU (fp32 / bf16 / fp16), with the native
reference evaluated on the CPU. ``tests/ops/test_ratio_kl.py`` also parametrises over this
provider when it can run.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import ratio_kl
from rl_engine.ops.ratio_kl import triton as rk_triton
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import DEVICE, TRITON_DTYPES, gpu, skip_unless_triton, triton_runnable

RUNNABLE = triton_runnable(rk_triton)
needs_triton = skip_unless_triton(rk_triton)
DTYPES = TRITON_DTYPES
_OPTS = dict(token_is_cap=1.5, seq_is_cap=3.0, token_mis=(0.4, 2.5), seq_mis=(0.2, 4.0))
_DIFF = ("log_ratio", "ratio", "k1", "k2", "k3", "seq_log_ratio", "seq_ratio")
_T_MULTI = rk_triton.BLOCK_T + 77  # two tiles: the sequential tile loop is exercised


def _data(b, t, dtype, *, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, t, generator=g) * 0.5 - 1.5).to(dtype)
    old = lp.float() + torch.randn(b, 1, generator=g) * 0.1 + torch.randn(b, t, generator=g) * scale
    mask = torch.rand(b, t, generator=g) > 0.25
    return lp.to(DEVICE), old.to(dtype).to(DEVICE), mask.to(DEVICE)


def _native(*args, **kw):
    """The reference on the CPU (the spec), inputs moved there."""
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    return ratio_kl(*args, backend="native", **kw)


# --------------------------------------------------------------------- registry / availability
def test_availability_reasons():
    reason = rk_triton.PROVIDER.why_not("cpu", triton_interpret=False)
    assert reason is not None and "TRITON_INTERPRET=1" in reason and "CUDA" in reason
    assert "not supported" in (rk_triton.PROVIDER.available("rocm", triton_interpret=True) or "")
    if rk_triton.triton is not None:
        assert rk_triton.PROVIDER.why_not("cpu", triton_interpret=True) is None
    p = KernelRegistry.provider("ratio_kl", "triton")
    assert p.invariant and p.numerics == "ratio_kl/triton" and "backward" in p.extras


def test_unavailable_backend_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        ratio_kl(torch.randn(2, 3), torch.randn(2, 3), backend="triton")
    opts = (20.0, 1.0, 1.0, 0.0, math.inf, 0.0, math.inf, False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        rk_triton.ratio_kl(torch.randn(2, 3), torch.randn(2, 3), None, *opts)


@pytest.mark.skipif(rk_triton.triton is None, reason="triton not importable")
def test_resolution_order(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config.reload()
    assert KernelRegistry.get_op("ratio_kl", device="cpu", backend="triton").numerics == (
        "ratio_kl/triton"
    )
    # the CPU default stays the reference; on CUDA the Triton provider comes first
    assert KernelRegistry.get_op("ratio_kl", device="cpu").provider.name == "native"
    assert KernelRegistry.providers("ratio_kl", "cuda")[0].name == "triton"


def test_errors_direct_call():
    lp = torch.randn(3, 4)
    with pytest.raises(ValueError, match="shape"):
        rk_triton.ratio_kl(lp, torch.randn(3, 5), None, 20.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, False)
    with pytest.raises(ValueError, match="device"):
        rk_triton.ratio_kl(
            lp, torch.randn(3, 4, device="meta"), None, 20.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, False
        )
    with pytest.raises(TypeError, match="not supported"):
        rk_triton.ratio_kl(lp.double(), lp.double(), None, 20.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        rk_triton.ratio_kl(lp, lp, None, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, False)
    with pytest.raises(RuntimeError, match="not supported"):
        rk_triton._check_device(torch.empty(2, 2, device="meta"))


# --------------------------------------------------------------------- numerics vs native
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (17, 31), (5, _T_MULTI), (0, 5), (3, 0)])
@pytest.mark.parametrize("seq_mode", ["sum", "mean"])
def test_forward_vs_native(dtype, shape, seq_mode):
    lp, old, mask = _data(*shape, dtype)
    out = ratio_kl(lp, old, mask, seq_mode=seq_mode, backend="triton", **_OPTS)
    ref = _native(lp, old, mask, seq_mode=seq_mode, **_OPTS)
    rtol, atol = FP32_OUT  # fp32 outputs of inputs that are exact in fp32
    for name, o, r in zip(out._fields, out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype and o.device.type == DEVICE, name
        if r.dtype == torch.bool:
            # a ratio within an ulp of a masked-IS bound could flip; none does in this data
            assert torch.equal(o.cpu(), r), name
        else:
            assert_close(o, r, rtol=rtol, atol=atol, what=f"triton {name} {shape} {dtype}")


@needs_triton
def test_no_mask_and_options_exercised():
    lp, old, mask = _data(33, 40, torch.float32, scale=0.8)
    out = ratio_kl(lp, old, mask, backend="triton", **_OPTS)
    assert (out.token_weight[mask] == 1.5).any() and (~out.token_keep[mask]).any()
    assert (~out.seq_keep).any() and out.seq_keep.any()
    full = ratio_kl(lp, old, None, backend="triton")
    ones = ratio_kl(lp, old, torch.ones_like(mask), backend="triton")
    for name, a, b in zip(full._fields, full, ones):
        assert_bitwise(a, b, f"no mask == all-ones mask: {name}")
    ref = _native(lp, old, None)
    assert_close(full.seq_ratio, ref.seq_ratio, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="seq")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_mode", ["sum", "mean"])
@pytest.mark.parametrize("t", [31, _T_MULTI])
def test_gradients_vs_native(dtype, seq_mode, t):
    lp, old, mask = _data(6, t, dtype, scale=0.6)
    g = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(6, t, generator=g) for n in _DIFF[:5]}
    grads.update({n: torch.randn(6, generator=g) for n in _DIFF[5:]})
    res = []
    for backend, dev in (("triton", DEVICE), ("native", "cpu")):
        x = lp.to(dev).clone().requires_grad_(True)
        y = old.to(dev).clone().requires_grad_(True)
        out = ratio_kl(x, y, mask.to(dev), log_ratio_clamp=0.9, seq_mode=seq_mode, backend=backend)
        res.append(
            torch.autograd.grad(
                [getattr(out, n) for n in _DIFF], (x, y), [grads[n].to(dev) for n in _DIFF]
            )
        )
    (dx, dy), (rdx, rdy) = res
    assert dx.dtype == dtype and dy.dtype == dtype
    rtol, atol = FP32_OUT if dtype == torch.float32 else tolerance(dtype)
    assert_close(dx, rdx, rtol=rtol, atol=atol, what=f"d logp {dtype}")
    assert_close(dy, rdy, rtol=rtol, atol=atol, what=f"d old_logp {dtype}")
    assert (rdx == 0).any() and (rdx != 0).any(), "clamp range not exercised"


@needs_triton
def test_strided_and_expanded_inputs():
    lp, old, mask = _data(9, 64, torch.float32)
    base = ratio_kl(lp[:, ::2], old[:, ::2], mask[:, ::2], backend="triton", **_OPTS)
    cont = ratio_kl(
        lp[:, ::2].contiguous(),
        old[:, ::2].contiguous(),
        mask[:, ::2].contiguous(),
        backend="triton",
        **_OPTS,
    )
    for name, a, b in zip(base._fields, base, cont):
        assert_bitwise(a, b, f"strided == contiguous: {name}")
    # upstream gradients with stride 0 (e.g. from .sum()) are read as such
    x = lp.clone().requires_grad_(True)
    ratio_kl(x, old, mask, backend="triton").k3.sum().backward()
    y = lp.clone().requires_grad_(True)
    out = ratio_kl(y, old, mask, backend="triton")
    (gy,) = torch.autograd.grad(out.k3, y, torch.ones(9, 64, device=DEVICE))
    assert_bitwise(x.grad, gy, "expanded vs dense upstream gradient")


# --------------------------------------------------------------------- invariance
def _pack(lp, old, mask):
    return torch.stack([lp.float(), old.float(), mask.float()], dim=1)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward_and_grad(dtype):
    lp, old, mask = _data(67, 45, dtype)

    def f(x):
        a = x[:, 0].to(dtype).requires_grad_(True)
        out = ratio_kl(a, x[:, 1].to(dtype), x[:, 2], seq_mode="mean", backend="triton", **_OPTS)
        (out.k3 * 0.5 + out.ratio).sum().backward(inputs=[a])
        cols = [o.float().reshape(x.shape[0], -1) for o in out]
        return torch.cat([*cols, a.grad.float()], dim=1)

    check_row_invariance(f, _pack(lp, old, mask), counts=(1, 17, 31, 33, 67), what=f"{dtype}")


@needs_triton
def test_rows_per_program_changes_no_bits(monkeypatch):
    """Sequences per program are independent lanes: 1 (the GPU's) and 16 give the same bits."""
    lp, old, mask = _data(21, _T_MULTI, torch.float32)

    def run():
        x = lp.clone().requires_grad_(True)
        out = ratio_kl(x, old, mask, seq_mode="mean", backend="triton", **_OPTS)
        (out.k2.sum() + out.seq_ratio.sum()).backward()
        return [*out, x.grad]

    base = run()
    for rows in (1, 4, 32):
        monkeypatch.setattr(rk_triton, "rows_per_program", lambda device, r=rows: r)
        for i, (a, b) in enumerate(zip(run(), base)):
            assert_bitwise(a, b, f"rows per program {rows}, output {i}")


@needs_triton
@pytest.mark.parametrize("seq_mode", ["sum", "mean"])
def test_right_padding_invariance(seq_mode):
    """Masked tokens appended to the rows (NaN values, crossing the tile boundary) change
    nothing: every per-sequence output and every real token's output stays bitwise the same."""
    t = rk_triton.BLOCK_T - 20
    lp, old, mask = _data(5, t, torch.float32)
    base = ratio_kl(lp, old, mask, seq_mode=seq_mode, backend="triton", **_OPTS)
    x = lp.clone().requires_grad_(True)
    out = ratio_kl(x, old, mask, seq_mode=seq_mode, backend="triton")
    (out.k3.sum() + out.seq_ratio.sum()).backward()
    gbase = x.grad
    for extra in (1, 20, 21, 1100):
        nan = torch.full((5, extra), math.nan, device=DEVICE)
        pm = torch.cat([mask, torch.zeros(5, extra, dtype=torch.bool, device=DEVICE)], 1)
        po = torch.cat([old, nan], 1)
        out = ratio_kl(
            torch.cat([lp, nan], 1), po, pm, seq_mode=seq_mode, backend="triton", **_OPTS
        )
        for name, a, b in zip(base._fields, out, base):
            a = a if a.dim() == 1 else a[:, :t]
            assert_bitwise(a, b, f"{name} +{extra} masked tokens")
        xp = torch.cat([lp, nan], 1).requires_grad_(True)
        o2 = ratio_kl(xp, po, pm, seq_mode=seq_mode, backend="triton")
        (o2.k3.sum() + o2.seq_ratio.sum()).backward()
        assert_bitwise(xp.grad[:, :t], gbase, f"d logp +{extra}")
        assert (xp.grad[:, t:] == 0).all()


@needs_triton
def test_run_to_run_bitwise():
    lp, old, mask = _data(31, _T_MULTI, torch.float16)

    def run():
        x = lp.clone().requires_grad_(True)
        y = old.clone().requires_grad_(True)
        out = ratio_kl(x, y, mask, backend="triton", **_OPTS)
        (out.k3.sum() + out.seq_log_ratio.sum()).backward()
        return [*out, x.grad, y.grad]

    for i, (a, b) in enumerate(zip(run(), run())):
        assert_bitwise(a, b, f"run-to-run output {i}")


@needs_triton
def test_opcheck():
    lp, old, mask = _data(5, 7, torch.float32)
    opts = (20.0, 2.0, math.inf, 0.1, 10.0, 0.0, math.inf, True, "triton")
    x = lp.clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.rl_engine.ratio_kl.default, (x, old, mask, *opts))
    gs = [torch.randn(5, 7, device=DEVICE) for _ in range(5)]
    gs += [torch.randn(5, device=DEVICE) for _ in range(2)]
    torch.library.opcheck(
        torch.ops.rl_engine.ratio_kl_backward.default, (*gs, lp, old, None, 20.0, False, "triton")
    )


# --------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large_rows_and_tokens(dtype):
    """Many sequences and long rows on the GPU: row invariance at scale, vs native."""
    lp, old, mask = _data(1025, 4099, dtype, seed=3)
    out = ratio_kl(lp, old, mask, backend="triton", **_OPTS)
    sub = ratio_kl(lp[700:701], old[700:701], mask[700:701], backend="triton", **_OPTS)
    for name, a, b in zip(out._fields, out, sub):
        assert_bitwise(a[700:701], b, f"{name} row 700 alone")
    ref = _native(lp, old, mask, **_OPTS)
    assert_close(out.seq_ratio, ref.seq_ratio, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="seq")
    assert_close(out.k3, ref.k3, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="k3")
