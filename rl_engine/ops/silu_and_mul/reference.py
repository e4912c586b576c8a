"""PyTorch reference of ``silu_and_mul`` (the ``native`` provider): the spec of the op.

Numerics (family ``silu_and_mul/native``). With ``a = x[..., :D]`` and ``b = x[..., D:]``::

    y = (silu(a) * b.float()).to(x.dtype)

where ``silu`` is :func:`rl_engine.ops._math.silu` (``a / (1 + exp(-a))`` evaluated in float64
with a fixed sequence of IEEE operations, rounded once to fp32). Backward, with
``s = 1 / (1 + exp(-a))`` in float64::

    dsilu = (s * (1 + a * (1 - s))).to(float32)
    da = ((grad.float() * b.float()) * dsilu).to(x.dtype)
    db = (grad.float() * silu(a)).to(x.dtype)

Every output element depends on its own two inputs only (no reduction at all), and no torch
transcendental function is used (``torch.sigmoid`` / ``F.silu`` differ between the SIMD body and
the scalar tail on the CPU): row invariant by construction.
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import check_float, check_tensor
from rl_engine.ops._math import exp64, silu


def _check(x: torch.Tensor) -> None:
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("silu_and_mul: x must have at least 1 dim ([..., 2D]), got a scalar")
    check_float("x", x)
    if x.shape[-1] % 2:
        raise ValueError(
            f"silu_and_mul: the last dim of x must be even ([..., 2D]), got shape {tuple(x.shape)}"
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``silu(x[..., :D]) * x[..., D:]`` (the SwiGLU activation).

    Equivalent to ``F.silu(x[..., :D].float()) * x[..., D:].float()`` rounded once to ``x.dtype``.

    Args:
        x: [..., 2D] float32 / bfloat16 / float16 (gate then up, as vLLM's fused gate_up GEMM
            writes them), any strides.

    Returns:
        [..., D] in ``x.dtype``.
    """
    _check(x)
    d = x.shape[-1] // 2
    return (silu(x[..., :d]) * x[..., d:].float()).to(x.dtype)


def silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. ``x`` [..., 2D] given ``grad`` [..., D]; in ``x.dtype``."""
    d = x.shape[-1] // 2
    a64 = x[..., :d].to(torch.float64)
    s = 1.0 / (1.0 + exp64(-a64))
    dsilu = (s * (1.0 + a64 * (1.0 - s))).to(torch.float32)
    g = grad.float()
    da = ((g * x[..., d:].float()) * dsilu).to(x.dtype)
    db = (g * silu(a64)).to(x.dtype)
    return torch.cat([da, db], dim=-1)
