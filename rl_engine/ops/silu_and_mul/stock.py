"""``stock`` provider of ``silu_and_mul``: ``F.silu(x1) * x2`` as vLLM's native path computes it.

Not batch invariant on the CPU (``F.silu`` / ``torch.sigmoid`` differ between the SIMD body and the
scalar tail of a buffer). Registered for the audit mode; strict mode refuses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.ops.silu_and_mul.reference import _check


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x[..., :D]) * x[..., D:]`` in ``x.dtype``."""
    _check(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    a = x[..., :d].float()
    s = torch.sigmoid(a)
    g = grad.float()
    da = g * x[..., d:].float() * s * (1 + a * (1 - s))
    db = g * F.silu(a)
    return torch.cat([da, db], dim=-1).to(x.dtype)
