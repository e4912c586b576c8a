"""poly_norm / fused_mul_poly_norm: numerics vs float64 (forward and every gradient), row
invariance (forward, dx), fused == unfused bitwise (forward and backward), deterministic and
zero-row-padding-invariant parameter gradients, opcheck, errors. Every invariant provider
runnable here: the Triton one on the GPU when there is one (bf16 too), else with
``TRITON_INTERPRET=1`` (fp32 / fp16 in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from rl_engine import config
from rl_engine.ops import fused_mul_poly_norm, poly_norm
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import backend_fixture

backend = backend_fixture("poly_norm")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _interpreted(backend) -> bool:
    return backend == "triton" and backend.device == "cpu"


def _skip_dtype(backend, dtype):
    # the interpreter is exercised with fp32 / fp16 (its bf16 is not the GPU's; PLATFORMS.md)
    if _interpreted(backend) and dtype == torch.bfloat16:
        pytest.skip("interpreter: fp32 / fp16")


def _params(dtype=torch.float32, device="cpu"):
    w = torch.tensor([0.3, 0.5, 0.2], dtype=dtype, device=device, requires_grad=True)
    b = torch.tensor([0.1], dtype=dtype, device=device, requires_grad=True)
    return w, b


def _ref64(x, w, b, eps=1e-6, mul=None):
    def n(z):
        return z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps)

    y = w[0] * n(x**3) + w[1] * n(x**2) + w[2] * n(x) + b
    return y if mul is None else y * mul


def _param_grad_terms64(x64, gy, mul=None):
    """The float64 terms whose sums are dweight [3] and dbias [1]: ``g * n(x**3)``,
    ``g * n(x**2)``, ``g * n(x)`` and ``g`` with ``g = gy * mul``, flattened."""

    def n(z):
        return z / torch.sqrt((z * z).mean(-1, keepdim=True) + 1e-6)

    g = gy.double() if mul is None else gy.double() * mul.double()
    x64 = x64.detach()
    return [(g * t).reshape(-1) for t in (n(x64**3), n(x64**2), n(x64), torch.ones_like(x64))]


def _param_grad_atol(dtype, terms):
    """Absolute tolerance of dweight / dbias, one per component: a sum of N terms, each
    carrying up to one rounding of ``dtype`` (``grad * mul`` is rounded to ``x.dtype`` as in
    ``poly_norm(x) * mul``'s backward) plus the fp32 reduction's own rounding. Independent
    roundings add as a random walk: the error's standard deviation is about
    ``u * ||terms||_2`` (u: the unit roundoff, 2^-8 for bf16), whatever N. The gradient rtol of
    the tolerance table (5u for bf16 / fp16 rows) times ``||terms||_2`` bounds it; for random-sign
    terms ``||terms||_2`` is the size of the gradient itself, so the bound is a few percent of
    the gradient (the bound it replaces, ``atol * sqrt(N) * max|grad|``, was 34x the gradient
    at N = 33 x 14336 in bf16). The fp32 accumulation adds ~2^-24 ||terms||_2, far below."""
    rg, _ = tolerance(dtype, grad=True)
    return torch.stack([rg * t.norm() for t in terms]).to(torch.float32)


def _check_param_grads(dw, db, dw64, db64, terms, dtype, what):
    """dweight / dbias vs float64 within :func:`_param_grad_atol`, and a negative control: the
    same check fails on a gradient off by 10% of its scale ``||terms||_2`` (a dropped row
    block or a lost partial is of that size), so the tolerance can fail."""
    atol = _param_grad_atol(dtype, terms).to(dw.device)
    rg, _ = tolerance(dtype, grad=True)
    got, want = torch.cat([dw, db]), torch.cat([dw64, db64]).to(dw.device)
    err = (got.double() - want).abs()
    bound = atol.double() + rg * want.abs()
    assert bool((err <= bound).all()), (
        f"{what}: |d(w, b) - float64| {err.tolist()} > bound {bound.tolist()} "
        f"(||terms||_2 {[float(t.norm()) for t in terms]})"
    )
    scale = torch.stack([t.norm() for t in terms]).to(dw.device)
    off = got.double() + 0.1 * scale  # perturbed by 10% of the gradient's scale
    assert bool(((off - want).abs() > bound).all()), f"{what}: the tolerance cannot fail"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (9, 33), (3, 1100), (2, 3, 130), (0, 16)])
def test_forward_and_grads_vs_float64(backend, shape, dtype):
    _skip_dtype(backend, dtype)
    dev = backend.device
    g = torch.Generator().manual_seed(0)
    x = (1.5 * torch.randn(shape, generator=g)).to(dev, dtype).requires_grad_(True)
    m = torch.randn(shape, generator=g).to(dev, dtype).requires_grad_(True)
    gy = torch.randn(shape, generator=g).to(dev, dtype)
    w, b = _params(device=dev)
    y = fused_mul_poly_norm(x, m, w, b, backend=backend)
    assert y.shape == x.shape and y.dtype == dtype
    y.backward(gy)
    x64, m64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, m, w, b))
    y64 = _ref64(x64, w64, b64, mul=m64)
    y64.backward(gy.double())
    rtol, atol = tolerance(dtype)
    assert_close(y, y64, rtol=rtol, atol=atol, what=f"y {shape} {dtype}")
    rg, ag = tolerance(dtype, grad=True)
    scale = max(1.0, float(x64.grad.abs().max())) if x.numel() else 1.0
    assert_close(x.grad, x64.grad, rtol=rg, atol=ag * scale, what=f"dx {dtype}")
    assert_close(m.grad, m64.grad, rtol=rg, atol=ag, what=f"dmul {dtype}")
    if x.numel():
        terms = _param_grad_terms64(x64, gy, m)
        _check_param_grads(w.grad, b.grad, w64.grad, b64.grad, terms, dtype, f"{shape} {dtype}")
    else:
        assert_bitwise(torch.cat([w.grad, b.grad]), torch.zeros(4, device=dev), "empty x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward_and_dx(backend, dtype):
    _skip_dtype(backend, dtype)
    if _interpreted(backend) and dtype == torch.float32:
        pytest.skip("interpreter time: the fp16 case covers the kernels' row handling")
    dev = backend.device
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(24, 77, generator=g)).to(dev, dtype)
    gy = torch.randn(24, 77, generator=g).to(dev, dtype)
    w, b = (t.detach() for t in _params(device=dev))
    check_row_invariance(
        lambda r: poly_norm(r, w, b, backend=backend), x, counts=(1, 11), what="poly_norm"
    )

    def dx(idx):
        xi = x[idx.long()].clone().requires_grad_(True)
        poly_norm(xi, w, b, backend=backend).backward(gy[idx.long()])
        return xi.grad

    check_row_invariance(dx, torch.arange(24.0, device=dev), counts=(1, 11), what="poly_norm dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_unfused_forward_and_backward(backend, dtype):
    _skip_dtype(backend, dtype)
    dev = backend.device
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, 300, generator=g).to(dev, dtype).requires_grad_(True)
    m = torch.randn(13, 300, generator=g).to(dev, dtype).requires_grad_(True)
    gy = torch.randn(13, 300, generator=g).to(dev, dtype)
    w, b = _params(device=dev)

    def run(fused):
        for t in (x, m, w, b):
            t.grad = None
        if fused:
            y = fused_mul_poly_norm(x, m, w, b, backend=backend)
        else:
            y = poly_norm(x, w, b, backend=backend) * m
        y.backward(gy)
        return [y.detach()] + [t.grad.clone() for t in (x, m, w, b)]

    for a, c, what in zip(run(True), run(False), ("y", "dx", "dmul", "dw", "db")):
        assert_bitwise(a, c, f"{dtype} fused vs poly_norm(x) * mul: {what}")


def test_parameter_grads_deterministic_and_zero_padding_invariant(backend):
    dev = backend.device
    g = torch.Generator().manual_seed(3)
    x = torch.randn(19, 64, generator=g).to(dev)
    gy = torch.randn(19, 64, generator=g).to(dev)

    def grads(xx, gg):
        w, b = _params(device=dev)
        poly_norm(xx, w, b, backend=backend).backward(gg)
        return w.grad, b.grad

    first = grads(x, gy)
    for a, c in zip(grads(x, gy), first):
        assert_bitwise(a, c, "run to run")
    # rows of zero gradient appended (a padded batch): the same parameter gradients
    xp = torch.cat([x, torch.randn(14, 64, generator=g).to(dev)])
    gp = torch.cat([gy, torch.zeros(14, 64, device=dev)])
    for a, c in zip(grads(xp, gp), first):
        assert_bitwise(a, c, "zero-gradient rows appended")


def test_opcheck():
    if config.settings().triton_interpret:
        pytest.skip("opcheck of the native provider")
    x, m = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    w, b = _params()
    op = torch.ops.rl_engine.poly_norm.default
    torch.library.opcheck(op, (x, None, w, b, 1e-6, "native"))
    torch.library.opcheck(op, (x, m, w, b, 1e-6, "native"))
    bwd = torch.ops.rl_engine.poly_norm_backward.default
    x, m, w, b = (t.detach() for t in (x, m, w, b))
    torch.library.opcheck(bwd, (torch.randn(5, 8), x, m, w, b, 1e-6, "native"))
    torch.library.opcheck(bwd, (torch.randn(5, 8), x, None, w, b, 1e-6, "native"))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(weight=torch.ones(2)), ValueError, "3 elements"),
        (dict(bias=torch.ones(2)), ValueError, "bias 1"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(x=torch.ones(3, 4, dtype=torch.int32)), TypeError, "x"),
        (dict(mul=torch.ones(3, 5)), ValueError, "mul must have x's shape"),
    ],
)
def test_errors(kwargs, exc, match):
    args = dict(x=torch.ones(3, 4), weight=torch.ones(3), bias=torch.zeros(1), eps=1e-6)
    mul = kwargs.pop("mul", None)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        if mul is None:
            poly_norm(**args, backend="native")
        else:
            fused_mul_poly_norm(args["x"], mul, args["weight"], args["bias"], backend="native")


def test_self_test():
    from rl_engine.selftest import self_test

    self_test("poly_norm", "cpu")


def _triton_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if config.settings().triton_interpret:
        return "cpu"
    pytest.skip("the Triton provider: a CUDA device or TRITON_INTERPRET=1")


@pytest.mark.parametrize("m", [0, 1, 2, 3, 17, 2048, 2049, 9000])
def test_triton_row_sum_program_is_the_reference_tree(m):
    """The Triton backward's sum of the parameter partials over rows (one program, levels in
    memory then registers) is :func:`reference.sum_rows` bit for bit, below and above each of
    its step sizes (so dweight / dbias keep their bits)."""
    from rl_engine.ops.poly_norm import reference
    from rl_engine.ops.poly_norm import triton as pn_triton

    dev = _triton_device()
    g = torch.Generator().manual_seed(m)
    part = torch.randn(m, 4, generator=g) * torch.logspace(-4, 4, max(m, 1))[:m, None]
    assert_bitwise(pn_triton.sum_rows(part.to(dev)).cpu(), reference.sum_rows(part), f"M={m}")


@pytest.mark.parametrize("h", [300, 1024, 1546])
def test_triton_launch_setup_keeps_the_bits(h):
    """``warps`` and ``unroll`` of the Triton kernels are speed only: every setup of the shipped
    lane count gives the same bits (forward, fused, dx, dmul, dweight, dbias). H = 1546 has six
    whole blocks (one unrolled step of four and two left) and a masked tail; 1024 has no tail;
    300 one whole block and a tail. A setup that is not powers of two is refused."""
    from rl_engine.ops.poly_norm import triton as pn_triton

    dev = _triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16  # interpreter: fp16 (PLATFORMS.md)
    g = torch.Generator().manual_seed(h)
    x, mul, gy = ((1.5 * torch.randn(5, h, generator=g)).to(dt).to(dev) for _ in range(3))
    w, b = torch.tensor([0.3, -0.7, 1.1], device=dev), torch.tensor([0.05], device=dev)

    def run(cfg):
        out = [pn_triton._launch_fwd(x, w, b, 1e-6, m, cfg) for m in (None, mul)]
        for m in (None, mul):
            out += [t for t in pn_triton._launch_bwd(gy, x, w, b, 1e-6, m, cfg) if t is not None]
        return out

    lanes = pn_triton.LANES
    want = run(pn_triton.Config(lanes, 1, 1))
    for cfg in (pn_triton.Config(lanes, 2, 4), pn_triton.Config(lanes, 4, 2),
                pn_triton.Config(lanes, 1, 8),
                pn_triton.launch_config(h)):  # fmt: skip
        for i, (a, c) in enumerate(zip(run(cfg), want, strict=True)):
            assert_bitwise(a, c, f"H={h} {cfg}: result {i}")
    with pytest.raises(ValueError, match="unroll must be a power of two"):
        run(pn_triton.Config(lanes, 1, 3))
    # the lane count is the numerics: four times the lanes changes bits here (up to H = 2 x
    # lanes a tree's first level adds the same pairs as the lanes' column order)
    other = run(pn_triton.Config(lanes * 4, 1, 1))
    assert h <= 2 * lanes or not all(torch.equal(a, c) for a, c in zip(other, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("h", [77, 4160, 14336])
def test_triton_cuda_bf16_contract(h):
    """The Triton provider on the GPU in bf16 (the tests above run it in the interpreter):
    forward and every gradient vs float64, forward and dx row invariant, fused == unfused
    bitwise. H = 4160: 16 whole blocks and a masked tail; 14336: whole blocks only."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(h)
    x, m, gy = ((1.5 * torch.randn(33, h, device=dev, generator=g)).to(dt) for _ in range(3))
    w0 = torch.tensor([0.3, -0.7, 1.1], device=dev)
    b0 = torch.tensor([0.05], device=dev)
    w, b = (t.clone().requires_grad_(True) for t in (w0, b0))
    xr, mr = (t.clone().requires_grad_(True) for t in (x, m))
    y = fused_mul_poly_norm(xr, mr, w, b, backend="triton")
    y.backward(gy)
    x64, m64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, m, w0, b0))
    y64 = _ref64(x64, w64, b64, mul=m64)
    y64.backward(gy.double())
    rtol, atol = tolerance(dt)
    assert_close(y, y64, rtol=rtol, atol=atol * float(y64.abs().max()), what=f"y H={h}")
    rg, ag = tolerance(dt, grad=True)
    for got, want, name in ((xr.grad, x64.grad, "dx"), (mr.grad, m64.grad, "dmul")):
        scale = max(1.0, float(want.abs().max()))
        assert_close(got, want, rtol=rg, atol=ag * scale, what=f"{name} H={h}")
    terms = _param_grad_terms64(x64, gy, m)
    _check_param_grads(w.grad, b.grad, w64.grad, b64.grad, terms, dt, f"H={h}")
    wd, bd = w0, b0
    check_row_invariance(lambda r: poly_norm(r, wd, bd, backend="triton"), x, counts=(1, 11))

    def dx(idx):
        xi = x[idx.long()].clone().requires_grad_(True)
        poly_norm(xi, wd, bd, backend="triton").backward(gy[idx.long()])
        return xi.grad

    check_row_invariance(dx, torch.arange(33.0, device=dev), counts=(1, 11), what="dx")
    # fused == unfused, forward and backward
    outs = []
    for fused in (True, False):
        xx, mm, ww, bb = (t.clone().requires_grad_(True) for t in (x, m, w0, b0))
        yy = fused_mul_poly_norm(xx, mm, ww, bb, backend="triton") if fused else (
            poly_norm(xx, ww, bb, backend="triton") * mm)  # fmt: skip
        yy.backward(gy)
        outs.append([yy.detach(), xx.grad, mm.grad, ww.grad, bb.grad])
    for a, c, what in zip(*outs, ("y", "dx", "dmul", "dw", "db")):
        assert_bitwise(a, c, f"H={h} fused vs poly_norm(x) * mul: {what}")
