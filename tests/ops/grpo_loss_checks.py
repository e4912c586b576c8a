"""Data and checks shared by the grpo_loss suites: ``tests/ops/test_grpo_loss.py`` (every provider
the registry lists for the CPU) and ``tests/ops/test_grpo_loss_triton.py`` (the Triton provider,
on the GPU or in the interpreter). Each check takes the provider name and the tensors, so a suite
keeps its own shapes, device and cases."""

from __future__ import annotations

import math

import torch

from rl_engine.ops import grpo_loss
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance

# every option on: DAPO clip-higher, dual clip, k3 KL penalty (rollout IS weights added by the
# tests)
FULL = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_beta=0.05)


def data(b, t, dtype=torch.float32, *, seed=0, scale=0.5, device="cpu"):
    """``[lp, old, ref, adv, w, mask]`` on ``device``: [B, T] log-probs in ``dtype``, [B]
    advantages, [B, T] fp32 IS weights and a bool mask with an empty sequence (row 1)."""
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, t, generator=g) * 0.5 - 1.5).to(dtype)
    off = torch.randn(b, 1, generator=g) * 0.3  # per-sequence shift: GSPO ratios vary too
    old = (lp.float() + off + torch.randn(b, t, generator=g) * scale).to(dtype)
    ref = (lp.float() + torch.randn(b, t, generator=g) * 0.2).to(dtype)
    adv = torch.randn(b, generator=g)
    w = torch.rand(b, t, generator=g) * 1.5
    mask = torch.rand(b, t, generator=g) > 0.2
    if b > 1:
        mask[1, :] = False  # an empty sequence in the middle
    return [x.to(device) for x in (lp, old, ref, adv, w, mask)]


def run(lp, old, adv, mask, backend, **kw):
    """``(grpo_loss output, d logp of its loss)``."""
    x = lp.clone().requires_grad_(True)
    out = grpo_loss(x, old, adv, mask, backend=backend, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad


def check_run_to_run(backend, lp, old, adv, mask, **kw):
    """Loss, metrics and d logp bitwise equal over two runs."""
    o1, g1 = run(lp, old, adv, mask, backend, **kw)
    o2, g2 = run(lp, old, adv, mask, backend, **kw)
    assert_bitwise(o1.loss, o2.loss, "loss")
    assert_bitwise(torch.stack(o1.metrics), torch.stack(o2.metrics), "metrics")
    assert_bitwise(g1, g2, "d logp")


def pad(x, rows, cols, value):
    """``x`` [B, T] with ``cols`` columns and then ``rows`` rows of ``value`` appended."""
    x = torch.cat([x, torch.full((x.shape[0], cols), value, dtype=x.dtype, device=x.device)], 1)
    return torch.cat([x, torch.full((rows, x.shape[1]), value, dtype=x.dtype, device=x.device)])


def check_masked_padding(backend, tensors, base, pads, col_kw, **kw):
    """For each ``(rows, cols)`` of ``pads``: fully-masked sequences and masked NaN tokens
    appended to ``tensors`` (``lp, old, ref, adv, w, mask``) leave loss, metrics and d logp
    bitwise those of ``base`` (the unpadded run's ``(out, grad)``); ``col_kw`` is added where
    columns are appended."""
    lp, old, ref, adv, w, mask = tensors
    b, t = lp.shape
    base, gbase = base
    for rows, cols in pads:
        extra = col_kw if cols else {}
        nan = math.nan
        out, grad = run(
            pad(lp, rows, cols, nan),
            pad(old, rows, cols, nan),
            torch.cat([adv, torch.full((rows,), nan, device=adv.device)]),
            pad(mask, rows, cols, False),
            backend,
            ref_logp=pad(ref, rows, cols, nan),
            rollout_is_weights=pad(w, rows, cols, nan),
            **kw,
            **extra,
        )
        what = f"+{rows} rows +{cols} cols"
        assert_bitwise(out.loss, base.loss, f"loss {what}")
        assert_bitwise(torch.stack(out.metrics), torch.stack(base.metrics), f"metrics {what}")
        assert_bitwise(grad[:b, :t], gbase, f"d logp {what}")
        assert (grad[b:] == 0).all() and (grad[:, t:] == 0).all()


def check_row_invariance_of_grad(backend, tensors, dtype, counts, what, **kw):
    """With an explicit loss_norm, d logp of sequence b depends on sequence b only (``tensors``:
    ``lp, old, ref, adv, w, mask``; ``kw``: the options besides the fixed norm)."""
    lp, old, ref, adv, w, mask = tensors
    b, t = lp.shape
    x = torch.stack(
        [lp.float(), old.float(), adv[:, None].expand(b, t), mask.float(), ref.float(), w],
        dim=1,
    )

    def f(t):
        _, grad = run(
            t[:, 0].to(dtype),
            t[:, 1].to(dtype),
            t[:, 2],
            t[:, 3],
            backend,
            ref_logp=t[:, 4].to(dtype),
            rollout_is_weights=t[:, 5],
            loss_norm=1000.0,
            **kw,
            **FULL,
        )
        return grad

    check_row_invariance(f, x, counts=counts, what=what)


def check_opcheck(provider, tensors):
    """``torch.library.opcheck`` of the forward and backward custom ops through ``provider``
    with dual clip, KL, IS weights and seq-mean-token-mean on (``tensors``: ``lp, old, ref, adv,
    w, mask``); returns ``(logp that requires grad, old, [B, T] advantages, mask)`` for more
    forward checks."""
    lp, old, ref, adv, w, mask = tensors
    a = adv[:, None].expand(lp.shape).contiguous()
    x = lp.clone().requires_grad_(True)
    opts = (0.2, 0.28, 3.0, "token", "seq-mean-token-mean", 0.0, 0.1, 20.0, provider)
    torch.library.opcheck(torch.ops.rl_engine.grpo_loss.default, (x, old, a, mask, ref, w, *opts))
    torch.library.opcheck(
        torch.ops.rl_engine.grpo_loss_backward.default,
        (torch.tensor(1.0, device=lp.device), lp, old, a, mask, ref, w, *opts),
    )
    return x, old, a, mask
