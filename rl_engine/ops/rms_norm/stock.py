"""``stock`` provider of ``rms_norm``: plain torch (``mean`` / ``rsqrt`` / ``sum``).

Not batch invariant (torch picks reduction orders and SIMD / scalar paths by shape). Registered so
that the audit mode can measure the "before" picture; strict mode refuses it.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import signature_of
from rl_engine.ops.rms_norm import reference
from rl_engine.ops.rms_norm.reference import norm_dx, with_residual


def _rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _norm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = r.float()
    return (x32 * _rstd(x32, eps) * weight.float()).to(r.dtype)


@signature_of(reference.rms_norm)
def rms_norm(*args: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face style RMSNorm with stock torch reductions (the reference's arguments)."""
    return with_residual(_norm, *args)


def _mean(t: torch.Tensor) -> torch.Tensor:
    return t.mean(-1, keepdim=True)


def rms_norm_dx(
    grad: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return norm_dx(_rstd, _mean, grad, r, weight, eps)


def rms_norm_wgrad(grad: torch.Tensor, r: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = r.float()
    rstd = _rstd(x32, eps)
    return (grad.float() * x32 * rstd).reshape(-1, x32.shape[-1]).sum(0)
