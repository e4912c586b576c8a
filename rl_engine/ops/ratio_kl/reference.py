"""PyTorch reference of ``ratio_kl`` (the ``native`` provider): the spec of the op.

Tokens were sampled from a policy ``q`` (log-probs ``old_logp``); ``p`` is the policy whose
log-probs are ``logp``. Per token ``t`` of sequence ``b`` with mask ``m`` (padding has ``m = 0``)::

    raw       = m * (logp - old_logp)                  (fp32; masked tokens read as 0)
    log_ratio = clamp(raw, -C, C)                      (C = log_ratio_clamp)
    ratio     = exp(log_ratio)                         (= p / q)
    k1 = -log_ratio;  k2 = 0.5 * log_ratio**2;  k3 = ratio - 1 - log_ratio
                                                       (estimators of KL(q || p), samples ~ q)
    token_keep   = m and (mis_lo <= ratio <= mis_hi)   (token-level masked IS)
    token_weight = token_keep ? min(ratio, token_cap) : 0        (truncated IS weight)

Per sequence ``b`` (sums over T are :func:`~rl_engine.ops._common.tree_sum`, a fixed order)::

    n             = tree_sum(m)
    seq_log_ratio = clamp(S, -C, C),  S = tree_sum(log_ratio)          (seq_mode "sum")
                                      S = tree_sum(log_ratio) / max(n, 1) (seq_mode "mean")
    seq_ratio     = exp(seq_log_ratio)
    seq_keep      = seq_mis_lo <= seq_ratio <= seq_mis_hi
    seq_weight    = seq_keep ? min(seq_ratio, seq_cap) : 0

Masked tokens give ``log_ratio = 0``, ``ratio = 1``, ``k* = 0``, weight 0, whatever their input
values (NaN / inf padding included). ``exp`` is :func:`rl_engine.ops._math.exp`; ``k2`` and
``k3`` are evaluated in float64 and rounded once (``k3`` is a small difference of large terms).
Everything is elementwise or a fixed-order reduction along T, so every output of sequence ``b`` is
a function of row ``b`` alone: the op is row invariant by construction, and appending masked
tokens at the end of the rows (right padding) only adds exact zeros to the sums.

Gradients (see :func:`ratio_kl_backward`) flow from ``log_ratio``, ``ratio``, ``k1``, ``k2``,
``k3``, ``seq_log_ratio`` and ``seq_ratio`` to ``logp`` (+) and ``old_logp`` (-); the clamp passes
the gradient where ``-C <= raw <= C`` (as ``torch.clamp``). The IS weights and keep masks are
constants (detached), as the truncated / masked IS corrections of RL trainers are.
"""

from __future__ import annotations

import torch

from rl_engine.ops import _math
from rl_engine.ops._common import tree_sum
from rl_engine.ops.ratio_kl.args import check

__all__ = ["ratio_kl", "ratio_kl_backward"]


def _mask_f32(logp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.ones(logp.shape, dtype=torch.float32, device=logp.device)
    return mask.to(torch.float32)


def masked_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor, clamp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_ratio, in_range)``: ``clamp(m * (logp - old_logp), -C, C)`` in fp32 and where the
    clamp passes the gradient. Masked tokens read as 0 (their inputs are never used)."""
    keep = m != 0
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    raw = torch.where(keep, logp.float() - old_logp.float(), zero)
    return raw.clamp(-clamp, clamp), (raw >= -clamp) & (raw <= clamp)


def _seq_log_ratio(
    lr: torch.Tensor, m: torch.Tensor, clamp: float, geometric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clamped seq log-ratio [B], in-range [B], token count [B]) in fp32."""
    n = tree_sum(m, dim=-1)
    s = tree_sum(lr, dim=-1)  # masked tokens hold exact zeros
    if geometric:
        s = s / n.clamp_min(1.0)
    return s.clamp(-clamp, clamp), (s >= -clamp) & (s <= clamp), n


def ratio_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor | None,
    log_ratio_clamp: float,
    token_cap: float,
    seq_cap: float,
    token_mis_lo: float,
    token_mis_hi: float,
    seq_mis_lo: float,
    seq_mis_hi: float,
    geometric: bool,
) -> tuple[torch.Tensor, ...]:
    """Importance ratios, KL estimators and truncated / masked IS weights (the spec; see module).

    Args:
        logp: [B, T] log-probs of the target policy p (fp32 / bf16 / fp16).
        old_logp: [B, T] log-probs of the sampling policy q (same choice of dtypes).
        mask: [B, T] bool (True = real token) or None (all real).
        log_ratio_clamp: C > 0; log-ratios are clamped to [-C, C] before ``exp``.
        token_cap: truncation cap of ``token_weight`` (``inf`` = none).
        seq_cap: truncation cap of ``seq_weight`` (``inf`` = none).
        token_mis_lo, token_mis_hi: token-level masked-IS range (``0, inf`` = none).
        seq_mis_lo, seq_mis_hi: sequence-level masked-IS range (``0, inf`` = none).
        geometric: False: the sequence log-ratio is the sum over tokens (ratio of the sequence
            probabilities); True: the mean (geometric mean of the token ratios).

    Returns:
        ``(log_ratio, ratio, k1, k2, k3, token_weight, token_keep, seq_log_ratio, seq_ratio,
        seq_weight, seq_keep)``: [B, T] fp32 x 6, [B, T] bool, [B] fp32 x 3, [B] bool.
    """
    lim = (log_ratio_clamp, token_cap, seq_cap, token_mis_lo, token_mis_hi, seq_mis_lo, seq_mis_hi)
    check(logp, old_logp, mask, lim)
    m = _mask_f32(logp, mask)
    keep = m != 0
    lr, _ = masked_log_ratio(logp, old_logp, m, log_ratio_clamp)
    lr64 = lr.double()
    r64 = _math.exp64(lr64)
    ratio = r64.float()
    k1 = -lr
    k2 = (0.5 * lr64 * lr64).float()
    k3 = ((r64 - 1.0) - lr64).float()
    token_keep = keep & (ratio >= token_mis_lo) & (ratio <= token_mis_hi)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    token_weight = torch.where(token_keep, ratio.clamp_max(token_cap), zero)
    seq_lr, _, _ = _seq_log_ratio(lr, m, log_ratio_clamp, geometric)
    seq_ratio = _math.exp(seq_lr)
    seq_keep = (seq_ratio >= seq_mis_lo) & (seq_ratio <= seq_mis_hi)
    seq_weight = torch.where(seq_keep, seq_ratio.clamp_max(seq_cap), zero)
    return (
        lr,
        ratio,
        k1,
        k2,
        k3,
        token_weight,
        token_keep,
        seq_lr,
        seq_ratio,
        seq_weight,
        seq_keep,
    )


def ratio_kl_backward(
    g_log_ratio: torch.Tensor,
    g_ratio: torch.Tensor,
    g_k1: torch.Tensor,
    g_k2: torch.Tensor,
    g_k3: torch.Tensor,
    g_seq_log_ratio: torch.Tensor,
    g_seq_ratio: torch.Tensor,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor | None,
    log_ratio_clamp: float,
    geometric: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(d logp, d old_logp)`` in the inputs' dtypes (``d old_logp = -d logp``).

    With ``lr`` the clamped log-ratio and ``r = exp(lr)``, per token (fp32)::

        g_lr  = g_log_ratio + g_ratio * r - g_k1 + g_k2 * lr + g_k3 * (r - 1)
        g_seq = (g_seq_log_ratio + g_seq_ratio * seq_ratio) * [seq in clamp range]
                (divided by max(n, 1) in geometric mode)
        d logp = m * [token in clamp range] * (g_lr + g_seq[b])

    Elementwise given the per-sequence ``g_seq``: row invariant.
    """
    m = _mask_f32(logp, mask)
    lr, inr = masked_log_ratio(logp, old_logp, m, log_ratio_clamp)
    lr64 = lr.double()
    r64 = _math.exp64(lr64)
    ratio = r64.float()
    rm1 = (r64 - 1.0).float()
    g = g_log_ratio.float() + g_ratio.float() * ratio - g_k1.float()
    g = g + g_k2.float() * lr + g_k3.float() * rm1
    seq_lr, seq_inr, n = _seq_log_ratio(lr, m, log_ratio_clamp, geometric)
    seq_ratio = _math.exp(seq_lr)
    g_seq = (g_seq_log_ratio.float() + g_seq_ratio.float() * seq_ratio) * seq_inr.float()
    if geometric:
        g_seq = g_seq / n.clamp_min(1.0)
    d = (g + g_seq[:, None]) * (inr.float() * m)
    return d.to(logp.dtype), (-d).to(old_logp.dtype)
