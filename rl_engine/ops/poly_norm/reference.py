"""PyTorch reference of ``poly_norm`` / ``fused_mul_poly_norm`` (the ``native`` provider).

PolyNorm (the MLP activation of e.g. Motif): with ``n(z) = z / sqrt(mean(z^2) + eps)`` over the
last dim (H), ``poly_norm(x) = w0 * n(x^3) + w1 * n(x^2) + w2 * n(x) + b``; and
``fused_mul_poly_norm(x, mul) = poly_norm(x) * mul``.

Numerics (family ``poly_norm/native``), per row of H elements, in fp32::

    a1 = x.float();  a2 = a1 * a1;  a3 = a2 * a1
    r_k = 1 / sqrt(tree_sum(a_k * a_k) / H + eps)        # k = 1, 2, 3; fixed pairwise order
    y32 = ((w0 * (a3 * r3) + w1 * (a2 * r2)) + w2 * (a1 * r1)) + b
    poly_norm            = y32.to(x.dtype)
    fused_mul_poly_norm  = (poly_norm.float() * mul.float()).to(x.dtype)

so the fused op is bitwise ``poly_norm(x) * mul`` as torch computes it (one rounding of the
product of the two rounded factors). ``w`` = ``weight.float()`` [3], ``b`` = ``bias.float()``
[1].

Backward (fp32, one rounding each), with ``g = grad.float()`` (fused: ``g`` is
``(grad * mul)`` rounded to ``x.dtype``, and ``dmul = (grad * poly_norm)`` rounded, the
unfused composition's autograd bit for bit), ``n_k = a_k * r_k``, ``g_k = g * w_k``::

    da_k = (g_k - n_k * (tree_sum(g_k * n_k) / H)) * r_k
    dx   = ((da1 + da2 * (2 * a1)) + da3 * (3 * a2)).to(x.dtype)
    dw_k = sum_rows(tree_sum(g * n_k))      # fp32 [3]
    db   = sum_rows(tree_sum(g))            # fp32 [1]

``sum_rows`` (:func:`sum_rows`) is one pairwise tree over the rows' partials (zero-padded to a
power of two): deterministic, vectorised, and appending zero rows adds exact zeros.

Only elementwise operations and :func:`tree_sum` per row: a row's output and dx depend on that
row, the weights and H only (row invariant on any device); dw / db are deterministic.
"""

from __future__ import annotations

import math

import torch

from rl_engine.ops._common import (
    FLOAT_DTYPES,
    check_float,
    check_same_device,
    check_tensor,
    check_tensors,
    tree_sum,
)

ORDER = 3  # x^3, x^2, x^1


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None = None,
) -> None:
    check_tensor("x", x)
    check_tensors(1, weight=weight, bias=bias)
    if x.dim() < 1:
        raise ValueError("poly_norm: x must have at least 1 dim ([..., H]), got a scalar")
    check_float("x", x)
    check_float("weight", weight, FLOAT_DTYPES)
    check_float("bias", bias, FLOAT_DTYPES)
    if mul is not None:
        check_tensor("mul", mul)
        if mul.dtype != x.dtype or mul.shape != x.shape:
            raise ValueError(
                f"fused_mul_poly_norm: mul must have x's shape and dtype, got {tuple(mul.shape)} "
                f"{mul.dtype} for x {tuple(x.shape)} {x.dtype}"
            )
    check_same_device(x=x, weight=weight, bias=bias, mul=mul)
    if x.shape[-1] == 0:
        raise ValueError("poly_norm: the hidden size (last dim of x) must be > 0")
    if weight.shape[0] != ORDER or bias.shape[0] != 1:
        raise ValueError(
            f"poly_norm: weight must have {ORDER} elements and bias 1, got "
            f"{tuple(weight.shape)} and {tuple(bias.shape)}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"poly_norm: eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"poly_norm: eps must be finite and >= 0, got {eps}")


def sum_rows(parts: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 of the per-row partials ``parts`` [M, k]: one pairwise tree."""
    return tree_sum(parts.float(), dim=0)


def _powers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a1 = x.float()
    a2 = a1 * a1
    return a1, a2, a2 * a1


def _rstd(a: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(tree_sum(a^2) / H + eps)`` per row, fp32, with a trailing singleton dim."""
    s = torch.sqrt(tree_sum(a * a, dim=-1) / a.shape[-1] + float(eps))
    return (torch.ones_like(s) / s).unsqueeze(-1)


def _forward32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    a1, a2, a3 = _powers(x)
    w = weight.float()
    n1, n2, n3 = (a * _rstd(a, eps) for a in (a1, a2, a3))
    return ((w[0] * n3 + w[1] * n2) + w[2] * n1) + bias.float()[0]


def poly_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Batch-invariant PolyNorm ``w0 n(x^3) + w1 n(x^2) + w2 n(x) + b`` over the last dim.

    Args:
        x: [..., H] float32 / bfloat16 / float16, any strides.
        weight: [3] (``w0, w1, w2``), bias: [1]; any float dtype (used in fp32).
        eps: added to each mean square (rounded to fp32).

    Returns:
        [..., H] in ``x.dtype``.
    """
    _check(x, weight, bias, eps)
    return _forward32(x, weight, bias, eps).to(x.dtype)


def fused_mul_poly_norm(
    x: torch.Tensor,
    mul: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``poly_norm(x, weight, bias, eps) * mul`` (bitwise the unfused composition)."""
    _check(x, weight, bias, eps, mul)
    y = _forward32(x, weight, bias, eps).to(x.dtype)
    return (y.float() * mul.float()).to(x.dtype)


def poly_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dx, dmul, dweight, dbias)``: dx / dmul in ``x.dtype`` (dmul ``None`` without ``mul``),
    dweight [3] / dbias [1] fp32 (module docstring)."""
    dmul = None
    if mul is not None:
        y = _forward32(x, weight, bias, eps).to(x.dtype)
        dmul = (grad.float() * y.float()).to(x.dtype)
        grad = (grad.float() * mul.float()).to(x.dtype)
    a = _powers(x)
    r = [_rstd(ak, eps) for ak in a]
    n = [ak * rk for ak, rk in zip(a, r)]
    w = weight.float()
    g = grad.float()
    h = x.shape[-1]
    da = []
    for k, wk in zip((0, 1, 2), (w[2], w[1], w[0])):  # a1 <-> w2, a2 <-> w1, a3 <-> w0
        gk = g * wk
        c = tree_sum(gk * n[k], dim=-1).unsqueeze(-1) / h
        da.append((gk - n[k] * c) * r[k])
    dx = ((da[0] + da[1] * (2.0 * a[0])) + da[2] * (3.0 * a[1])).to(x.dtype)
    rows = g.reshape(-1, h)
    parts = [tree_sum(rows * nk.reshape(-1, h), dim=-1) for nk in (n[2], n[1], n[0])]
    parts.append(tree_sum(rows, dim=-1))
    sums = sum_rows(torch.stack(parts, dim=-1))  # [4]: w0, w1, w2, b
    return dx, dmul, sums[:3], sums[3:]
