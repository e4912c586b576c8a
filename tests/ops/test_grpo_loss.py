"""grpo_loss: numerics vs float64 (loss, metrics, d logp), determinism, padding / row invariance,
GSPO gradient identity, errors, opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.ops import grpo_loss
from rl_engine.ops.grpo_loss import AGG_MODES
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import backend_fixture
from tests.ops import grpo_loss_checks as checks
from tests.ops.grpo_loss_checks import FULL, data, run

DTYPES = [torch.float32, torch.bfloat16]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("grpo_loss", device="cpu")


def _ref64(
    lp,
    old,
    adv,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    ratio_type="token",
    loss_agg="token-mean",
    loss_norm=None,
    kl_beta=0.0,
    ref_logp=None,
    rollout_is_weights=None,
    log_ratio_clamp=20.0,
):
    """The formulas of docs/operators/grpo_loss.md in float64 with torch autograd."""
    c = log_ratio_clamp
    x = lp.detach().double().requires_grad_(True)
    keep = mask.bool()
    m = keep.double()
    z = torch.zeros((), dtype=torch.float64)
    lpz = torch.where(keep, x, z)
    raw = lpz - torch.where(keep, old.double(), z)
    a = adv.double()
    a = torch.where(keep, a[:, None].expand_as(raw) if a.dim() == 1 else a, z)
    n = m.sum(-1)
    tok_lr = raw.clamp(-c, c)
    if ratio_type == "token":
        logr = tok_lr
    else:  # GSPO-token: value of the sequence mean, gradient 1 wrt each token's logp
        s = raw.sum(-1) / n.clamp(min=1)
        logr = (lpz - lpz.detach() + s.detach()[:, None]).clamp(-c, c)
    r = torch.exp(logr)
    pg1 = -a * r
    pg2 = -a * r.clamp(1 - clip_low, 1 + clip_high)
    clipped = pg2 > pg1
    pg = torch.maximum(pg1, pg2)
    dual = torch.zeros_like(keep)
    if dual_clip is not None:
        pg3 = -a * dual_clip
        dual = (a < 0) & (pg > pg3)
        pg = torch.where(dual, pg3, pg)
    if rollout_is_weights is not None:
        w = rollout_is_weights.double()
        pg = pg * torch.where(keep, w[:, None].expand_as(raw) if w.dim() == 1 else w, z)
    nseq = (n > 0).double().sum()
    ntok = n.sum()

    def agg(v):
        s = (v * m).sum(-1)
        if loss_agg == "token-mean":
            return s.sum() / (loss_norm or ntok.clamp(min=1))
        if loss_agg == "seq-mean-token-mean":
            return (s / n.clamp(min=1)).sum() / (loss_norm or nseq.clamp(min=1))
        if loss_agg == "seq-mean-token-sum":
            return s.sum() / (loss_norm or nseq.clamp(min=1))
        return s.sum() / (loss_norm or raw.shape[1])

    pg_loss = agg(pg)
    kl_loss = torch.zeros((), dtype=torch.float64)
    if ref_logp is not None:
        d = (torch.where(keep, ref_logp.double(), z) - lpz).clamp(-c, c)
        kl_loss = agg(torch.exp(d) - d - 1)
    loss = pg_loss + kl_beta * kl_loss
    (grad,) = torch.autograd.grad(loss, x)

    def tmean(v):
        return (v.double() * m).sum() / ntok.clamp(min=1)

    rr = r.detach()
    metrics = dict(
        pg_loss=pg_loss,
        kl_loss=kl_loss,
        clip_frac=tmean(clipped),
        clip_frac_low=tmean(clipped & (rr < 1)),
        clip_frac_high=tmean(clipped & (rr > 1)),
        dual_clip_frac=tmean(dual),
        ppo_kl=tmean(-tok_lr),
        approx_kl=tmean(torch.expm1(tok_lr) - tok_lr),
        approx_kl_k2=tmean(0.5 * tok_lr**2),
        ratio_mean=tmean(rr),
        ratio_min=rr[keep].min() if keep.any() else z,
        ratio_max=rr[keep].max() if keep.any() else z,
        num_tokens=ntok,
        num_seqs=nseq,
    )
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grad


def _compare(out, grad, ref, dtype, what):
    loss, metrics, rgrad = ref
    rtol, atol = FP32_OUT  # inputs exact in fp32; fp32 math and fixed-order fp32 sums
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert_close(out.loss, loss, rtol=rtol, atol=atol, what=f"{what} loss")
    for name, v in metrics.items():
        assert_close(getattr(out.metrics, name), v, rtol=rtol, atol=atol, what=f"{what} {name}")
    assert grad.dtype == dtype
    # the gradient is fp32 math rounded once to logp.dtype; its scale is 1 / D, so atol is
    # taken relative to the largest gradient element
    grtol, gatol = FP32_OUT if dtype == torch.float32 else tolerance(dtype)
    scale = rgrad.abs().max().item()
    assert_close(grad, rgrad, rtol=grtol, atol=gatol * scale, what=f"{what} d logp")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", AGG_MODES)
def test_vs_float64_all_options(backend, dtype, ratio_type, loss_agg):
    lp, old, ref, adv, w, mask = data(17, 31, dtype)
    kw = dict(FULL, ratio_type=ratio_type, loss_agg=loss_agg, ref_logp=ref, rollout_is_weights=w)
    out, grad = run(lp, old, adv, mask, backend, **kw)
    _compare(out, grad, _ref64(lp, old, adv, mask, **kw), dtype, f"{ratio_type} {loss_agg}")
    if ratio_type == "token":  # the data exercise every branch
        assert out.metrics.clip_frac_low > 0 and out.metrics.clip_frac_high > 0
        assert out.metrics.dual_clip_frac > 0
    else:
        assert 0 < out.metrics.clip_frac < 1


@pytest.mark.parametrize("loss_agg", AGG_MODES)
@pytest.mark.parametrize(
    "kw",
    [
        {},  # plain GRPO / PPO, symmetric clip
        {"clip_low": 0.1, "clip_high": 0.4, "loss_norm": 123.0},
        {"dual_clip": 1.5, "log_ratio_clamp": 0.6},  # clamp active: gradient stops there
        {"ratio_type": "sequence", "clip_low": 3e-2, "clip_high": 4e-2},  # GSPO-like ranges
    ],
)
def test_vs_float64_variants(backend, loss_agg, kw):
    lp, old, ref, adv, w, mask = data(33, 29, seed=3)
    adv_tok = adv[:, None] + 0.1 * torch.randn(33, 29)  # per-token advantages
    out, grad = run(lp, old, adv_tok, mask, backend, loss_agg=loss_agg, **kw)
    ref_out = _ref64(lp, old, adv_tok, mask, loss_agg=loss_agg, **kw)
    _compare(out, grad, ref_out, torch.float32, f"{kw} {loss_agg}")


def test_gspo_gradient_equals_sequence_objective(backend):
    """GSPO-token with seq-mean-token-mean has the gradient of GSPO's sequence objective
    mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t log-ratio)."""
    lp, old, _, adv, _, mask = data(19, 23, seed=7)
    kw = dict(ratio_type="sequence", loss_agg="seq-mean-token-mean", clip_low=0.05, clip_high=0.08)
    out, grad = run(lp, old, adv, mask, backend, **kw)
    x = lp.double().requires_grad_(True)
    m = mask.double()
    n = m.sum(-1)
    s = torch.exp(((x - old.double()) * m).sum(-1) / n.clamp(min=1))
    a = adv.double()
    obj = torch.maximum(-a * s, -a * s.clamp(1 - 0.05, 1 + 0.08))
    loss = (obj * (n > 0)).sum() / (n > 0).sum()
    (g64,) = torch.autograd.grad(loss, x)
    assert_close(out.loss, loss, rtol=FP32_OUT[0], atol=FP32_OUT[1], what="GSPO loss")
    assert_close(grad, g64, rtol=FP32_OUT[0], atol=FP32_OUT[1] * g64.abs().max(), what="GSPO grad")
    assert out.metrics.clip_frac > 0


def test_on_policy_semantics(backend):
    """old == logp: ratio 1, nothing clipped, loss = -AGG(A), d logp = -A * c."""
    lp, _, _, adv, _, mask = data(8, 13)
    out, grad = run(lp, lp, adv, mask, backend, loss_agg="seq-mean-token-sum", loss_norm=8.0)
    a = torch.where(mask, adv[:, None].expand(8, 13), torch.zeros(()))
    assert_bitwise(grad, -a / 8.0, "on-policy gradient")
    assert out.metrics.clip_frac == 0 and out.metrics.ratio_min == 1 and out.metrics.ratio_max == 1
    assert out.metrics.ppo_kl == 0 and out.metrics.approx_kl == 0


def test_kl_beta_zero_and_metric_consistency(backend):
    lp, old, ref, adv, _, mask = data(17, 31)
    out, _ = run(lp, old, adv, mask, backend, kl_beta=0.0, ref_logp=ref, clip_high=0.28)
    assert_bitwise(out.loss, out.metrics.pg_loss, "kl_beta=0: loss == pg_loss")
    assert out.metrics.kl_loss > 0  # still reported
    m = out.metrics
    assert abs(m.clip_frac - m.clip_frac_low - m.clip_frac_high) < 1e-6
    assert m.num_tokens == mask.sum() and m.num_seqs == (mask.any(1)).sum()
    with_kl, _ = run(lp, old, adv, mask, backend, kl_beta=0.1, ref_logp=ref, clip_high=0.28)
    assert_bitwise(with_kl.loss, m.pg_loss + 0.1 * m.kl_loss, "loss = pg + beta * kl")


@pytest.mark.parametrize("loss_agg", AGG_MODES)
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_run_to_run_bitwise(backend, loss_agg, ratio_type):
    lp, old, ref, adv, w, mask = data(31, 47, torch.bfloat16)
    kw = dict(FULL, loss_agg=loss_agg, ratio_type=ratio_type, ref_logp=ref, rollout_is_weights=w)
    checks.check_run_to_run(backend, lp, old, adv, mask, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", AGG_MODES)
def test_masked_padding_invariance(backend, dtype, ratio_type, loss_agg):
    """Fully-masked sequences appended at the end and masked tokens appended to every row (with
    NaN values) leave loss, metrics and d logp of the real tokens bitwise unchanged whenever the
    normaliser D is unchanged (seq-mean-token-sum-norm's default D = T changes with the columns,
    so padding columns are tested there with an explicit loss_norm)."""
    lp, old, ref, adv, w, mask = data(17, 31, dtype)
    kw = dict(FULL, loss_agg=loss_agg, ratio_type=ratio_type)
    base, gbase = run(lp, old, adv, mask, backend, ref_logp=ref, rollout_is_weights=w, **kw)
    norm_kw = {"loss_norm": 31.0} if loss_agg == "seq-mean-token-sum-norm" else {}
    if norm_kw:
        b2, g2 = run(
            lp, old, adv, mask, backend, ref_logp=ref, rollout_is_weights=w, **kw, **norm_kw
        )
        assert_bitwise(b2.loss, base.loss, "explicit loss_norm = T")
    pads = [(1, 0), (15, 0), (0, 1), (0, 33), (4, 6)]
    tensors = (lp, old, ref, adv, w, mask)
    checks.check_masked_padding(backend, tensors, (base, gbase), pads, norm_kw, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", AGG_MODES)
def test_row_invariance_of_grad_with_fixed_norm(backend, dtype, ratio_type, loss_agg):
    """With an explicit loss_norm, d logp of sequence b depends on sequence b only."""
    tensors = data(199, 21, dtype, seed=11)
    kw = dict(loss_agg=loss_agg, ratio_type=ratio_type)
    checks.check_row_invariance_of_grad(
        backend, tensors, dtype, (1, 17, 31, 33, 199), f"d logp {loss_agg}", **kw
    )


def test_empty_batch(backend):
    lp = torch.zeros(3, 5)
    out, grad = run(lp, lp, torch.ones(3), torch.zeros(3, 5, dtype=torch.bool), backend)
    assert out.loss == 0 and (grad == 0).all() and out.metrics.ratio_max == 0
    out0, _ = run(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0), None, backend)
    assert out0.loss == 0


def test_compile_matches_eager(backend):
    lp, old, ref, adv, w, mask = data(9, 11)

    def f(x, y, a, m):
        return grpo_loss(x, y, a, m, clip_high=0.28, dual_clip=3.0, backend=backend).loss

    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    cf = torch.compile(f, fullgraph=True, backend="eager")
    assert_bitwise(cf(lp, old, adv, mask), f(lp, old, adv, mask), "compile vs eager")


def test_opcheck():
    x, old, a, mask = checks.check_opcheck("native", data(5, 7))
    opts_s = (0.2, 0.2, 0.0, "sequence", "token-mean", 10.0, 0.0, 20.0, "native")
    torch.library.opcheck(
        torch.ops.rl_engine.grpo_loss.default, (x, old, a, mask, None, None, *opts_s)
    )


_X = torch.randn(3, 4)
_M = torch.ones(3, 4, dtype=torch.bool)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((_X, torch.randn(3, 5), _X, _M), {}, ValueError, "old_logp has shape"),
        ((_X, _X, torch.randn(4), _M), {}, ValueError, "advantages has shape"),
        ((_X, _X, torch.randn(3, 4, 1), _M), {}, ValueError, "dims"),
        ((_X, _X, _X, torch.ones(3, 5)), {}, ValueError, "mask has shape"),
        ((_X, _X, _X, _M), {"ref_logp": torch.randn(2, 4)}, ValueError, "ref_logp has shape"),
        ((_X, _X, _X, _M), {"rollout_is_weights": torch.randn(5)}, ValueError, "rollout_is"),
        ((_X.double(), _X.double(), _X, _M), {}, TypeError, "not supported"),
        ((_X, _X, _X.long(), _M), {}, TypeError, "not supported"),
        ((_X[0], _X[0], _X[0], _M[0]), {}, ValueError, "dims"),
        ((_X, torch.randn(3, 4, device="meta"), _X, _M), {}, ValueError, "device"),
        ((_X, _X, _X, _M), {"loss_agg": "seq-sum"}, ValueError, "loss_agg"),
        ((_X, _X, _X, _M), {"ratio_type": "seq"}, ValueError, "ratio_type"),
        ((_X, _X, _X, _M), {"clip_low": 1.0}, ValueError, "clip_low"),
        ((_X, _X, _X, _M), {"clip_low": -0.1}, ValueError, "clip_low"),
        ((_X, _X, _X, _M), {"clip_high": math.inf}, ValueError, "clip_high"),
        ((_X, _X, _X, _M), {"dual_clip": 1.0}, ValueError, "dual_clip"),
        ((_X, _X, _X, _M), {"dual_clip": 0.0}, ValueError, "dual_clip"),
        ((_X, _X, _X, _M), {"loss_norm": 0.0}, ValueError, "loss_norm"),
        ((_X, _X, _X, _M), {"loss_norm": -2.0}, ValueError, "loss_norm"),
        ((_X, _X, _X, _M), {"kl_beta": 0.1}, ValueError, "needs ref_logp"),
        ((_X, _X, _X, _M), {"kl_beta": -0.1, "ref_logp": _X}, ValueError, "kl_beta"),
        ((_X, _X, _X, _M), {"log_ratio_clamp": 0.0}, ValueError, "log_ratio_clamp"),
        ((_X, _X.clone().requires_grad_(True), _X, _M), {}, ValueError, "old_logp requires grad"),
    ],
)
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        grpo_loss(*args, backend="native", **kwargs)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((4,), r"shape \(4,\); expected \[B\] or \[B, T\]"),  # [T] for [B] (B != T)
        ((2,), r"shape \(2,\); expected \[B\]"),
        ((3, 1), r"rollout_is_weights has shape \(3, 1\), logp \(3, 4\)"),  # no broadcasting
        ((1, 4), r"rollout_is_weights has shape \(1, 4\), logp \(3, 4\)"),
        ((4, 3), r"rollout_is_weights has shape \(4, 3\)"),  # transposed
        ((3, 4, 1), "rollout_is_weights must have 1 or 2 dims"),
        ((), "rollout_is_weights must have 1 or 2 dims"),
    ],
)
def test_is_weights_of_the_wrong_shape_refused(backend, shape, match):
    """``rollout_is_weights`` is [B] or [B, T] exactly; any other shape is refused at the public
    entry with its shape and logp's, on every provider (nothing broadcast). (A [T] tensor when
    B == T reads as [B]: the one shape no check can tell apart.)"""
    with pytest.raises(ValueError, match=match):
        grpo_loss(_X, _X, _X, _M, rollout_is_weights=torch.ones(shape), backend=backend)
    grpo_loss(_X, _X, _X, _M, rollout_is_weights=torch.ones(3), backend=backend)  # [B] runs


def test_numeric_mask_must_be_zero_or_one():
    lp, old, adv = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2)
    mask = torch.ones(2, 5, dtype=torch.int64)
    ref, _ = grpo_loss(lp, old, adv, mask.bool())
    got, _ = grpo_loss(lp, old, adv, mask)
    assert_bitwise(got, ref, "0/1 integer mask")
    mask[0, 0] = -1
    with pytest.raises(ValueError, match="0 or 1.*-1"):
        grpo_loss(lp, old, adv, mask)
