"""``grpo_loss``: PPO / GRPO / DAPO / GSPO / Dr. GRPO clipped policy loss, fixed-order reductions.

Custom ops: ``rl_engine::grpo_loss(logp, old_logp, advantages, mask, ref_logp, is_weights,
<options>, provider) -> (loss, metrics)`` and ``rl_engine::grpo_loss_backward(grad, ...) ->
d logp``. Options travel as floats / strings (``None`` becomes ``0.0`` for ``dual_clip`` and
``loss_norm``); the public :func:`grpo_loss` validates them, broadcasts per-sequence advantages /
IS weights over T (:func:`rl_engine.ops.grpo_loss.args.normalize`, the checks every provider
runs too) and builds the :class:`GRPOLoss` / :class:`GRPOMetrics` named tuples.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.grpo_loss import reference
from rl_engine.ops.grpo_loss.args import (
    AGG_MODES,
    METRIC_NAMES,
    check,
    normalize,
)
from rl_engine.registry import resolve_provider

__all__ = ["AGG_MODES", "GRPOLoss", "GRPOMetrics", "grpo_loss"]


class GRPOMetrics(NamedTuple):
    """Detached fp32 scalars; token means are over real tokens (``/ max(N, 1)``).

    Attributes:
        pg_loss: the aggregated policy-gradient term (``loss`` without the KL term).
        kl_loss: the aggregated k3 KL penalty vs ``ref_logp`` (before ``kl_beta``; 0 without it).
        clip_frac: fraction of tokens where the clipped branch is taken (``pg2 > pg1``).
        clip_frac_low: ... of them with ratio < 1 (negative advantage, ratio < 1 - clip_low).
        clip_frac_high: ... of them with ratio > 1 (positive advantage, ratio > 1 + clip_high).
        dual_clip_frac: fraction of tokens where the dual clip bounds the loss.
        ppo_kl: mean of ``-log_ratio`` (k1 of KL(old || new); verl's ``ppo_kl``).
        approx_kl: mean of k3 ``ratio - 1 - log_ratio`` (token log-ratios).
        approx_kl_k2: mean of ``0.5 * log_ratio**2``.
        ratio_mean, ratio_min, ratio_max: stats of the ratio the loss used (the sequence ratio
            for GSPO); min / max are 0 when there is no real token.
        num_tokens: N, real tokens.  num_seqs: B', sequences with at least one real token.
    """

    pg_loss: torch.Tensor
    kl_loss: torch.Tensor
    clip_frac: torch.Tensor
    clip_frac_low: torch.Tensor
    clip_frac_high: torch.Tensor
    dual_clip_frac: torch.Tensor
    ppo_kl: torch.Tensor
    approx_kl: torch.Tensor
    approx_kl_k2: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    num_tokens: torch.Tensor
    num_seqs: torch.Tensor


assert GRPOMetrics._fields == METRIC_NAMES


class GRPOLoss(NamedTuple):
    """``(loss, metrics)``: fp32 scalar loss (differentiable wrt ``logp``) and its metrics."""

    loss: torch.Tensor
    metrics: GRPOMetrics


def _grpo_loss_fake(logp, old_logp, advantages, mask, ref_logp, is_weights, *opts):
    check((logp, old_logp, advantages, mask, ref_logp, is_weights), opts)
    return (
        logp.new_empty((), dtype=torch.float32),
        logp.new_empty((len(METRIC_NAMES),), dtype=torch.float32),
    )


def _grpo_loss_backward_fake(grad, logp, *rest):
    return torch.empty_like(logp)


_grpo_loss_op = provider_op("grpo_loss", "grpo_loss", reference.grpo_loss, _grpo_loss_fake)
_grpo_loss_backward_op = provider_op(
    "grpo_loss",
    "grpo_loss_backward",
    reference.grpo_loss_backward,
    _grpo_loss_backward_fake,
    "backward",
)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.options = inputs[6:]  # clip_low ... log_ratio_clamp, provider
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _grad_metrics):
    if not ctx.needs_input_grad[0]:
        return (None,) * 15
    d_logp = _grpo_loss_backward_op(grad, *ctx.saved_tensors, *ctx.options)
    return (d_logp,) + (None,) * 14


_grpo_loss_op.register_autograd(_backward, setup_context=_setup_context)


def _run(logp: Any, old_logp: Any, advantages: Any, mask: Any, *rest: Any) -> GRPOLoss:
    """The op on :func:`grpo_loss`'s arguments, in its order, the provider last (normalised by
    :func:`rl_engine.ops.grpo_loss.args.normalize`)."""
    *options, ref_logp, is_weights, log_ratio_clamp, provider = rest
    tensors, opts = normalize(
        (logp, old_logp, advantages, mask, ref_logp, is_weights), (*options, log_ratio_clamp)
    )
    loss, metrics = _grpo_loss_op(*tensors, *opts, provider)
    return GRPOLoss(loss, GRPOMetrics(*metrics.unbind(0)))


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_type: str = "token",
    loss_agg: str = "token-mean",
    loss_norm: float | None = None,
    kl_beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    backend: str | None = None,
) -> GRPOLoss:
    """Clipped policy-gradient loss (PPO / GRPO family) with deterministic fixed-order reductions.

    See :mod:`rl_engine.ops.grpo_loss.reference` for the exact math.

    Args:
        logp: [B, T] log-probs of the current policy (fp32 / bf16 / fp16); the only input that
            receives a gradient.
        old_logp: [B, T] log-probs the ratio is taken against (behaviour / old policy).
        advantages: [B, T] per-token or [B] per-sequence advantages.
        mask: [B, T] response mask (bool, or numbers 0 / 1: 1 = real token; other values are refused); None = all real.
        clip_low: the ratio is clipped below at ``1 - clip_low`` (0 <= clip_low < 1).
        clip_high: ... and above at ``1 + clip_high`` (DAPO clip-higher: clip_high > clip_low).
        dual_clip: None, or c > 1: for negative advantages the loss is at most ``-A * c``.
        ratio_type: ``"token"`` (PPO / GRPO) or ``"sequence"`` (GSPO-token: the ratio is
            ``exp(mean log-ratio of the sequence)`` with the stop-gradient trick).
        loss_agg: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"`` or
            ``"seq-mean-token-sum-norm"`` (Dr. GRPO: sum / constant).
        loss_norm: the aggregation denominator D instead of the mode's default (token count,
            non-empty sequence count, or T for seq-mean-token-sum-norm). Pass the global
            count (across micro-batches / data-parallel ranks) to make per-row gradients
            independent of the other rows.
        kl_beta: weight of the k3 KL penalty ``exp(ref - logp) - (ref - logp) - 1``.
        ref_logp: [B, T] reference-policy log-probs (needed when ``kl_beta > 0``; with
            ``kl_beta == 0`` it only feeds the ``kl_loss`` metric).
        rollout_is_weights: [B, T] or [B] IS weights multiplying the policy-gradient term
            (e.g. ``ratio_kl(old_logp, rollout_logp, ...).token_weight``).
        log_ratio_clamp: C > 0; log-ratios are clamped to [-C, C] before ``exp``.
        backend: provider name; None = the registry's choice.

    Returns:
        :class:`GRPOLoss` ``(loss, metrics)``: fp32 scalar loss and :class:`GRPOMetrics`.

    Raises:
        ValueError / TypeError: bad shapes, dtypes, devices or options; a gradient requested
            for an input other than ``logp``.
    """
    check_tensor("logp", logp)
    provider = resolve_provider("grpo_loss", logp.device.type, backend)
    return _run(
        logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, ratio_type, loss_agg,
        loss_norm, kl_beta, ref_logp, rollout_is_weights, log_ratio_clamp, provider,
    )  # fmt: skip


register_op(
    "grpo_loss",
    entry=registry_entry(grpo_loss, _run),
    native=("grpo_loss/native", reference),
    extras=("backward",),
)

# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
