"""Triton providers of rms_norm, silu_and_mul and rope: numerics, invariance, fusion, backward.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16, small
shapes) and skip otherwise; on a CUDA device they run on the GPU with bf16 too, plus GPU-only
checks (large shapes, int64-sized rows, torch.compile with inductor, CUDA graph replay).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import _math, rms_norm, rope, rope_qk, silu_and_mul
from rl_engine.ops.rms_norm import triton as rms_triton
from rl_engine.ops.rope import reference as rope_ref
from rl_engine.ops.rope import triton as rope_triton
from rl_engine.ops.silu_and_mul import triton as silu_triton
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import DEVICE, ON_GPU, TRITON_DTYPES, gpu, skip_unless_triton, triton_runnable
from tests.ops.rms_norm_checks import (
    check_backward,
    check_fused_equals_unfused,
    dx_rows,
    fused_rows,
)
from tests.ops.rms_norm_checks import rms64 as _rms64

RUNNABLE = triton_runnable(rms_triton)
needs_triton = skip_unless_triton(rms_triton)
DTYPES = TRITON_DTYPES
EPS = 1e-6
B = "triton"
# interpreter-sized row counts (every count the configs could straddle is a function of H only)
COUNTS = (1, 2, 17, 31, 33, 64, 65, 128, 129)


def _rand(*shape, dtype, gen=None, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


# ============================================================================ availability
@pytest.mark.parametrize("mod", [rms_triton, silu_triton, rope_triton])
def test_availability_reasons(mod):
    reason = mod.PROVIDER.why_not("cpu", triton_interpret=False)
    assert reason is not None and "TRITON_INTERPRET=1" in reason and "CUDA" in reason
    if mod.triton is not None:
        assert mod.PROVIDER.why_not("cpu", triton_interpret=True) is None
    assert "not supported" in (mod.PROVIDER.available("rocm", triton_interpret=True) or "")
    assert mod.PROVIDER.invariant and mod.PROVIDER.name == "triton"


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "rope"])
def test_unavailable_backend_raises(monkeypatch, op):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        KernelRegistry.get_op(op, device="cpu", backend="triton")
    # default resolution on the CPU stays native
    assert KernelRegistry.get_op(op, device="cpu").provider.name == "native"


def test_direct_call_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        rms_triton.rms_norm(torch.randn(2, 8), torch.randn(8))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        silu_triton.silu_and_mul(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        rope_triton.rope(torch.randn(2, 1, 8), torch.arange(2))


@gpu
def test_triton_is_default_on_gpu():
    for op in ("rms_norm", "silu_and_mul", "rope"):
        assert KernelRegistry.get_op(op, device="cuda").provider.name == "triton"


def test_configs_depend_on_hidden_size_only():
    for h in (1, 16, 72, 128, 760, 1128, 2048, 4096, 8192, 16384, 65536):
        c = rms_triton.get_config(h)
        assert c.block_h >= h and c.wgrad_chunk % c.rows == 0 and c.rows >= 1
    with pytest.raises(ValueError, match="hidden size"):
        rms_triton.get_config(rms_triton.MAX_HIDDEN + 1)
    assert silu_triton.get_config(14336).block_d <= 2048
    assert rope_triton.get_config(32, 128, 128).block_p == 64


def test_rope_constants_are_the_references():
    c = rope_triton._CONSTS
    assert c[:4] == (_math._INV_PIO2, _math._PIO2_1, _math._PIO2_2, _math._PIO2_3)
    assert len(c) == 28


# ============================================================================ rms_norm
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (33, 760), (17, 1128), (0, 64), (2, 5, 129), (3, 1)])
def test_rms_norm_numerics(dtype, shape):
    x, w = _rand(*shape, dtype=dtype), _rand(shape[-1], dtype=dtype)
    y = rms_norm(x, w, EPS, backend=B)
    assert y.dtype == dtype and y.shape == x.shape
    rtol, atol = tolerance(dtype)
    assert_close(y, _rms64(x, w), rtol=rtol, atol=atol, what=f"rms_norm {shape} {dtype}")
    res = _rand(*shape, dtype=dtype)
    y2, s = rms_norm(x, w, EPS, res, backend=B)
    assert_bitwise(s, x + res, "residual sum == torch's x + residual")
    assert_close(y2, _rms64(s, w), rtol=rtol, atol=atol, what="fused rms_norm")


@needs_triton
def test_rms_norm_mixed_weight_dtype():
    x, w = _rand(9, 64, dtype=torch.float16), _rand(64, dtype=torch.float32)
    y = rms_norm(x, w, backend=B)
    assert y.dtype == torch.float16
    assert_close(y, _rms64(x, w), rtol=1e-3, atol=1e-3, what="fp16 x, fp32 weight")


@needs_triton
@pytest.mark.parametrize("h", [96, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_backward_numerics_and_determinism(dtype, h):
    x = _rand(45, h, dtype=dtype).requires_grad_(True)
    w = _rand(h, dtype=dtype).requires_grad_(True)
    g = _rand(45, h, dtype=dtype)
    # dw sums 45 rows of products of size ~1: scale atol with the reduction length
    check_backward(B, x, w, g, dw_atol_scale=45**0.5)


@needs_triton
@pytest.mark.parametrize("h", [72, 760])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_invariance_forward(dtype, h):
    w = _rand(h, dtype=dtype)
    x = _rand(150, h, dtype=dtype)
    check_row_invariance(lambda t: rms_norm(t, w, backend=B), x, counts=COUNTS, what="fwd")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_invariance_fused_forward(dtype):
    w = _rand(128, dtype=dtype)
    x, res = _rand(199, 128, dtype=dtype), _rand(199, 128, dtype=dtype)
    f = fused_rows(B, x, w, res)
    check_row_invariance(f, torch.arange(199.0, device=DEVICE), counts=COUNTS, what="fused fwd")


@needs_triton
@pytest.mark.parametrize("wgrad", [False, True])  # True: the fused one-pass backward runs
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_invariance_dx(dtype, fused, wgrad):
    w0 = _rand(200, dtype=dtype)
    x, res = _rand(150, 200, dtype=dtype), _rand(150, 200, dtype=dtype)
    gy, gs = _rand(150, 200, dtype=dtype), _rand(150, 200, dtype=dtype)
    dx = dx_rows(B, x, w0, res, gy, gs, fused=fused, wgrad=wgrad)
    check_row_invariance(
        dx, torch.arange(150.0, device=DEVICE), counts=COUNTS, what=f"dX {fused=} {wgrad=}"
    )


@needs_triton
@pytest.mark.parametrize("grad_s", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_equals_unfused(dtype, grad_s):
    x0, r0 = _rand(67, 72, dtype=dtype), _rand(67, 72, dtype=dtype)
    w0 = _rand(72, dtype=dtype)
    gy, gs = _rand(67, 72, dtype=dtype), _rand(67, 72, dtype=dtype)
    check_fused_equals_unfused(B, x0, r0, w0, gy, gs, grad_s=grad_s)


def _wgrad_rows_and_pads(h: int) -> tuple[int, tuple[int, ...]]:
    """Row count (several weight-gradient partials at H = 2048) and the zero-row paddings
    around one chunk of the zero-padding tests."""
    chunk = rms_triton.get_config(h).wgrad_chunk
    return (chunk + 7 if h == 2048 else 50), (1, chunk - 7, chunk + 3)


def _zero_padded(pad: int, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [torch.cat([t, torch.zeros(pad, t.shape[1], device=DEVICE)]) for t in ts]


@needs_triton
@pytest.mark.parametrize("h", [24, 2048])
def test_rms_norm_wgrad_chunks_and_zero_padding(h):
    """Several weight-gradient partials (row count > chunk), appended zero rows, 3-d input."""
    m, pads = _wgrad_rows_and_pads(h)
    x, g = _rand(m, h, dtype=torch.float32), _rand(m, h, dtype=torch.float32)
    base = rms_triton.rms_norm_wgrad(g, x, EPS)
    assert_bitwise(rms_triton.rms_norm_wgrad(g, x, EPS), base, "dW run-to-run")
    for pad in pads:
        got = rms_triton.rms_norm_wgrad(*_zero_padded(pad, g, x), EPS)
        assert_bitwise(got, base, f"dW with {pad} zero rows")
    if m % 2 == 0:
        x3, g3 = x.reshape(2, m // 2, h), g.reshape(2, m // 2, h)
        assert_bitwise(rms_triton.rms_norm_wgrad(g3, x3, EPS), base, "dW of [2, M/2, H]")
    want = (g.double() * _rms64(x, torch.ones(h, device=DEVICE))).sum(0)
    assert_close(base, want, rtol=1e-4, atol=1e-4 * m**0.5, what="dW vs float64")


@needs_triton
@pytest.mark.parametrize("h", [24, 200, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_backward_equals_separate_extras(dtype, h):
    """The one-pass backward gives the bits of the dX and wgrad kernels (several chunks)."""
    m = rms_triton.get_config(h).wgrad_chunk + 7 if h == 2048 else 77
    g = torch.Generator().manual_seed(3)
    x, gy, gs = (_rand(m, h, dtype=dtype, gen=g) for _ in range(3))
    w = _rand(h, dtype=dtype, gen=g)
    dx, dw = rms_triton.rms_norm_backward(gy, x, w, EPS)
    assert dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == (h,)
    assert_bitwise(dx, rms_triton.rms_norm_dx(gy, x, w, EPS), "fused backward dx vs dx kernel")
    assert_bitwise(dw, rms_triton.rms_norm_wgrad(gy, x, EPS), "fused backward dW vs wgrad")
    ds, dw2 = rms_triton.rms_norm_backward(gy, x, w, EPS, gs)
    assert_bitwise(ds, rms_triton.rms_norm_dx(gy, x, w, EPS) + gs, "dx + grad_sum")
    assert_bitwise(dw2, dw, "dW with grad_sum")
    dx3, dw3 = rms_triton.rms_norm_backward(gy.reshape(1, m, h), x.reshape(1, m, h), w, EPS)
    assert dx3.shape == (1, m, h)
    assert_bitwise(dx3.reshape(m, h), dx, "3-d dx")
    assert_bitwise(dw3, dw, "3-d dW")


# the backward's schedule-only knobs (no effect on bits); each must give the default's bits
_BWD_SCHEDULES = (
    {"prefetch": True, "stages": 1, "reload_weight": False},
    {"prefetch": False, "stages": 1, "reload_weight": False},
    {"prefetch": False, "stages": 3, "reload_weight": True},
    {"prefetch": True, "reload_weight": True, "combine_block": 16, "combine_unroll": 3},
    {"combine_block": 256, "combine_unroll": 1, "combine_warps": 1},
)


@needs_triton
@pytest.mark.parametrize("h", [96, 2048])
def test_rms_norm_backward_schedule_knobs_keep_bits(h):
    """Prefetch, pipelining depth, weight reloads and the combine's launch change no bit."""
    cfg = rms_triton.get_bwd_config(h)
    m = 2 * cfg.wgrad_chunk + 5
    x, gy, gs = (_rand(m, h, dtype=torch.float16) for _ in range(3))
    w = _rand(h, dtype=torch.float16)
    want = rms_triton.rms_norm_backward(gy, x, w, EPS, gs)
    for knobs in _BWD_SCHEDULES:
        c = dataclasses.replace(cfg, **knobs)
        got = rms_triton._backward(gy, x, w, EPS, gs, cfg=c)
        assert_bitwise(got[0], want[0], f"dx with {knobs}")
        assert_bitwise(got[1], want[1], f"dW with {knobs}")
        wg = rms_triton._backward(gy, x, None, EPS, None, cfg=c)[1]
        assert_bitwise(wg, want[1], f"wgrad-only dW with {knobs}")


def test_rms_norm_backward_config_depends_on_hidden_size_only():
    """The backward rule: valid for every H, one value per H, chunks of whole dX tiles."""
    params = inspect.signature(rms_triton.get_bwd_config).parameters
    assert list(params) == ["h"]
    for h in (1, 16, 72, 128, 760, 1128, 2048, 4096, 5120, 8192, 16384, 65536):
        c = rms_triton.get_bwd_config(h)
        assert c == rms_triton.get_bwd_config(h)
        assert c.block_h >= h and c.block_h == rms_triton.get_config(h).block_h
        assert c.rows >= 1 and c.wgrad_chunk % c.rows == 0
        assert rms_triton.get_config(h).wgrad_chunk == c.wgrad_chunk
    with pytest.raises(ValueError, match="hidden size"):
        rms_triton.get_bwd_config(rms_triton.MAX_HIDDEN + 1)
    c = rms_triton.get_bwd_config(2048)
    for bad in ({"rows": 2, "wgrad_chunk": 5}, {"rows": 3}, {"num_warps": 3}, {"stages": 0}):
        with pytest.raises(ValueError, match="invalid backward configuration"):
            dataclasses.replace(c, **bad)


@needs_triton
@pytest.mark.parametrize("h", [200, 2048])
def test_rms_norm_backward_dx_row_invariance_across_chunks(h):
    """dX of the fused backward (and of the dX kernel) is bitwise row invariant for row counts
    on both sides of the weight-gradient chunk boundaries (1, chunk - 1, chunk, chunk + 1, ...)."""
    cfg = rms_triton.get_bwd_config(h)
    ch = cfg.wgrad_chunk
    n = 2 * ch + 3
    x, gy = _rand(n, h, dtype=torch.float16), _rand(n, h, dtype=torch.float16)
    w = _rand(h, dtype=torch.float16)

    def fused_dx(idx):
        i = idx.long()
        return rms_triton.rms_norm_backward(gy[i], x[i], w, EPS)[0]

    counts = sorted({1, 2, cfg.rows + 1, ch - 1, ch, ch + 1, 2 * ch + 1})
    rows = torch.arange(float(n), device=DEVICE)
    check_row_invariance(fused_dx, rows, counts=counts, what=f"fused dX H={h}")
    want = rms_triton.rms_norm_backward(gy, x, w, EPS)[0]
    for k in counts:
        assert_bitwise(rms_triton.rms_norm_dx(gy[-k:], x[-k:], w, EPS), want[-k:], f"dX {k=}")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_backward_numerics(dtype):
    m, h = 45, 200
    x, gy, gs = (_rand(m, h, dtype=dtype) for _ in range(3))
    w = _rand(h, dtype=dtype)
    ds, dw = rms_triton.rms_norm_backward(gy, x, w, EPS, gs)
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    _rms64(x64, w64).backward(gy.double())
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(ds, x64.grad + gs.double(), rtol=rtol, atol=atol, what="fused bwd dx + gs")
    assert_close(dw, w64.grad, rtol=rtol, atol=atol * m**0.5, what="fused bwd dW")


@needs_triton
@pytest.mark.parametrize("h", [24, 2048])
def test_rms_norm_fused_backward_zero_padding(h):
    """Appended zero rows: dW bitwise unchanged, dx of the real rows unchanged, zero dx rows."""
    m, pads = _wgrad_rows_and_pads(h)
    x, gy = _rand(m, h, dtype=torch.float32), _rand(m, h, dtype=torch.float32)
    w = _rand(h, dtype=torch.float32)
    dx, dw = rms_triton.rms_norm_backward(gy, x, w, EPS)
    again = rms_triton.rms_norm_backward(gy, x, w, EPS)
    assert_bitwise(again[0], dx, "dx run-to-run")
    assert_bitwise(again[1], dw, "dW run-to-run")
    for pad in pads:
        dxp, dwp = rms_triton.rms_norm_backward(*_zero_padded(pad, gy, x), w, EPS)
        assert_bitwise(dwp, dw, f"dW with {pad} zero rows")
        assert_bitwise(dxp[:m], dx, f"dx with {pad} zero rows")
        assert not dxp[m:].any()


@needs_triton
def test_rms_norm_fused_backward_shape_errors():
    x, w = _rand(4, 8, dtype=torch.float32), _rand(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="grad shape"):
        rms_triton.rms_norm_backward(_rand(4, 9, dtype=torch.float32), x, w, EPS)
    with pytest.raises(ValueError, match="grad_sum shape"):
        rms_triton.rms_norm_backward(x, x, w, EPS, _rand(3, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="weight shape"):
        rms_triton.rms_norm_backward(x, x, _rand(9, dtype=torch.float32), EPS)


@needs_triton
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_autograd_uses_fused_backward(monkeypatch, fused):
    """Input and weight gradients: one fused backward op; one gradient: the separate op."""
    calls = []
    extras = rms_triton.PROVIDER.extras
    for name in ("dx", "wgrad", "backward"):
        fn = extras[name]
        monkeypatch.setitem(extras, name, lambda *a, _f=fn, _n=name: calls.append(_n) or _f(*a))
    x0, r0 = _rand(9, 40, dtype=torch.float32), _rand(9, 40, dtype=torch.float32)
    w0, gy = _rand(40, dtype=torch.float32), _rand(9, 40, dtype=torch.float32)
    got = {}
    for need in ("both", "x", "w"):
        x = x0.clone().requires_grad_(need != "w")
        w = w0.clone().requires_grad_(need != "x")
        y = rms_norm(x, w, EPS, r0, backend=B)[0] if fused else rms_norm(x, w, EPS, backend=B)
        y.backward(gy)
        got[need] = (x.grad, w.grad)
    assert calls == ["backward", "dx", "wgrad"]
    assert_bitwise(got["both"][0], got["x"][0], "dx: fused backward vs dx op")
    assert_bitwise(got["both"][1], got["w"][1], "dW: fused backward vs wgrad op")


@needs_triton
def test_rms_norm_strided_input():
    x = _rand(40, 2 * 96, dtype=torch.float32)[::2, ::2]
    w = _rand(96, dtype=torch.float32)
    want = rms_norm(x.contiguous(), w, backend=B)
    assert_bitwise(rms_norm(x, w, backend=B), want, "strided")
    wide = _rand(2 * 96, dtype=torch.float32)
    assert_bitwise(
        rms_norm(x.contiguous(), wide[::2], backend=B),
        rms_norm(x.contiguous(), wide[::2].contiguous(), backend=B),
        "strided weight",
    )


@needs_triton
def test_rms_norm_opcheck():
    x = _rand(5, 7, dtype=torch.float32)
    r, w, g = (
        _rand(5, 7, dtype=torch.float32),
        _rand(7, dtype=torch.float32),
        _rand(5, 7, dtype=torch.float32),
    )
    ops = torch.ops.rl_engine
    torch.library.opcheck(ops.rms_norm.default, (x.clone().requires_grad_(), w, EPS, B))
    torch.library.opcheck(ops.fused_add_rms_norm.default, (x, r, w, EPS, B))
    torch.library.opcheck(ops.rms_norm_dx.default, (g, x, w, EPS, B))
    torch.library.opcheck(ops.rms_norm_wgrad.default, (g, x, EPS, B))
    torch.library.opcheck(ops.rms_norm_backward.default, (g, x, w, None, EPS, B))
    torch.library.opcheck(ops.rms_norm_backward.default, (g, x, w, r, EPS, B))
    torch.library.opcheck(
        ops.fused_add_rms_norm.default,
        (
            x.clone().requires_grad_(),
            r.clone().requires_grad_(),
            w.clone().requires_grad_(),
            EPS,
            B,
        ),
    )


@needs_triton
def test_rms_norm_compile_matches_eager():
    x, r = _rand(9, 32, dtype=torch.float32), _rand(9, 32, dtype=torch.float32)
    w = _rand(32, dtype=torch.float32)
    backend = "inductor" if ON_GPU else "eager"
    f = torch.compile(
        lambda a, b, c: rms_norm(a, c, EPS, b, backend=B), fullgraph=True, backend=backend
    )
    for got, want, n in zip(f(x, r, w), rms_norm(x, w, EPS, r, backend=B), "ys"):
        assert_bitwise(got, want, f"compile vs eager {n}")


@needs_triton
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_compile_backward_matches_eager(fused):
    """The autograd's fused backward op traced by AOTAutograd (fake impl) and run compiled."""
    x0, r0 = _rand(9, 32, dtype=torch.float32), _rand(9, 32, dtype=torch.float32)
    w0, gy = _rand(32, dtype=torch.float32), _rand(9, 32, dtype=torch.float32)

    def loss(x, w):
        if fused:
            y, s = rms_norm(x, w, EPS, r0, backend=B)
            return (y * gy).sum() + (s * r0).sum()
        return (rms_norm(x, w, EPS, backend=B) * gy).sum()

    def grads(fn):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        fn(x, w).backward()
        return x.grad, w.grad

    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    for got, want, n in zip(grads(compiled), grads(loss), ("dx", "dw")):
        assert_bitwise(got, want, f"compiled backward vs eager {n}")


# ============================================================================ silu_and_mul
def _silu64(x):
    d = x.shape[-1] // 2
    a, b = x[..., :d].double(), x[..., d:].double()
    return a * torch.sigmoid(a) * b


def _silu_inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(shape, generator=g)
    if x.numel() >= 4:  # saturated and zero gates
        x.view(-1)[:4] = torch.tensor([0.0, -30.0, 30.0, -100.0])
    return x.to(device=DEVICE, dtype=dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (33, 2 * 760), (17, 2 * 1128), (0, 64), (2, 5, 258)])
def test_silu_and_mul_numerics(dtype, shape):
    x = _silu_inputs(shape, dtype)
    y = silu_and_mul(x, backend=B)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2)
    rtol, atol = tolerance(dtype)
    assert_close(y, _silu64(x), rtol=rtol, atol=atol, what=f"silu_and_mul {shape} {dtype}")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_backward(dtype):
    x = _silu_inputs((45, 2 * 96), dtype).requires_grad_(True)
    g = _rand(45, 96, dtype=dtype)

    def grad():
        x.grad = None
        silu_and_mul(x, backend=B).backward(g)
        return x.grad.clone()

    gx = grad()
    assert_bitwise(grad(), gx, "dx run-to-run")
    x64 = x.detach().double().requires_grad_(True)
    _silu64(x64).backward(g.double())
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(gx, x64.grad, rtol=rtol, atol=atol, what="silu_and_mul dx")


@needs_triton
@pytest.mark.parametrize("d", [45, 1100] if ON_GPU else [45, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_row_invariance(dtype, d):
    x = _silu_inputs((150, 2 * d), dtype)
    gy = _rand(150, d, dtype=dtype)
    check_row_invariance(lambda t: silu_and_mul(t, backend=B), x, counts=COUNTS, what="fwd")

    def dx(idx):
        i = idx.long()
        xi = x[i].clone().requires_grad_(True)
        silu_and_mul(xi, backend=B).backward(gy[i])
        return xi.grad

    check_row_invariance(dx, torch.arange(150.0, device=DEVICE), counts=COUNTS, what="dX")


@needs_triton
def test_silu_and_mul_strided_and_opcheck():
    x = _silu_inputs((20, 4 * 48), torch.float32)[::2, 1::2]
    assert_bitwise(silu_and_mul(x, backend=B), silu_and_mul(x.contiguous(), backend=B), "strided")
    xs, g = _silu_inputs((5, 14), torch.float32), _rand(5, 7, dtype=torch.float32)
    ops = torch.ops.rl_engine
    torch.library.opcheck(ops.silu_and_mul.default, (xs.clone().requires_grad_(), B))
    torch.library.opcheck(ops.silu_and_mul_backward.default, (g, xs, B))


# ============================================================================ rope
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_ROPE_CASES = [
    (10000.0, 24, None),
    (500000.0, 24, _LLAMA3),
    (10000.0, 16, {"rope_type": "linear", "factor": 4.0}),  # partial rotary
    (1000000.0, 8, None),
]


@needs_triton
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("case", _ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_bitwise_equals_native(dtype, case, neox):
    """Same numerics family as the reference: forward and backward bit for bit."""
    theta, rd, scaling = case
    g = torch.Generator().manual_seed(1)
    x = _rand(67, 3, 24, dtype=dtype, gen=g)
    pos = torch.randint(0, 200000, (67,), generator=g).to(DEVICE)
    for p in (pos, pos.to(torch.int32)):
        got = rope(x, p, theta, rd, neox, scaling, backend=B)
        assert_bitwise(got, rope(x, p, theta, rd, neox, scaling, backend="native"), "fwd")
        back = rope_triton.rope_backward(x, p, theta, rd, neox, scaling)
        assert_bitwise(back, rope_ref.rope_backward(x, p, theta, rd, neox, scaling), "bwd")
    assert rope_triton.PROVIDER.numerics == KernelRegistry.provider("rope", "native").numerics


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_autograd_row_invariance_and_strides(dtype):
    n = 150
    g = torch.Generator().manual_seed(2)
    x = _rand(n, 4, 32, dtype=dtype, gen=g)
    gy = _rand(n, 4, 32, dtype=dtype, gen=g)
    pos = torch.randint(0, 8192, (n,), generator=g).to(DEVICE)

    def fwd(idx):
        i = idx.long()
        return rope(x[i], pos[i], rotary_dim=24, backend=B)

    def dx(idx):
        i = idx.long()
        xi = x[i].clone().requires_grad_(True)
        rope(xi, pos[i], rotary_dim=24, backend=B).backward(gy[i])
        return xi.grad

    idx = torch.arange(float(n), device=DEVICE)
    check_row_invariance(fwd, idx, counts=COUNTS, what="rope fwd")
    check_row_invariance(dx, idx, counts=COUNTS, what="rope dX")
    # a q slice of a fused qkv buffer (strided in every dim but the last)
    qkv = _rand(n, 12, 32, dtype=dtype, gen=g)
    q = qkv[:, :4]
    assert_bitwise(rope(q, pos, backend=B), rope(q.contiguous(), pos, backend=B), "strided")
    assert rope(x[:0], pos[:0], backend=B).shape == (0, 4, 32)


@needs_triton
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_one_launch_equals_native_on_each(dtype, neox):
    """``rope_qk`` (q and k in one launch, the tables once): bitwise the reference on each, on
    the strided q / k views of a fused QKV buffer, forward and backward, and row invariant."""
    g = torch.Generator().manual_seed(4)
    n = 67
    qkv = _rand(n, 5 + 3 + 3, 24, dtype=dtype, gen=g)
    q, k = qkv[:, :5], qkv[:, 5:8]
    pos = torch.randint(0, 200000, (n,), generator=g).to(DEVICE)
    for theta, rd, scaling in _ROPE_CASES[:3]:
        kw = dict(theta=theta, rotary_dim=rd, is_neox=neox, scaling=scaling)
        yq, yk = rope_qk(q, k, pos, backend=B, **kw)
        assert_bitwise(yq, rope(q, pos, backend="native", **kw), "q")
        assert_bitwise(yk, rope(k, pos, backend="native", **kw), "k")
        bq, bk = rope_triton.rope_qk_backward(q, k, pos, theta, rd, neox, scaling)
        assert_bitwise(bq, rope_ref.rope_backward(q, pos, theta, rd, neox, scaling), "dq")
        assert_bitwise(bk, rope_ref.rope_backward(k, pos, theta, rd, neox, scaling), "dk")
    idx = torch.arange(float(n), device=DEVICE)
    check_row_invariance(
        lambda i: torch.cat(rope_qk(q[i.long()], k[i.long()], pos[i.long()], backend=B), 1),
        idx,
        counts=(1, 17, 33),
        what="rope_qk",
    )


@needs_triton
def test_rope_opcheck():
    x, pos = _rand(5, 2, 8, dtype=torch.float32), torch.arange(5, device=DEVICE)
    args = (10000.0, 8, True, "default", 1.0, 0.0, 0.0, 0, B)
    ops = torch.ops.rl_engine
    torch.library.opcheck(ops.rope.default, (x.clone().requires_grad_(), pos, *args))
    torch.library.opcheck(ops.rope_backward.default, (x, pos, *args))
    k = _rand(5, 1, 8, dtype=torch.float32)
    torch.library.opcheck(
        ops.rope_qk.default, (x.clone().requires_grad_(), k.clone().requires_grad_(), pos, *args)
    )
    torch.library.opcheck(ops.rope_qk_backward.default, (x, k, pos, *args))


# ============================================================================ GPU only
@gpu
@pytest.mark.parametrize("h", [4096, 8192])
def test_gpu_rms_norm_large_bf16(h):
    dtype = torch.bfloat16
    x = torch.randn(4099, h, device="cuda", dtype=dtype)
    res = torch.randn(4099, h, device="cuda", dtype=dtype)
    w = torch.randn(h, device="cuda", dtype=dtype)
    check_row_invariance(
        lambda t: rms_norm(t, w, backend=B), x, counts=(1, 17, 255, 256, 257, 2048), what="fwd"
    )
    y, s = rms_norm(x, w, EPS, res, backend=B)
    assert_bitwise(s, x + res, "residual sum")
    assert_bitwise(y, rms_norm(x + res, w, EPS, backend=B), "fused vs unfused")
    rtol, atol = tolerance(dtype)
    assert_close(y, _rms64(s, w), rtol=rtol, atol=atol, what="bf16 large")
    g = torch.randn_like(x)
    dw = rms_triton.rms_norm_wgrad(g, x, EPS)
    assert_bitwise(rms_triton.rms_norm_wgrad(g, x, EPS), dw, "dW run-to-run")
    z = torch.zeros(333, h, device="cuda", dtype=dtype)
    assert_bitwise(rms_triton.rms_norm_wgrad(torch.cat([g, z]), torch.cat([x, z]), EPS), dw, "pad")
    # the one-pass backward: the bits of the separate kernels, zero-padding invariant dW
    dxf, dwf = rms_triton.rms_norm_backward(g, x, w, EPS)
    assert_bitwise(dxf, rms_triton.rms_norm_dx(g, x, w, EPS), "fused backward dx")
    assert_bitwise(dwf, dw, "fused backward dW")
    dsf, _ = rms_triton.rms_norm_backward(g, s, w, EPS, res)
    assert_bitwise(dsf, rms_triton.rms_norm_dx(g, s, w, EPS) + res, "fused backward dx + gs")
    dxp, dwp = rms_triton.rms_norm_backward(torch.cat([g, z]), torch.cat([x, z]), w, EPS)
    assert_bitwise(dwp, dw, "fused backward dW, zero rows")
    assert_bitwise(dxp[:4099], dxf, "fused backward dx, zero rows")

    def dx_rows(idx):
        i = idx.long()
        xi, wi = x[i].clone().requires_grad_(True), w.clone().requires_grad_(True)
        rms_norm(xi, wi, EPS, backend=B).backward(g[i])
        return xi.grad

    check_row_invariance(
        dx_rows,
        torch.arange(4099.0, device="cuda"),
        counts=(1, 17, 255, 256, 257, 2048),
        what="autograd dX (fused backward)",
    )


@gpu
def test_gpu_silu_and_mul_large_bf16():
    x = _silu_inputs((2049, 2 * 14336), torch.bfloat16)
    check_row_invariance(
        lambda t: silu_and_mul(t, backend=B), x, counts=(1, 17, 255, 1024), what="fwd"
    )
    assert_close(silu_and_mul(x, backend=B), _silu64(x), rtol=1e-2, atol=1e-2, what="bf16")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rope_large_equals_native(dtype):
    x = torch.randn(4099, 32, 128, device="cuda", dtype=dtype)
    pos = torch.randint(0, 131072, (4099,), device="cuda")
    for neox in (True, False):
        got = rope(x, pos, 500000.0, 128, neox, _LLAMA3, backend=B)
        assert_bitwise(got, rope(x, pos, 500000.0, 128, neox, _LLAMA3, backend="native"), "gpu")


@gpu
def test_gpu_int64_offsets_rms_norm():
    h = 8192
    m = (2**31) // h + 3  # element offsets pass 2^31
    try:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
    y = rms_norm(x, w, backend=B)
    assert_bitwise(y[-5:], rms_norm(x[-5:].clone(), w, backend=B), "last rows, int64 offsets")
    del x, y


@gpu
def test_gpu_compile_inductor_and_cuda_graph():
    dtype = torch.bfloat16
    x = torch.randn(64, 2048, device="cuda", dtype=dtype)
    res = torch.randn(64, 2048, device="cuda", dtype=dtype)
    w = torch.randn(2048, device="cuda", dtype=dtype)
    gu = torch.randn(64, 2 * 4096, device="cuda", dtype=dtype)
    q = torch.randn(64, 16, 128, device="cuda", dtype=dtype)
    pos = torch.arange(64, device="cuda") * 7

    def block(x, res, gu, q):
        y, s = rms_norm(x, w, EPS, res, backend=B)
        return y, s, silu_and_mul(gu, backend=B), rope(q, pos, 10000.0, backend=B)

    eager = block(x, res, gu, q)
    compiled = torch.compile(block, fullgraph=True)(x, res, gu, q)
    for a, b in zip(compiled, eager):
        assert_bitwise(a, b, "inductor vs eager")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(x, res, gu, q)  # warm-up (tables, compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = block(x, res, gu, q)
    for src in (x, res, gu, q):
        src.copy_(torch.randn_like(src))
    graph.replay()
    for a, b in zip(captured, block(x, res, gu, q)):
        assert_bitwise(a, b, "CUDA graph replay vs eager")
