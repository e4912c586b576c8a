"""``stock`` provider of ``rope``: a plain torch rotary embedding as Hugging Face computes it.

fp32 inverse frequencies (the reference's table rounded to fp32), fp32 angles, ``torch.cos`` /
``torch.sin`` cast to ``x.dtype`` and the rotation in ``x.dtype`` (``x * cos + rotate(x) * sin``).
Not batch invariant on the CPU (torch's transcendental functions differ between the SIMD body and
the scalar tail). Registered for the audit mode; strict mode refuses it.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import signature_of
from rl_engine.ops.rope import reference
from rl_engine.ops.rope.reference import _check, inv_freq_table, rotate_pairs


def _rope(x, positions, theta, rotary_dim, is_neox, scaling, *, inverse: bool) -> torch.Tensor:
    rotary_dim, canon = _check(x, positions, theta, rotary_dim, is_neox, scaling)
    inv = torch.tensor(inv_freq_table(float(theta), rotary_dim, canon), device=x.device).float()
    freqs = positions.float()[:, None] * inv[None, :]
    cos = torch.cos(freqs).to(x.dtype)[:, None, :]
    sin = torch.sin(freqs).to(x.dtype)[:, None, :]
    if inverse:
        sin = -sin
    out = rotate_pairs(x[..., :rotary_dim], cos, sin, rotary_dim, is_neox)
    return torch.cat([out, x[..., rotary_dim:]], dim=-1)


@signature_of(reference.rope)
def rope(*args: Any) -> torch.Tensor:
    """Stock torch rotary embedding (see module docstring); the reference's arguments."""
    return _rope(*args, inverse=False)


@signature_of(reference.rope_backward)
def rope_backward(*args: Any) -> torch.Tensor:
    return _rope(*args, inverse=True)


# both rotations in one call, as the reference's (the stock provider's ``qk`` extras)
rope_qk = reference.on_q_and_k(rope)
rope_qk_backward = reference.on_q_and_k(rope_backward, ("grad_q", "grad_k"))
