"""PyTorch reference of ``grpo_loss`` (the ``native`` provider): the spec of the op.

PPO / GRPO clipped surrogate with clip-higher, dual clip, GSPO sequence ratio, the usual loss
aggregations, a k3 KL penalty against a reference policy and rollout IS weights. Per token of
sequence ``b`` (m = mask, 1 for real tokens; masked tokens read every input as 0)::

    lr  = clamp(logp - old_logp, -C, C)                                 ratio_type "token"
    lr  = clamp(tree_sum(m * (logp - old_logp)) / max(n_b, 1), -C, C)   ratio_type "sequence"
          (GSPO-token: the value is the sequence's, the gradient wrt logp_t is that of
           logp_t - sg(logp_t) + sg(lr_b), i.e. d lr / d logp_t = 1)
    r   = exp(lr)
    pg1 = -A * r;  pg2 = -A * clamp(r, 1 - clip_low, 1 + clip_high)
    pg  = max(pg1, pg2)                     clipped  = pg2 > pg1
    if dual_clip c (c > 1) and A < 0:       dual     = pg > -A * c;  pg = dual ? -A * c : pg
    pg  = pg * w                            (w = rollout IS weight, 1 when not given)
    kl  = exp(d) - d - 1,  d = clamp(ref_logp - logp, -C, C)          (k3 of KL(pi || ref))

Aggregation ``AGG`` of a per-token quantity ``x`` (``S_b = tree_sum_t(m * x)``, ``n_b`` the
number of real tokens of sequence b, ``N = tree_sum_b(n_b)``, ``B' = #{b : n_b > 0}``; sums over
sequences are ``tree_sum`` over b, so the order is fixed)::

    token-mean               tree_sum_b(S_b) / D,          D = loss_norm or max(N, 1)
    seq-mean-token-mean      tree_sum_b(S_b / max(n_b, 1)) / D, D = loss_norm or max(B', 1)
    seq-mean-token-sum       tree_sum_b(S_b) / D,          D = loss_norm or max(B', 1)
    seq-mean-token-sum-norm  tree_sum_b(S_b) / D,          D = loss_norm or T  (Dr. GRPO)

    loss = AGG(pg) + kl_beta * AGG(kl)

Gradient wrt ``logp`` only (the other inputs are constants), per token::

    d loss / d logp = g * c_bt * ( [in clamp range] * (clipped or dual ? 0 : -A * r * w)
                                   + kl_beta * [d in range] * (1 - exp(d)) )

with ``c_bt = m / D`` (``m / max(n_b, 1) / D`` for seq-mean-token-mean). Metrics are token means
over real tokens (``/ max(N, 1)``) of fixed-order sums; ratio min / max are exact.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _math
from rl_engine.ops._common import signature_of, tree_sum
from rl_engine.ops.grpo_loss.args import AGG_MODES, METRIC_NAMES, Options, check, per_seq_mean

__all__ = ["AGG_MODES", "METRIC_NAMES", "grpo_loss", "grpo_loss_backward"]


class _Terms:
    """Per-token quantities shared by the forward and the backward (computed identically)."""

    def __init__(self, tensors: tuple[torch.Tensor | None, ...], o: Options) -> None:
        logp, old_logp, advantages, mask, ref_logp, is_weights = tensors
        c = o.log_ratio_clamp
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)
        self.m = mask.to(torch.float32)
        lp = torch.where(mask, logp.float(), zero)
        raw = torch.where(mask, logp.float() - old_logp.float(), zero)
        self.tok_lr = raw.clamp(-c, c)
        self.n = tree_sum(self.m, dim=-1)  # [B] exact counts (fp32, exact below 2**24)
        n1 = self.n.clamp_min(1.0)
        if o.ratio_type == "token":
            lr, inr = self.tok_lr, (raw >= -c) & (raw <= c)
        else:
            s = tree_sum(raw, dim=-1) / n1
            lr = s.clamp(-c, c)[:, None].expand_as(raw)
            inr = ((s >= -c) & (s <= c))[:, None].expand_as(raw)
        self.lr, self.inr = lr, inr
        self.r = _math.exp(lr)
        a = torch.where(mask, advantages.float(), zero)
        self.a = a
        pg1 = -a * self.r
        pg2 = -a * self.r.clamp(1.0 - o.clip_low, 1.0 + o.clip_high)
        self.clipped = pg2 > pg1
        pg = torch.where(self.clipped, pg2, pg1)
        if o.dual_clip != 0.0:
            pg3 = -a * o.dual_clip
            self.dual = (a < 0) & (pg > pg3)
            pg = torch.where(self.dual, pg3, pg)
        else:
            self.dual = torch.zeros_like(mask)
        # d pg / d lr (before the IS weight)
        dpg = torch.where(self.clipped | self.dual, zero, pg1) * inr.float()
        if is_weights is not None:
            w = torch.where(mask, is_weights.float(), zero)
            pg, dpg = pg * w, dpg * w
        self.pg, self.dpg = pg, dpg
        if ref_logp is not None:
            d_raw = torch.where(mask, ref_logp.float(), zero) - lp
            d = d_raw.clamp(-c, c).double()
            e = _math.exp64(d)
            self.kl = ((e - 1.0) - d).float()
            self.dkl = ((1.0 - e).float()) * ((d_raw >= -c) & (d_raw <= c)).float()
        else:
            self.kl = self.dkl = None
        # aggregation: per-token coefficient c_bt and the denominator D
        nseq = tree_sum((self.n > 0).float(), dim=-1)
        self.nseq = nseq
        self.ntok = tree_sum(self.n, dim=-1)
        if o.loss_agg == "token-mean":
            default = self.ntok.clamp_min(1.0)
        elif o.loss_agg == "seq-mean-token-sum-norm":
            default = torch.full((), float(raw.shape[1]), device=raw.device)
        else:
            default = nseq.clamp_min(1.0)
        self.denom = (
            default if o.loss_norm == 0.0 else torch.full((), o.loss_norm, device=raw.device)
        )
        self.per_seq_mean = per_seq_mean(o.loss_agg)
        self.n1 = n1

    def aggregate(self, x: torch.Tensor) -> torch.Tensor:
        s = tree_sum(x * self.m, dim=-1)  # [B]
        if self.per_seq_mean:
            s = s / self.n1
        return tree_sum(s, dim=-1) / self.denom

    def coef(self) -> torch.Tensor:
        if self.per_seq_mean:
            return (self.m / self.n1[:, None]) / self.denom
        return self.m / self.denom

    def token_mean(self, x: torch.Tensor) -> torch.Tensor:
        return tree_sum(tree_sum(x * self.m, dim=-1), dim=-1) / self.ntok.clamp_min(1.0)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float,
    ratio_type: str,
    loss_agg: str,
    loss_norm: float,
    kl_beta: float,
    log_ratio_clamp: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped policy-gradient loss and its metrics (the spec; see the module docstring).

    Args:
        logp: [B, T] current policy log-probs (fp32 / bf16 / fp16).
        old_logp: [B, T] log-probs of the policy that the ratio is taken against.
        advantages: [B, T] advantages (a per-sequence advantage broadcast over T).
        mask: [B, T] bool, True for real (response) tokens.
        ref_logp: [B, T] reference-policy log-probs, or None (no KL term).
        is_weights: [B, T] rollout IS weights multiplying the policy-gradient term, or None.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        dual_clip: c > 1 (dual-clip PPO for negative advantages) or 0.0 = off.
        ratio_type: ``"token"`` or ``"sequence"`` (GSPO).
        loss_agg: one of :data:`AGG_MODES`.
        loss_norm: D of the aggregation; 0.0 = the mode's default.
        kl_beta: weight of the k3 KL penalty (needs ``ref_logp`` when > 0).
        log_ratio_clamp: C > 0, log-ratios are clamped to [-C, C] before ``exp``.

    Returns:
        ``(loss, metrics)``: fp32 scalar and fp32 [len(METRIC_NAMES)] in that order.
    """
    tensors = (logp, old_logp, advantages, mask, ref_logp, is_weights)
    o = check(
        tensors,
        (clip_low, clip_high, dual_clip, ratio_type, loss_agg, loss_norm, kl_beta, log_ratio_clamp),
    )
    t = _Terms(tensors, o)
    pg_loss = t.aggregate(t.pg)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    kl_loss = t.aggregate(t.kl) if t.kl is not None else zero
    loss = pg_loss + kl_beta * kl_loss if kl_beta != 0.0 else pg_loss
    clipped = t.clipped.float()
    high = (t.clipped & (t.r > 1.0)).float()
    low = (t.clipped & (t.r < 1.0)).float()
    lr64 = t.tok_lr.double()
    k3 = ((_math.exp64(lr64) - 1.0) - lr64).float()
    k2 = (0.5 * lr64 * lr64).float()
    keep = t.m != 0
    inf = torch.full((), float("inf"), device=logp.device)
    has = t.ntok > 0
    # min / max are exact (order-free); one sentinel element keeps an empty batch valid
    r_min = torch.cat([torch.where(keep, t.r, inf).flatten(), inf[None]]).amin()
    r_max = torch.cat([torch.where(keep, t.r, -inf).flatten(), -inf[None]]).amax()
    r_min, r_max = torch.where(has, r_min, zero), torch.where(has, r_max, zero)
    metrics = torch.stack(
        [
            pg_loss,
            kl_loss,
            t.token_mean(clipped),
            t.token_mean(low),
            t.token_mean(high),
            t.token_mean(t.dual.float()),
            t.token_mean(-t.tok_lr),
            t.token_mean(k3),
            t.token_mean(k2),
            t.token_mean(t.r),
            r_min,
            r_max,
            t.ntok,
            t.nseq,
        ]
    )
    return loss, metrics


@signature_of(grpo_loss, "grad")
def grpo_loss_backward(grad: torch.Tensor, *args: Any) -> torch.Tensor:
    """``d loss / d logp`` [B, T] in ``logp.dtype`` for the upstream scalar gradient ``grad``.

    Takes ``grad`` and then :func:`grpo_loss`'s arguments. Elementwise in the tokens given the
    scalar denominator D (and ``n_b`` for seq-mean-token-mean): ``grad * c_bt * (dpg_bt +
    kl_beta * dkl_bt)`` in fp32, one rounding.
    """
    tensors, o = args[:6], Options(*args[6:])
    t = _Terms(tensors, o)
    d = t.dpg
    if o.kl_beta != 0.0 and t.dkl is not None:
        d = d + o.kl_beta * t.dkl
    return (grad.float() * (t.coef() * d)).to(tensors[0].dtype)
