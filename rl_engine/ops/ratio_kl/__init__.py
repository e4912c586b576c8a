"""``ratio_kl``: importance ratios, k1/k2/k3 KL estimators, truncated and masked IS weights.

Custom ops: ``rl_engine::ratio_kl(logp, old_logp, mask, <options as floats>, provider)`` (eleven
outputs, see :func:`rl_engine.ops.ratio_kl.reference.ratio_kl`) and
``rl_engine::ratio_kl_backward(...)`` (its gradients). The public :func:`ratio_kl` validates the
options, turns ``None`` into the neutral values of the schema (caps ``inf``, masked-IS ranges
``[0, inf]``; :func:`rl_engine.ops.ratio_kl.args.normalize`, the checks every provider runs too)
and returns a :class:`RatioKL` named tuple.
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
from rl_engine.ops.ratio_kl import reference
from rl_engine.ops.ratio_kl.args import check, normalize
from rl_engine.registry import resolve_provider

__all__ = ["RatioKL", "ratio_kl"]


class RatioKL(NamedTuple):
    """Outputs of :func:`ratio_kl` (all fp32 unless noted; B sequences, T tokens).

    Attributes:
        log_ratio: [B, T] ``clamp(logp - old_logp, -C, C)``, 0 at masked tokens.
        ratio: [B, T] ``exp(log_ratio)``, 1 at masked tokens.
        k1: [B, T] ``-log_ratio``.
        k2: [B, T] ``0.5 * log_ratio**2``.
        k3: [B, T] ``ratio - 1 - log_ratio``.
        token_weight: [B, T] truncated, masked token IS weight (0 where not kept); detached.
        token_keep: [B, T] bool, real token whose ratio is inside the token masked-IS range.
        seq_log_ratio: [B] clamped sum (or mean) of ``log_ratio`` over the sequence.
        seq_ratio: [B] ``exp(seq_log_ratio)``.
        seq_weight: [B] truncated, masked sequence IS weight (0 where not kept); detached.
        seq_keep: [B] bool, sequence ratio inside the sequence masked-IS range.
    """

    log_ratio: torch.Tensor
    ratio: torch.Tensor
    k1: torch.Tensor
    k2: torch.Tensor
    k3: torch.Tensor
    token_weight: torch.Tensor
    token_keep: torch.Tensor
    seq_log_ratio: torch.Tensor
    seq_ratio: torch.Tensor
    seq_weight: torch.Tensor
    seq_keep: torch.Tensor


_Out = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]


def _ratio_kl_fake(
    logp, old_logp, mask, log_ratio_clamp, token_cap, seq_cap, tlo, thi, slo, shi, geo
):
    check(logp, old_logp, mask, (log_ratio_clamp, token_cap, seq_cap, tlo, thi, slo, shi))
    b, t = logp.shape
    tok = [logp.new_empty((b, t), dtype=torch.float32) for _ in range(6)]
    seq = [logp.new_empty((b,), dtype=torch.float32) for _ in range(3)]
    tok_keep = logp.new_empty((b, t), dtype=torch.bool)
    seq_keep = logp.new_empty((b,), dtype=torch.bool)
    return (*tok, tok_keep, *seq, seq_keep)


_ratio_kl_op = provider_op(
    "ratio_kl", "ratio_kl", reference.ratio_kl, fake=_ratio_kl_fake,
    returns="(" + ", ".join(["Tensor"] * 11) + ")",
)  # fmt: skip


def _ratio_kl_backward_fake(
    g1, g2, g3, g4, g5, g6, g7, logp, old_logp, mask, log_ratio_clamp, geometric
):
    return torch.empty_like(logp), torch.empty_like(old_logp)


_ratio_kl_backward_op = provider_op(
    "ratio_kl",
    "ratio_kl_backward",
    reference.ratio_kl_backward,
    _ratio_kl_backward_fake,
    "backward",
)


def _setup_context(ctx, inputs, output):
    logp, old_logp, mask, clamp = inputs[:4]
    geometric, provider = inputs[10], inputs[11]
    ctx.save_for_backward(logp, old_logp, mask)
    ctx.clamp = clamp
    ctx.geometric = geometric
    ctx.provider = provider
    ctx.mark_non_differentiable(output[5], output[6], output[9], output[10])


def _backward(ctx, *grads):
    logp, old_logp, mask = ctx.saved_tensors
    b, t = logp.shape

    def g(i: int, shape: tuple[int, ...]) -> torch.Tensor:
        gi = grads[i]
        return gi if gi is not None else logp.new_zeros(shape, dtype=torch.float32)

    d_logp, d_old = _ratio_kl_backward_op(
        g(0, (b, t)),
        g(1, (b, t)),
        g(2, (b, t)),
        g(3, (b, t)),
        g(4, (b, t)),
        g(7, (b,)),
        g(8, (b,)),
        logp,
        old_logp,
        mask,
        ctx.clamp,
        ctx.geometric,
        ctx.provider,
    )
    return (
        d_logp if ctx.needs_input_grad[0] else None,
        d_old if ctx.needs_input_grad[1] else None,
        *([None] * 10),
    )


_ratio_kl_op.register_autograd(_backward, setup_context=_setup_context)


def _run(logp: Any, old_logp: Any, mask: Any, *options: Any) -> RatioKL:
    """The op on :func:`ratio_kl`'s arguments, in its order, the provider last (the options as
    :func:`rl_engine.ops.ratio_kl.args.normalize` takes them)."""
    *public, provider = options
    mask, opts = normalize(logp, old_logp, mask, tuple(public))
    return RatioKL(*_ratio_kl_op(logp, old_logp, mask, *opts, provider))


def ratio_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    log_ratio_clamp: float = 20.0,
    token_is_cap: float | None = None,
    seq_is_cap: float | None = None,
    token_mis: tuple[float, float] | None = None,
    seq_mis: tuple[float, float] | None = None,
    seq_mode: str = "sum",
    backend: str | None = None,
) -> RatioKL:
    """Importance ratio ``p / q``, KL(q || p) estimators and IS weights of sampled tokens.

    Tokens were sampled from q (``old_logp``, e.g. the rollout engine's log-probs); p is the
    policy of ``logp`` (e.g. the trainer's). For the usual KL penalty against a reference model,
    ``ratio_kl(ref_logp, logp).k3`` is ``exp(ref - logp) - (ref - logp) - 1``.
    See :mod:`rl_engine.ops.ratio_kl.reference` for the exact math.

    Args:
        logp: [B, T] fp32 / bf16 / fp16 log-probs of p.
        old_logp: [B, T] fp32 / bf16 / fp16 log-probs of q.
        mask: optional [B, T] (bool, or numbers 0 / 1: 1 = real token; other values are refused); None = all real.
        log_ratio_clamp: C > 0; every log-ratio is clamped to [-C, C] before ``exp``.
        token_is_cap: cap of the truncated token IS weight ``min(ratio, cap)``; None = no cap.
        seq_is_cap: cap of the truncated sequence IS weight; None = no cap.
        token_mis: (low, high): tokens whose ratio is outside get weight 0 and keep False.
        seq_mis: (low, high): the same for the sequence ratio.
        seq_mode: ``"sum"`` (sequence ratio = product of token ratios) or ``"mean"`` (geometric
            mean of the token ratios, as GSPO).
        backend: provider name; None = the registry's choice.

    Returns:
        A :class:`RatioKL`. Gradients flow to ``logp`` and ``old_logp`` from ``log_ratio``,
        ``ratio``, ``k1``-``k3``, ``seq_log_ratio`` and ``seq_ratio``; weights are detached.
    """
    check_tensor("logp", logp)
    provider = resolve_provider("ratio_kl", logp.device.type, backend)
    public = (log_ratio_clamp, token_is_cap, seq_is_cap, token_mis, seq_mis, seq_mode)
    return _run(logp, old_logp, mask, *public, provider)


register_op(
    "ratio_kl",
    entry=registry_entry(ratio_kl, _run),
    native=("ratio_kl/native", reference),
    extras=("backward",),
)

# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
