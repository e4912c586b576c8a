"""``stock`` provider of ``entropy``: torch's ``logsumexp`` / ``softmax`` / ``sum``.

Not batch invariant (reduction order chosen by the framework). Audit mode only.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import signature_of
from rl_engine.ops.entropy import reference
from rl_engine.ops.entropy.reference import _check


def entropy_forward(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, lse)`` fp32 [T] with torch's own reductions (arguments checked at the
    public entry)."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    return lse - (p * z).sum(-1), lse


@signature_of(reference.entropy_backward)
def entropy_backward(*args: Any) -> torch.Tensor:
    """``grad * (-p * (z - lse + entropy)) / temperature`` in ``logits.dtype``."""
    logits, temperature, lse, entropy, grad = args
    z = logits.float() / temperature
    p = torch.exp(z - lse[:, None])
    d = -p * (z - lse[:, None] + entropy[:, None])
    return (d * grad.float()[:, None] / temperature).to(logits.dtype)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` with torch's reductions (fp32 [T])."""
    _check(logits, temperature)
    return entropy_forward(logits, temperature)[0]
