"""PyTorch reference of ``rms_norm`` (the ``native`` provider): the spec of the op.

Numerics (family ``rms_norm/native``). For each row of ``H`` elements of ``r`` (``r = x``, or
``r = x + residual`` computed by torch's elementwise add in ``x.dtype``)::

    x32 = r.float()
    var = tree_sum(x32 * x32) / H          # fixed pairwise order, depends on H only
    rstd = 1 / sqrt(var + eps)             # eps rounded to fp32; sqrt and / are exact IEEE
    y = ((x32 * rstd) * weight.float()).to(x.dtype)

Backward (fp32, one rounding): with ``n = x32 * rstd`` and ``g = grad.float() * weight.float()``,
``dx = ((g - n * (tree_sum(g * n) / H)) * rstd).to(r.dtype)``. The weight gradient
``dweight = sum over rows of grad.float() * n`` is reduced over rows in a fixed order: rows in
chunks of 16 (zero padded), each chunk summed pairwise (:func:`tree_sum`), the chunk partials
accumulated in row order into one fp32 accumulator (the order of ``det_gemm``'s weight gradient).

Only elementwise tensor operations and :func:`tree_sum` are used, so a row's output depends on
that row, ``weight``, ``eps`` and ``H`` alone: row invariant by construction, on any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rl_engine.ops._common import (
    FLOAT_DTYPES,
    check_float,
    check_same_device,
    check_tensor,
    tree_sum,
)

ROW_CHUNK = 16  # rows per partial of the weight gradient (fixed: part of the numerics)


def _check(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> None:
    check_tensor("x", x)
    check_tensor("weight", weight, dims=1)
    if x.dim() < 1:
        raise ValueError("rms_norm: x must have at least 1 dim ([..., H]), got a scalar")
    check_float("x", x)
    check_float("weight", weight, FLOAT_DTYPES)
    if residual is not None:
        check_tensor("residual", residual)
    check_same_device(x=x, weight=weight, residual=residual)
    h = x.shape[-1]
    if h == 0:
        raise ValueError("rms_norm: the hidden size (last dim of x) must be > 0")
    if weight.shape[0] != h:
        raise ValueError(
            f"rms_norm: weight has {weight.shape[0]} elements, expected H={h} (x shape "
            f"{tuple(x.shape)})"
        )
    if residual is not None:
        if residual.dtype != x.dtype:
            raise TypeError(f"rms_norm: residual dtype {residual.dtype} != x dtype {x.dtype}")
        if residual.shape != x.shape:
            raise ValueError(
                f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
            )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"rms_norm: eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm: eps must be finite and >= 0, got {eps}")


def _rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(tree_sum(x32^2) / H + eps)`` per row, fp32, with a trailing singleton dim."""
    var = tree_sum(x32 * x32, dim=-1) / x32.shape[-1]
    s = torch.sqrt(var + float(eps))
    return (torch.ones_like(s) / s).unsqueeze(-1)


def _norm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = r.float()
    return ((x32 * _rstd(x32, eps)) * weight.float()).to(r.dtype)


def with_residual(
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` of the torch providers around their row math ``norm(r, weight, eps)``: the
    argument checks, then ``norm(x, ...)``, or with ``residual`` ``(norm(s, ...), s)`` for
    ``s = x + residual`` (torch's add in ``x.dtype``)."""
    _check(x, weight, eps, residual)
    if residual is None:
        return norm(x, weight, eps)
    s = x + residual
    return norm(s, weight, eps), s


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant RMSNorm, optionally with the residual add fused in front.

    Equivalent to ``(x32 * rsqrt(mean(x32^2, -1) + eps) * weight.float()).to(x.dtype)`` with
    ``x32 = x.float()`` (Hugging Face's ``LlamaRMSNorm`` up to where the weight multiply rounds),
    the mean summed in a fixed pairwise order.

    Args:
        x: [..., H] float32 / bfloat16 / float16, any strides.
        weight: [H] float32 / bfloat16 / float16.
        eps: added to the mean square (rounded to fp32).
        residual: optional, same shape and dtype as ``x``.

    Returns:
        ``y`` [..., H] in ``x.dtype``; with ``residual``, ``(rms_norm(x + residual), x + residual)``
        where the sum is computed in ``x.dtype``.
    """
    return with_residual(_norm, x, weight, eps, residual)


def norm_dx(
    rstd_of: Callable[[torch.Tensor, float], torch.Tensor],
    row_mean: Callable[[torch.Tensor], torch.Tensor],
    grad: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``rms_norm_dx`` of the torch providers around their row statistics, ``rstd_of(x32, eps)``
    and ``row_mean(t)`` (the mean over the last dim), both [..., 1]: with ``x32 = r.float()``,
    ``n = x32 * rstd`` and ``g = grad.float() * weight.float()``,
    ``((g - n * row_mean(g * n)) * rstd).to(r.dtype)``."""
    x32 = r.float()
    rstd = rstd_of(x32, eps)
    n = x32 * rstd
    g = grad.float() * weight.float()
    return ((g - n * row_mean(g * n)) * rstd).to(r.dtype)


def _tree_mean(t: torch.Tensor) -> torch.Tensor:
    """``tree_sum(t) / H`` over the last dim, with a trailing singleton dim."""
    return tree_sum(t, dim=-1).unsqueeze(-1) / t.shape[-1]


def rms_norm_dx(
    grad: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Gradient w.r.t. the normalised input ``r`` [..., H] (row invariant), in ``r.dtype``."""
    return norm_dx(_rstd, _tree_mean, grad, r, weight, eps)


def sum_rows(p: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 of ``p`` [M, H] in the fixed order of the module docstring."""
    m, h = p.shape
    acc = torch.zeros(h, dtype=torch.float32, device=p.device)
    pad = (-m) % ROW_CHUNK
    if pad:
        p = torch.cat([p, p.new_zeros(pad, h)])
    partials = tree_sum(p.reshape(-1, ROW_CHUNK, h), dim=1)
    for c in range(partials.shape[0]):
        acc = acc + partials[c]
    return acc


def rms_norm_wgrad(grad: torch.Tensor, r: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 [H] weight gradient ``sum_rows(grad * r * rstd)`` (fixed row order, see module)."""
    x32 = r.float()
    p = grad.float() * (x32 * _rstd(x32, eps))
    return sum_rows(p.reshape(-1, x32.shape[-1]))
