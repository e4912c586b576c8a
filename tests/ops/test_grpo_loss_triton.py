"""Triton provider of grpo_loss: loss, metrics and d logp vs the native reference, determinism,
padding / row invariance (incl. several T tiles and sequence blocks), registry, errors.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16 inputs) and
skip otherwise; on a CUDA device they run on the GPU (fp32 / bf16 / fp16) with the native
reference evaluated on the CPU. ``tests/ops/test_grpo_loss.py`` also parametrises over this
provider when it can run.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import grpo_loss
from rl_engine.ops.grpo_loss import AGG_MODES
from rl_engine.ops.grpo_loss import triton as gl_triton
from rl_engine.ops.ratio_kl import triton as rk_triton
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import DEVICE, TRITON_DTYPES, gpu, skip_unless_triton, triton_runnable
from tests.ops import grpo_loss_checks as checks
from tests.ops.grpo_loss_checks import FULL, data, run

RUNNABLE = triton_runnable(gl_triton)
needs_triton = skip_unless_triton(gl_triton)
DTYPES = TRITON_DTYPES
_T_MULTI = gl_triton.BLOCK_T + 45  # two T tiles


def _data(b, t, dtype=torch.float32, *, seed=0, scale=0.5):
    return data(b, t, dtype, seed=seed, scale=scale, device=DEVICE)


def _cpu(v):
    return v.cpu() if isinstance(v, torch.Tensor) else v


def _both(lp, old, adv, mask, **kw):
    """(triton on DEVICE, native on the CPU)."""
    tri = run(lp, old, adv, mask, "triton", **kw)
    nat = run(
        lp.cpu(), old.cpu(), _cpu(adv), _cpu(mask), "native", **{k: _cpu(v) for k, v in kw.items()}
    )
    return tri, nat


def _compare(tri, nat, dtype, what):
    (out, grad), (ref, rgrad) = tri, nat
    rtol, atol = FP32_OUT  # fp32 math on inputs exact in fp32, fixed-order fp32 sums
    assert (
        out.loss.dtype == torch.float32 and out.loss.shape == () and out.loss.device.type == DEVICE
    )
    assert_close(out.loss, ref.loss, rtol=rtol, atol=atol, what=f"{what} loss")
    for name, a, b in zip(out.metrics._fields, out.metrics, ref.metrics):
        assert_close(a, b, rtol=rtol, atol=atol, what=f"{what} {name}")
    assert grad.dtype == dtype
    # one rounding of fp32 math to logp.dtype; atol relative to the largest gradient element
    grtol, gatol = FP32_OUT if dtype == torch.float32 else tolerance(dtype)
    scale = rgrad.abs().max().item()
    assert_close(grad, rgrad, rtol=grtol, atol=gatol * scale, what=f"{what} d logp")


# --------------------------------------------------------------------- registry / errors
def test_availability_and_registration():
    reason = gl_triton.PROVIDER.why_not("cpu", triton_interpret=False)
    assert reason is not None and "TRITON_INTERPRET=1" in reason
    p = KernelRegistry.provider("grpo_loss", "triton")
    assert p.invariant and p.numerics == "grpo_loss/triton" and "backward" in p.extras
    assert KernelRegistry.providers("grpo_loss", "cuda")[0].name == "triton"
    assert KernelRegistry.providers("grpo_loss", "cpu")[0].name == "native"


def test_unavailable_backend_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    x = torch.randn(2, 3)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        grpo_loss(x, x, x, None, backend="triton")
    opts = (0.2, 0.2, 0.0, "token", "token-mean", 0.0, 0.0, 20.0)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"grpo_loss\[triton\].*TRITON_INTERPRET"):
        gl_triton.grpo_loss(x, x, x, m, None, None, *opts)


def test_errors_direct_call():
    x = torch.randn(3, 4)
    m = torch.ones(3, 4, dtype=torch.bool)
    opts = (0.2, 0.2, 0.0, "token", "token-mean", 0.0, 0.0, 20.0)
    with pytest.raises(ValueError, match="old_logp has shape"):
        gl_triton.grpo_loss(x, torch.randn(3, 5), x, m, None, None, *opts)
    with pytest.raises(ValueError, match="device"):
        gl_triton.grpo_loss(x, torch.randn(3, 4, device="meta"), x, m, None, None, *opts)
    with pytest.raises(TypeError, match="not supported"):
        gl_triton.grpo_loss(x.double(), x.double(), x, m, None, None, *opts)
    with pytest.raises(ValueError, match="loss_agg"):
        gl_triton.grpo_loss(x, x, x, m, None, None, *opts[:4], "sum", *opts[5:])
    with pytest.raises(ValueError, match="needs ref_logp"):
        gl_triton.grpo_loss(x, x, x, m, None, None, *opts[:6], 0.1, 20.0)


# --------------------------------------------------------------------- numerics vs native
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", AGG_MODES)
def test_vs_native_all_options(dtype, ratio_type, loss_agg):
    lp, old, ref, adv, w, mask = _data(17, 31, dtype)
    kw = dict(FULL, ratio_type=ratio_type, loss_agg=loss_agg, ref_logp=ref, rollout_is_weights=w)
    tri, nat = _both(lp, old, adv, mask, **kw)
    _compare(tri, nat, dtype, f"{ratio_type} {loss_agg} {dtype}")
    m = tri[0].metrics
    if ratio_type == "token":  # the data exercise every branch
        assert m.clip_frac_low > 0 and m.clip_frac_high > 0 and m.dual_clip_frac > 0
    else:
        assert 0 < m.clip_frac < 1


@needs_triton
@pytest.mark.parametrize("loss_agg", AGG_MODES)
@pytest.mark.parametrize(
    "kw",
    [
        {},  # plain GRPO / PPO
        {"clip_low": 0.1, "clip_high": 0.4, "loss_norm": 123.0},
        {"dual_clip": 1.5, "log_ratio_clamp": 0.6},  # clamp active: the gradient stops there
        {"ratio_type": "sequence", "clip_low": 3e-2, "clip_high": 4e-2},
    ],
)
def test_vs_native_variants_multi_tile(loss_agg, kw):
    """Per-token advantages, several T tiles (the sequential tile loop), no mask on 2 rows."""
    lp, old, ref, adv, w, mask = _data(5, _T_MULTI, seed=3)
    mask[3:] = True
    adv_tok = adv[:, None] + 0.1 * torch.randn(5, _T_MULTI, device=DEVICE)
    tri, nat = _both(lp, old, adv_tok, mask, loss_agg=loss_agg, ref_logp=ref, **kw)
    _compare(tri, nat, torch.float32, f"{kw} {loss_agg}")


@needs_triton
def test_defaults_without_mask_and_options():
    lp, old, ref, adv, w, mask = _data(9, 23)
    tri, nat = _both(lp, old, adv, None)
    _compare(tri, nat, torch.float32, "defaults, mask None")
    on, gon = run(lp, lp, adv, mask, "triton", loss_agg="seq-mean-token-sum", loss_norm=8.0)
    a = torch.where(mask, adv[:, None].expand(9, 23), torch.zeros((), device=DEVICE))
    assert_bitwise(gon, -a / 8.0, "on-policy gradient")
    assert on.metrics.clip_frac == 0 and on.metrics.ratio_min == 1 and on.metrics.ratio_max == 1
    kl0, _ = run(lp, old, adv, mask, "triton", ref_logp=ref)
    assert_bitwise(kl0.loss, kl0.metrics.pg_loss, "kl_beta=0: loss == pg_loss")
    kl1, _ = run(lp, old, adv, mask, "triton", ref_logp=ref, kl_beta=0.1)
    assert_bitwise(kl1.loss, kl1.metrics.pg_loss + 0.1 * kl1.metrics.kl_loss, "pg + beta * kl")


@needs_triton
def test_empty_inputs():
    z = torch.zeros(3, 5, device=DEVICE)
    none = torch.zeros(3, 5, dtype=torch.bool, device=DEVICE)
    out, grad = run(z, z, torch.ones(3, device=DEVICE), none, "triton")
    assert out.loss == 0 and (grad == 0).all() and out.metrics.ratio_max == 0
    e = torch.zeros(0, 4, device=DEVICE)
    out0, g0 = run(e, e, torch.zeros(0, device=DEVICE), None, "triton")
    assert out0.loss == 0 and g0.shape == (0, 4)
    e = torch.zeros(2, 0, device=DEVICE)
    out1, g1 = run(e, e, torch.zeros(2, device=DEVICE), None, "triton")
    assert out1.loss == 0 and out1.metrics.num_tokens == 0 and g1.shape == (2, 0)


# --------------------------------------------------------------------- determinism / invariance
@needs_triton
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", AGG_MODES)
def test_run_to_run_bitwise(ratio_type, loss_agg):
    lp, old, ref, adv, w, mask = _data(6, _T_MULTI, torch.float16)
    kw = dict(FULL, loss_agg=loss_agg, ratio_type=ratio_type, ref_logp=ref, rollout_is_weights=w)
    checks.check_run_to_run("triton", lp, old, adv, mask, **kw)


# (ratio_type, loss_agg, [B, T], [(rows, cols) appended]): rows cross the BLOCK_B boundary of
# the global reduction, columns cross the T tile boundary.
_PAD_CASES = [
    (rt, agg, shape, pads)
    for i, agg in enumerate(AGG_MODES)
    for rt in ("token", "sequence")
    for shape, pads in (
        ((gl_triton.BLOCK_B - 3, 19), [(1, 0), (7, 0), (40, 3)]),
        ((5, gl_triton.BLOCK_T - 9), [(0, 9), (0, 10), (2, 1200)]),
    )
    if (i + (rt == "sequence") + (shape[0] == 5)) % 2 == 0 or agg == "seq-mean-token-mean"
]


@needs_triton
@pytest.mark.parametrize("ratio_type, loss_agg, shape, pads", _PAD_CASES)
def test_masked_padding_invariance(ratio_type, loss_agg, shape, pads):
    """Fully-masked sequences and masked NaN tokens appended leave loss, metrics and d logp
    bitwise unchanged while the normaliser D is unchanged."""
    b, t = shape
    lp, old, ref, adv, w, mask = _data(b, t, seed=5)
    kw = dict(FULL, loss_agg=loss_agg, ratio_type=ratio_type)
    if loss_agg == "seq-mean-token-sum-norm":
        kw["loss_norm"] = float(t)  # its default D = T changes with the columns
    base, gbase = run(lp, old, adv, mask, "triton", ref_logp=ref, rollout_is_weights=w, **kw)
    tensors = (lp, old, ref, adv, w, mask)
    checks.check_masked_padding("triton", tensors, (base, gbase), pads, {}, **kw)


_ROW_CASES = [
    (dtype, rt, agg)
    for i, dtype in enumerate(DTYPES)
    for rt, agg in (
        ("token", "token-mean" if i % 2 == 0 else "seq-mean-token-mean"),
        ("sequence", "seq-mean-token-mean" if i % 2 == 0 else "token-mean"),
    )
]


@needs_triton
@pytest.mark.parametrize("dtype, ratio_type, loss_agg", _ROW_CASES)
def test_row_invariance_of_grad_with_fixed_norm(dtype, ratio_type, loss_agg):
    """With an explicit loss_norm, d logp of sequence b depends on sequence b only."""
    tensors = _data(37, 21, dtype, seed=11)
    kw = dict(loss_agg=loss_agg, ratio_type=ratio_type)
    what = f"d logp {loss_agg} {dtype}"
    checks.check_row_invariance_of_grad("triton", tensors, dtype, (1, 17, 31, 33, 37), what, **kw)


@needs_triton
def test_rows_per_program_changes_no_bits(monkeypatch):
    lp, old, ref, adv, w, mask = _data(9, _T_MULTI, seed=2)
    kw = dict(FULL, ratio_type="sequence", loss_agg="seq-mean-token-mean", ref_logp=ref)
    base, gbase = run(lp, old, adv, mask, "triton", **kw)
    for rows in (1, 4):
        monkeypatch.setattr(rk_triton, "rows_per_program", lambda device, r=rows: r)
        out, grad = run(lp, old, adv, mask, "triton", **kw)
        assert_bitwise(torch.stack(out.metrics), torch.stack(base.metrics), f"rows {rows}")
        assert_bitwise(out.loss, base.loss, f"loss rows {rows}")
        assert_bitwise(grad, gbase, f"d logp rows {rows}")


@needs_triton
def test_opcheck():
    checks.check_opcheck("triton", _data(5, 7))


# --------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_gpu_bf16_training_shape(ratio_type):
    """A realistic bf16 step (64 x 2048 tokens): vs native, padding rows, run-to-run."""
    lp, old, ref, adv, w, mask = _data(64, 2048, torch.bfloat16, seed=9)
    kw = dict(FULL, ratio_type=ratio_type, ref_logp=ref, loss_agg="token-mean")
    tri, nat = _both(lp, old, adv, mask, **kw)
    _compare(tri, nat, torch.bfloat16, f"gpu bf16 {ratio_type}")
    again = run(lp, old, adv, mask, "triton", **kw)
    assert_bitwise(again[1], tri[1], "run-to-run d logp")
    padded = run(
        checks.pad(lp, 3, 0, 0.0),
        checks.pad(old, 3, 0, 0.0),
        torch.cat([adv, torch.zeros(3, device=DEVICE)]),
        checks.pad(mask, 3, 0, False),
        "triton",
        **{**kw, "ref_logp": checks.pad(ref, 3, 0, 0.0)},
    )
    assert_bitwise(padded[0].loss, tri[0].loss, "padding rows: loss")
    assert_bitwise(padded[1][:64], tri[1], "padding rows: d logp")
