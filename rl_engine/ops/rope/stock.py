"""``stock`` provider of ``rope``: a plain torch rotary embedding as Hugging Face computes it.

fp32 inverse frequencies (the reference's table rounded to fp32), fp32 angles, ``torch.cos`` /
``torch.sin`` cast to ``x.dtype`` and the rotation in ``x.dtype`` (``x * cos + rotate(x) * sin``).
Not batch invariant on the CPU (torch's transcendental functions differ between the SIMD body and
the scalar tail). Registered for the audit mode; strict mode refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_engine.ops.rope.reference import _check, inv_freq_table


def _rope(x, positions, theta, rotary_dim, is_neox, scaling, *, inverse: bool) -> torch.Tensor:
    rotary_dim, canon = _check(x, positions, theta, rotary_dim, is_neox, scaling)
    inv = torch.tensor(inv_freq_table(float(theta), rotary_dim, canon), device=x.device).float()
    freqs = positions.float()[:, None] * inv[None, :]
    cos = torch.cos(freqs).to(x.dtype)[:, None, :]
    sin = torch.sin(freqs).to(x.dtype)[:, None, :]
    if inverse:
        sin = -sin
    xr = x[..., :rotary_dim]
    if is_neox:
        h = rotary_dim // 2
        x1, x2 = xr[..., :h], xr[..., h:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, x[..., rotary_dim:]], dim=-1)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    scaling: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Stock torch rotary embedding (see module docstring)."""
    return _rope(x, positions, theta, rotary_dim, is_neox, scaling, inverse=False)


def rope_backward(
    grad: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    scaling: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    return _rope(grad, positions, theta, rotary_dim, is_neox, scaling, inverse=True)
