"""``stock`` provider of ``logp``: ``torch.log_softmax`` on the full logits.

Not batch invariant (the framework picks the reduction order of ``log_softmax`` by shape and
thread count). Registered so that the audit mode can measure the "before" picture; strict mode
refuses it.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import signature_of
from rl_engine.ops.logp import reference
from rl_engine.ops.logp.reference import _check, check_row_temperatures, check_token_range


def logp_forward(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, lse)`` fp32 [T] with torch's own reductions (arguments checked at the public
    entry)."""
    check_token_range(tokens, logits.shape[1])
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(1, tokens.long()[:, None])[:, 0] - lse, lse


@signature_of(reference.logp_backward)
def logp_backward(*args: Any) -> torch.Tensor:
    """``grad * (onehot - softmax(z)) / temperature`` in ``logits.dtype``."""
    logits, tokens, temperature, lse, grad = args
    z = logits.float() / temperature
    d = -torch.exp(z - lse[:, None])
    d.scatter_add_(1, tokens.long()[:, None], torch.ones_like(d[:, :1]))
    return (d * grad.float()[:, None] / temperature).to(logits.dtype)


def logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``torch.log_softmax(logits.float() / temperature, -1)`` at ``tokens`` (fp32 [T])."""
    _check(logits, tokens, temperature)
    return logp_forward(logits, tokens, temperature)[0]


def sampled_forward(
    logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, rank)`` at per-row temperatures with torch's own reductions."""
    _check(logits, tokens, 1.0)
    check_row_temperatures(logits, temperatures)
    z = logits.float() / temperatures[:, None]
    lse = torch.logsumexp(z, dim=-1)
    zt = z.gather(1, tokens.long()[:, None])
    return zt[:, 0] - lse, lse, (z > zt).sum(-1) + 1
