"""Triton provider of det_gemm: config equivalence, invariance, wgrad plans, GPU-only checks.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16, small
shapes) and skip otherwise; on a CUDA device they run on the GPU (bf16 / fp16 / fp32), with the
extra GPU checks (every M from 1 to 2048, samples up to 16384, int64 offsets, torch.compile,
CUDA graphs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import det_gemm
from rl_engine.ops.det_gemm import config as gemm_config
from rl_engine.ops.det_gemm import triton as gemm_triton
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import DEVICE, ON_GPU, TRITON_DTYPES, gpu, skip_unless_triton, triton_runnable

RUNNABLE = triton_runnable(gemm_triton)
needs_triton = skip_unless_triton(gemm_triton)
DTYPES = TRITON_DTYPES

# Row counts straddling every M bucket of the config table (16/32/64/128/256/512).
_THRESHOLDS = sorted(
    {m + d for m, *_ in gemm_config._TABLE_16BIT[:-1] for d in (-1, 0, 1) if m + d > 0}
)


def _rand(*shape, dtype, gen=None, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _linear(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = _rand(m, k, dtype=dtype, gen=g)
    w = _rand(n, k, dtype=dtype, gen=g, scale=k**-0.5)
    return a, w.t()


# --------------------------------------------------------------------- registry / availability
def test_availability_reasons():
    reason = gemm_triton.PROVIDER.why_not("cpu", triton_interpret=False)
    assert reason is not None and "TRITON_INTERPRET=1" in reason and "CUDA" in reason
    assert gemm_triton.PROVIDER.why_not("cpu", triton_interpret=True) is None
    assert "not supported" in (gemm_triton.PROVIDER.available("rocm", triton_interpret=True) or "")


def test_unavailable_backend_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        KernelRegistry.get_op("det_gemm", device="cpu", backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        gemm_triton.det_gemm(torch.randn(2, 16), torch.randn(16, 16))


@pytest.mark.skipif(gemm_triton.triton is None, reason="triton not importable")
def test_resolves_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config.reload()
    op = KernelRegistry.get_op("det_gemm", device="cpu", backend="triton")
    assert (
        op.provider.name == "triton" and op.numerics == f"det_gemm/triton-kc{gemm_config.K_CHUNK}"
    )
    # default resolution on the CPU stays native (the reference comes first there)
    assert KernelRegistry.get_op("det_gemm", device="cpu").provider.name == "native"


def test_config_table_is_sane():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cfgs = gemm_config.all_configs(dtype)
        assert cfgs and all(isinstance(c, gemm_config.DetGemmConfig) for c in cfgs)
        for m in (1, 16, 17, 64, 65, 300, 5000, 1 << 40):
            for n, k in ((4096, 4096), (2048, 2048), (2048, 5632), (151936, 2048)):
                assert gemm_config.get_config(m, n, k, dtype) in cfgs
    # a small weight (a ~1B model's projection) takes narrow tiles at decode sizes
    assert gemm_config.get_config(64, 2048, 2048, torch.bfloat16).block_n <= 32
    with pytest.raises(ValueError, match="power of two"):
        gemm_config.DetGemmConfig(24, 64, 64)
    with pytest.raises(ValueError, match="divide"):
        gemm_config.WgradConfig(64, 64, 48)


def test_errors_direct_call():
    with pytest.raises(ValueError, match="cannot be multiplied"):
        gemm_triton.det_gemm(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="device"):
        gemm_triton.det_gemm(torch.randn(3, 4), torch.randn(4, 6, device="meta"))
    with pytest.raises(TypeError, match="dtype"):
        gemm_triton.det_gemm(torch.randn(3, 4), torch.randn(4, 6).double())
    with pytest.raises(ValueError, match="same number of rows"):
        gemm_triton.det_gemm_wgrad(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(RuntimeError, match="not supported"):
        gemm_triton._check_device(torch.empty(2, 2, device="meta"))


# --------------------------------------------------------------------- numerics / invariance
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16, 8), (37, 100, 70), (70, 760, 129), (5, 1128, 33)])
def test_numerics_vs_float64(dtype, shape):
    m, k, n = shape
    a, b = _linear(m, k, n, dtype)
    bias = _rand(n, dtype=dtype)
    out = det_gemm(a, b, bias, backend="triton")
    ref = a.double() @ b.double() + bias.double()
    rtol, atol = tolerance(dtype, k=k)
    assert_close(out, ref, rtol=rtol, atol=atol, what=f"triton det_gemm {shape} {dtype}")


def _configs_to_check(dtype):
    cfgs = list(gemm_config.all_configs(dtype))
    if ON_GPU:
        if dtype == torch.bfloat16:  # both kernels (pointer / persistent TMA) for every tile
            cfgs += [dataclasses.replace(c, tma=not c.tma, split_k=False) for c in cfgs]
    else:  # the interpreter is cheap per config: also the other table's tile shapes
        for other in (torch.float32, torch.bfloat16):
            cfgs += [c for c in gemm_config.all_configs(other) if c not in cfgs]
    return cfgs


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_config_bitwise_equal(dtype):
    """The tuned table may pick any of its configs by M: all must give the same bits."""
    m, k, n = (130, 80, 72) if not ON_GPU else (1000, 1000, 777)
    a, b = _linear(m, k, n, dtype, seed=m)
    bias = _rand(n, dtype=dtype)
    cfgs = _configs_to_check(dtype)
    for rows in (1, 37, m):
        base = gemm_triton.det_gemm_with_config(a[:rows], b, bias, cfgs[0])
        for cfg in cfgs[1:]:
            out = gemm_triton.det_gemm_with_config(a[:rows], b, bias, cfg)
            assert_bitwise(out, base, f"{dtype} {rows}x{k}x{n}: {cfg} vs {cfgs[0]}")
        if rows == m:  # row-major b (not the nn.Linear layout) too
            bc = b.contiguous()
            for cfg in cfgs:
                out = gemm_triton.det_gemm_with_config(a, bc, bias, cfg)
                assert_bitwise(out, base, f"{dtype} row-major b: {cfg}")


def _plans(dtype):
    """Every shipped config with both plans (split over K chunks / one program per tile) and,
    on the GPU in 16-bit, both kernels (pointer / persistent TMA)."""
    out = []
    for c in _configs_to_check(dtype):
        for v in (
            c,
            dataclasses.replace(c, split_k=not c.split_k, tma=False),
            dataclasses.replace(c, split_k=False, tma=False, flat_k=not c.flat_k),
            # the persistent TMA kernel over (chunk, tile) items (pointer split where TMA
            # cannot run: CPU, fp32)
            dataclasses.replace(c, split_k=True, tma=True, flat_k=False),
        ):
            if v not in out:
                out.append(v)
    return out


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_k_chunks_every_plan_bitwise_and_chunk_order(dtype):
    """Many K chunks: every config and plan gives the same bits, and (fp32, where the output
    is not rounded) the result is exactly the chunk partials added in chunk order."""
    if ON_GPU:
        kc, (m, k, n) = gemm_config.K_CHUNK, (200, 3 * gemm_config.K_CHUNK + 300, 136)
    else:  # the interpreter's K step is 16: a small chunk exercises the same code
        kc, (m, k, n) = 32, (40, 150, 24)
    a, b = _linear(m, k, n, dtype, seed=k)
    bias = _rand(n, dtype=dtype)
    plans = _plans(dtype)
    for rows in (1, 33, m):
        base = gemm_triton.det_gemm_with_config(a[:rows], b, bias, plans[0], k_chunk=kc)
        for cfg in plans[1:]:
            out = gemm_triton.det_gemm_with_config(a[:rows], b, bias, cfg, k_chunk=kc)
            assert_bitwise(out, base, f"{dtype} {rows}x{k}x{n} chunk {kc}: {cfg}")
    rtol, atol = tolerance(dtype, k=k)
    assert_close(base, a.double() @ b.double() + bias.double(), rtol=rtol, atol=atol, what="kc")
    if dtype == torch.float32:
        total = None
        for k0 in range(0, k, kc):
            p = gemm_triton.det_gemm_with_config(
                a[:, k0 : k0 + kc], b[k0 : k0 + kc], None, plans[0], k_chunk=kc
            )
            total = p if total is None else total + p
        assert_bitwise(base, total + bias, "chunk partials added in chunk order, then bias")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_many_chunks(dtype):
    """K > K_CHUNK: small M runs the split plan, large M one program per tile; rows agree."""
    a, b = _linear(300, gemm_config.K_CHUNK + 80, 24 if not ON_GPU else 200, dtype, seed=7)
    bias = _rand(b.shape[1], dtype=dtype)
    counts = sorted(set(_THRESHOLDS) | {1, 17, 31, 33, 199, 300})
    if not ON_GPU:  # the interpreter: each plan boundary from both sides (m, m + 1) is enough
        counts = [1, 16, 17, 64, 65, 128, 129, 256, 257, 300]
    check_row_invariance(
        lambda t: det_gemm(t, b, bias, backend="triton"), a, counts=counts, what="kc fwd"
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance(dtype):
    a, b = _linear(300, 96, 40, dtype, seed=3)
    bias = _rand(40, dtype=dtype)
    counts = sorted(set(_THRESHOLDS) | {1, 17, 31, 33, 199, 300})
    check_row_invariance(
        lambda t: det_gemm(t, b, bias, backend="triton"), a, counts=counts, what="triton fwd"
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_45x200x72(dtype):
    """Rows 0..15 of a 45x200 @ 200x72 product alone == inside the 45 (the interpreter's fp32 dot
    once came from the host's BLAS and differed here by 5.7e-6 on an AMD EPYC)."""
    a, b = _linear(45, 200, 72, dtype, seed=11)
    assert_bitwise(
        det_gemm(a[:16], b, backend="triton"),
        det_gemm(a, b, backend="triton")[:16],
        "rows 0..15 of 45",
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_column_invariance_and_fusion(dtype):
    a, b = _linear(37, 64, 200, dtype, seed=5)
    full = det_gemm(a, b, backend="triton")
    for j0, j1 in [(0, 1), (3, 50), (50, 200), (199, 200), (64, 192)]:
        assert_bitwise(
            det_gemm(a, b[:, j0:j1], backend="triton"), full[:, j0:j1], f"cols {j0}:{j1}"
        )
    w = b.t()
    fused = det_gemm(a, torch.cat([w[:120], w[120:]]).t(), backend="triton")
    assert_bitwise(fused[:, 120:], det_gemm(a, w[120:].t(), backend="triton"), "fused vs split")


@needs_triton
def test_strided_layouts():
    dtype = torch.float32 if not ON_GPU else torch.bfloat16
    a, b = _linear(64, 80, 48, dtype, seed=9)
    ref = det_gemm(a.contiguous(), b.contiguous(), backend="triton")
    a_nc = torch.empty(64, 160, dtype=dtype, device=DEVICE)[:, ::2]
    a_nc.copy_(a)
    a_t = a.t().contiguous().t()  # column-major a
    for aa in (a, a_nc, a_t):
        for bb in (b, b.contiguous(), b.t().contiguous().t()):
            assert_bitwise(det_gemm(aa, bb, backend="triton"), ref, "layout")
    # a strided bias (every other element of a buffer) and a misaligned a (data not 16-byte
    # aligned: other kernel specializations and plans)
    bias = torch.randn(96, dtype=dtype).to(DEVICE)
    want = det_gemm(a, b, bias[::2].contiguous(), backend="triton")
    assert_bitwise(det_gemm(a, b, bias[::2], backend="triton"), want, "strided bias")
    a_off = torch.empty(64 * 80 + 1, dtype=dtype, device=DEVICE)[1:].view(64, 80)
    a_off.copy_(a)
    assert_bitwise(det_gemm(a_off, b, backend="triton"), ref, "misaligned a")


@needs_triton
def test_empty_and_k0():
    dtype = torch.float32
    bias = _rand(5, dtype=dtype)
    assert det_gemm(_rand(0, 8, dtype=dtype), _rand(8, 5, dtype=dtype), backend="triton").shape == (
        0,
        5,
    )
    out = det_gemm(_rand(3, 0, dtype=dtype), _rand(0, 5, dtype=dtype), bias, backend="triton")
    assert_bitwise(out, bias.expand(3, 5).contiguous(), "K=0 gives bias")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_and_wgrad_plans(dtype):
    # more than one WGRAD_CHUNK of tokens; the last padding starts a chunk of zeros
    t, k, n = gemm_config.WGRAD_CHUNK + 204, 40, 24
    g = torch.Generator().manual_seed(11)
    a = _rand(t, k, dtype=dtype, gen=g)
    gr = _rand(t, n, dtype=dtype, gen=g)
    x = gemm_triton.det_gemm_wgrad_with_plan(a, gr, split=False)
    y = gemm_triton.det_gemm_wgrad_with_plan(a, gr, split=True)
    assert_bitwise(x, y, "wgrad: split plan vs one program per tile")
    assert_bitwise(gemm_triton.det_gemm_wgrad(a, gr), x, "wgrad run-to-run")
    for pad in (1, 100, gemm_config.WGRAD_CHUNK):
        ap = torch.cat([a, a.new_zeros(pad, k)])
        gp = torch.cat([gr, gr.new_zeros(pad, n)])
        for split in (False, True):
            got = gemm_triton.det_gemm_wgrad_with_plan(ap, gp, split=split)
            assert_bitwise(got, x, f"wgrad with {pad} zero rows (split={split})")
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(x, a.double().t() @ gr.double(), rtol=rtol, atol=atol * 4, what="wgrad")
    # through autograd: dX row invariant, dW / dbias deterministic
    w = _rand(n, k, dtype=dtype, gen=g).requires_grad_(True)
    bias = _rand(n, dtype=dtype, gen=g).requires_grad_(True)

    def grads(rows):
        xi = a[:rows].clone().requires_grad_(True)
        w.grad = bias.grad = None
        det_gemm(xi, w.t(), bias, backend="triton").backward(gr[:rows])
        return xi.grad, w.grad.clone(), bias.grad.clone()

    t_ag = 700  # autograd: fewer rows (interpreter time)
    dx, dw, db = grads(t_ag)
    dx2, dw2, db2 = grads(t_ag)
    for p, q, name in [(dx, dx2, "dx"), (dw, dw2, "dw"), (db, db2, "dbias")]:
        assert_bitwise(p, q, f"{name} run-to-run")
    for rows in (1, 17, 256, 257, 513):
        assert_bitwise(grads(rows)[0], dx[:rows], f"dX first {rows} rows")
    assert_close(
        dw, gr[:t_ag].double().t() @ a[:t_ag].double(), rtol=rtol, atol=atol * 4, what="dW"
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_out_and_accumulate(dtype, monkeypatch):
    """``out=`` / ``accumulate=True``: calls over consecutive chunk-aligned token ranges give the
    bits of one call over all tokens, on every plan; a 16-bit ``out`` is the fp32 sum rounded
    once."""
    chunk = 64 if ON_GPU else 16  # a multiple of every plan's token step
    monkeypatch.setattr(gemm_triton, "WGRAD_CHUNK", chunk)
    t, k, n = 5 * chunk + 7, 40, 24
    g = torch.Generator().manual_seed(5)
    a = _rand(t, k, dtype=dtype, gen=g)
    gr = _rand(t, n, dtype=dtype, gen=g)
    whole = gemm_triton.det_gemm_wgrad_with_plan(a, gr, split=False, tma=False)
    plans = [dict(split=False, tma=False), dict(split=True, tma=False)]
    if ON_GPU and dtype != torch.float32:
        plans.append(dict(split=None, tma=True))
    for plan in plans:
        assert_bitwise(gemm_triton.det_gemm_wgrad_with_plan(a, gr, **plan), whole, f"{plan}")
        for cuts in ((chunk,), (2 * chunk,), (chunk, 3 * chunk), (chunk, 2 * chunk, 4 * chunk)):
            out = torch.full((k, n), float("nan"), device=DEVICE)  # written, not read, first
            bounds = (0, *cuts, t)
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                gemm_triton.det_gemm_wgrad_with_plan(
                    a[lo:hi], gr[lo:hi], out=out, accumulate=i > 0, **plan
                )
            assert_bitwise(out, whole, f"accumulated over {bounds} ({plan})")
        if dtype != torch.float32:
            o16 = torch.empty((k, n), dtype=dtype, device=DEVICE)
            gemm_triton.det_gemm_wgrad_with_plan(a, gr, out=o16, **plan)
            assert_bitwise(o16, whole.to(dtype), f"{dtype} out ({plan})")
    # chunk= names the chunk whatever WGRAD_CHUNK is
    monkeypatch.setattr(gemm_triton, "WGRAD_CHUNK", 2 * chunk)
    assert_bitwise(gemm_triton.det_gemm_wgrad(a, gr, chunk=chunk), whole, "chunk= argument")
    with pytest.raises(ValueError, match="multiple of the token step"):
        gemm_triton.det_gemm_wgrad(a, gr, chunk=chunk + 1)
    monkeypatch.setattr(gemm_triton, "WGRAD_CHUNK", chunk)
    # the negative control: a multi-chunk partial added afterwards is another association
    naive = gemm_triton.det_gemm_wgrad(a[:chunk], gr[:chunk])
    naive += gemm_triton.det_gemm_wgrad(a[chunk:], gr[chunk:])
    assert not torch.equal(naive, whole), "p0 + (p1 + ... + p5) should differ somewhere"


@needs_triton
def test_wgrad_out_errors():
    a, gr = _rand(8, 4, dtype=torch.float32), _rand(8, 3, dtype=torch.float32)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="needs out"):
        gemm_triton.det_gemm_wgrad(a, gr, accumulate=True)
    with pytest.raises(ValueError, match="shape"):
        gemm_triton.det_gemm_wgrad(a, gr, out=torch.zeros(3, 4, **f32))
    with pytest.raises(ValueError, match="contiguous"):
        gemm_triton.det_gemm_wgrad(a, gr, out=torch.zeros(3, 4, **f32).t())
    with pytest.raises(TypeError, match="fp32 or a.dtype"):
        gemm_triton.det_gemm_wgrad(a, gr, out=torch.zeros(4, 3, dtype=torch.float16, device=DEVICE))
    a16, gr16 = a.half(), gr.half()
    with pytest.raises(TypeError, match="accumulate=True needs an fp32 out"):
        out = torch.zeros(4, 3, dtype=torch.float16, device=DEVICE)
        gemm_triton.det_gemm_wgrad(a16, gr16, out=out, accumulate=True)
    # no tokens: out is zeroed, or kept when accumulating
    out = torch.ones(4, 3, **f32)
    gemm_triton.det_gemm_wgrad(a[:0], gr[:0], out=out, accumulate=True)
    assert_bitwise(out, torch.ones(4, 3, **f32), "accumulate over no tokens")
    gemm_triton.det_gemm_wgrad(a[:0], gr[:0], out=out)
    assert_bitwise(out, torch.zeros(4, 3, **f32), "no tokens")


@needs_triton
@pytest.mark.parametrize("with_bias", [False, True])
def test_eager_path_equals_custom_ops(with_bias):
    """Eager calls run the provider under a plain autograd function (or directly, without a
    graph to record); compiled graphs run the custom ops. Forward and every gradient: equal
    bits."""
    g = torch.Generator().manual_seed(3)
    a = _rand(37, 72, dtype=torch.float32, gen=g)
    w = _rand(24, 72, dtype=torch.float32, gen=g)
    bias = _rand(24, dtype=torch.float32, gen=g) if with_bias else None
    gy = _rand(37, 24, dtype=torch.float32, gen=g)

    def run(eager):
        al, wl = a.clone().requires_grad_(), w.clone().requires_grad_()
        bl = bias.clone().requires_grad_() if bias is not None else None
        y = (
            det_gemm(al, wl.t(), bl, backend="triton")
            if eager
            else torch.ops.rl_engine.det_gemm(al, wl.t(), bl, "triton")
        )
        leaves = [al, wl] + ([bl] if bl is not None else [])
        return [y.detach(), *torch.autograd.grad(y, leaves, gy)]

    want = run(False)
    for got, exp in zip(run(True), want, strict=True):
        assert_bitwise(got, exp, "eager path vs custom ops")
    with torch.no_grad():  # no graph: the provider is called directly
        assert_bitwise(det_gemm(a, w.t(), bias, backend="triton"), want[0], "no_grad")


@needs_triton
def test_opcheck():
    a, b, bias = _rand(5, 16, dtype=torch.float32), _rand(16, 8, dtype=torch.float32), None
    torch.library.opcheck(torch.ops.rl_engine.det_gemm.default, (a, b, bias, "triton"))
    torch.library.opcheck(
        torch.ops.rl_engine.det_gemm_wgrad.default,
        (a, _rand(5, 8, dtype=torch.float32), "triton"),
    )


# --------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_every_m_up_to_2048(dtype):
    """Bitwise: rows of every launch size 1..2048 equal the same rows inside a 16384-row launch
    (which uses the largest config), also at shifted row positions."""
    k, n = 512, 392
    a, b = _linear(16384, k, n, dtype, seed=21)
    bias = _rand(n, dtype=dtype)
    full = det_gemm(a, b, bias, backend="triton")
    assert_bitwise(det_gemm(a, b, bias, backend="triton"), full, "run-to-run")
    bad = []
    for m in range(1, 2049):
        if not torch.equal(det_gemm(a[:m], b, bias, backend="triton"), full[:m]):
            bad.append(m)
    assert not bad, f"{dtype}: rows differ for M in {bad[:20]} ({len(bad)} sizes)"
    gen = torch.Generator().manual_seed(0)
    for m in [2049, 3000, 4095, 4096, 4097, 8191, 8192, 12345, 16383]:
        s = int(torch.randint(0, 16384 - m + 1, (1,), generator=gen))
        got = det_gemm(a[s : s + m], b, bias, backend="triton")
        assert_bitwise(got, full[s : s + m], f"{dtype}: M={m} at row {s}")
    for m in range(1, 300, 7):
        s = int(torch.randint(0, 16384 - m + 1, (1,), generator=gen))
        got = det_gemm(a[s : s + m], b, bias, backend="triton")
        assert_bitwise(got, full[s : s + m], f"{dtype}: M={m} at row {s}")


@gpu
def test_gpu_real_shapes_row_and_column_invariance():
    dtype = torch.bfloat16
    for k, n in [(4096, 6144), (2048, 151936)]:
        a, b = _linear(1024, k, n, dtype, seed=n)
        full = det_gemm(a, b, backend="triton")
        for m in (1, 7, 16, 64, 129, 513):
            assert_bitwise(det_gemm(a[:m], b, backend="triton"), full[:m], f"{k}x{n} M={m}")
        for j0, j1 in [(0, 4096), (4096, 5120), (1000, 1001), (n - 96, n)]:
            got = det_gemm(a[:33], b[:, j0:j1], backend="triton")
            assert_bitwise(got, full[:33, j0:j1], f"{k}x{n} cols {j0}:{j1}")


@gpu
def test_gpu_int64_offsets():
    """``a`` with more than 2**31 elements: offsets need int64."""
    k = 4096
    m = (2**31) // k + 130
    a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    a.normal_()
    b = _linear(1, k, 64, torch.bfloat16, seed=1)[1]
    out = det_gemm(a, b, backend="triton")
    tail = det_gemm(a[-200:].clone(), b, backend="triton")
    assert_bitwise(out[-200:], tail, "rows past 2**31 elements")
    ref = a[-200:].float() @ b.float()
    assert_close(out[-200:], ref, rtol=2e-2, atol=2e-2, what="int64 tail numerics")
    del a, out


@gpu
def test_gpu_compile_and_cuda_graph():
    dtype = torch.bfloat16
    a, b = _linear(300, 256, 200, dtype, seed=2)
    bias = _rand(200, dtype=dtype)
    eager = det_gemm(a, b, bias, backend="triton")
    f = torch.compile(lambda x, y, z: det_gemm(x, y, z, backend="triton"), fullgraph=True)
    assert_bitwise(f(a, b, bias), eager, "torch.compile vs eager")
    assert_bitwise(f(a[:17], b, bias), eager[:17], "torch.compile M=17")
    # CUDA graph capture + replay with new inputs copied in
    static_a = a.clone()
    det_gemm(static_a, b, bias, backend="triton")  # warm up (compile) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = det_gemm(static_a, b, bias, backend="triton")
    a2 = _linear(300, 256, 200, dtype, seed=4)[0]
    static_a.copy_(a2)
    graph.replay()
    assert_bitwise(static_out, det_gemm(a2, b, bias, backend="triton"), "graph replay")
    # backward under compile: deterministic
    w = b.t().clone().requires_grad_(True)

    def loss(x):
        return det_gemm(x, w.t(), backend="triton").float().square().sum()

    grads = []
    for _ in range(2):
        w.grad = None
        torch.compile(loss)(a).backward()
        grads.append(w.grad.clone())
    assert_bitwise(grads[0], grads[1], "compiled backward dW run-to-run")


def _compiled_kernels(fn) -> int:
    """Kernels Triton has compiled (or loaded) for ``fn`` in this process, every device."""
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel caches to count")
    return sum(len(entry[0]) for entry in caches.values())


@gpu
def test_gpu_new_row_counts_compile_nothing():
    """A new row count inside one config bucket reuses the compiled kernel. The persistent TMA
    kernel once took its program count (min(SMs, tiles)) as a constexpr: every new small M
    compiled a kernel, ~2 s inside a vLLM prefill step (found by bench_rollout --step-times)."""
    dtype = torch.bfloat16
    k, n = 2048, 2048
    rows = [528, 560, 592, 624, 656, 688, 720]  # multiples of 16: one specialization of M
    cfgs = {gemm_config.get_config(m, n, k, dtype) for m in rows}
    assert len(cfgs) == 1, "the rows must share a config bucket"
    b = _rand(k, n, dtype=dtype, scale=k**-0.5)
    det_gemm(_rand(rows[0], k, dtype=dtype), b, backend="triton")
    torch.cuda.synchronize()
    kernels = (gemm_triton._det_gemm_tma_kernel, gemm_triton._det_gemm_fwd_kernel)
    before = [_compiled_kernels(f) for f in kernels]
    outs = [det_gemm(_rand(m, k, dtype=dtype), b, backend="triton") for m in rows[1:]]
    torch.cuda.synchronize()
    assert [_compiled_kernels(f) for f in kernels] == before, [o.shape for o in outs]


@gpu
def test_gpu_errors_on_cuda_tensors():
    """CUDA inputs take the short validity check; what it rejects still raises the full
    checks' errors."""
    a = torch.randn(3, 4, device="cuda")
    cases = [
        ((a, torch.randn(5, 6, device="cuda")), ValueError, "cannot be multiplied"),
        ((a, torch.randn(4, 6, device="cuda").double()), TypeError, "dtype"),
        ((a.double(), torch.randn(4, 6, device="cuda").double()), TypeError, "not supported"),
        ((a, torch.randn(4, 6, device="cuda"), torch.randn(5, device="cuda")), ValueError, "bias"),
        ((a, torch.randn(4, 6, device="cuda"), torch.randn(6)), ValueError, "device"),
        ((a, torch.randn(4, 6)), ValueError, "device"),
        ((a[None], torch.randn(4, 6, device="cuda")), ValueError, "dims"),
        ((a, [[1.0] * 6] * 4), TypeError, "Tensor"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            gemm_triton.det_gemm(*args)


@gpu
def test_gpu_device_guard():
    """Runs on the tensors' device whatever the current device is."""
    a, b = _linear(33, 64, 48, torch.bfloat16)
    with torch.cuda.device(torch.cuda.device_count() - 1):
        out = det_gemm(a, b, backend="triton")
    assert_bitwise(out, det_gemm(a, b, backend="triton"), "device guard")
