"""PyTorch reference of ``det_gemm`` (the ``native`` provider): the spec of the op.

Numerics (family ``det_gemm/native``): every output element is
``acc = 0; for each K-chunk c of 16 (zero-padded): acc = acc + tree16(a[i, c] * b[c, j])`` in fp32,
where products are fp32 multiplications and ``tree16`` is the fixed pairwise sum of
:func:`rl_engine.ops._common.tree_sum`; then ``out = (acc + bias[j]).to(a.dtype)``. Only
elementwise tensor operations are used, so an element depends on row ``i`` of ``a``, column ``j``
of ``b`` and K alone: the op is row invariant and column invariant by construction, on any device
(no BLAS kernel selection is involved).
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import tree_sum

K_CHUNK = 16  # reduction chunk (fixed: part of the numerics)
_ROW_TILE = 256  # work tiles: do not change numerics, only peak memory
_COL_TILE = 4096


def _check(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    from rl_engine.ops._common import (
        check_float,
        check_same_device,
        check_same_dtype,
        check_tensor,
        check_tensors,
    )

    check_tensors(2, a=a, b=b)
    check_float("a", a)
    check_same_device(a=a, b=b, bias=bias)
    check_same_dtype(a=a, b=b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"det_gemm: a and b shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
            f"{b.shape[0]}x{b.shape[1]})"
        )
    if bias is not None:
        check_tensor("bias", bias, dims=1)
        check_same_dtype(a=a, bias=bias)
        if bias.shape[0] != b.shape[1]:
            raise ValueError(f"det_gemm: bias has {bias.shape[0]} elements, expected {b.shape[1]}")


def check_wgrad(a: torch.Tensor, grad: torch.Tensor) -> None:
    """The inputs of a ``det_gemm_wgrad`` (every provider's): 2-D, the same rows, dtype and
    device."""
    if a.dim() != 2 or grad.dim() != 2 or a.shape[0] != grad.shape[0]:
        raise ValueError(
            f"det_gemm_wgrad: a {tuple(a.shape)} and grad {tuple(grad.shape)} need the same "
            "number of rows"
        )
    if a.dtype != grad.dtype:
        raise TypeError(f"det_gemm_wgrad: a is {a.dtype}, grad is {grad.dtype}")
    if a.device != grad.device:
        raise ValueError(f"det_gemm_wgrad: a on {a.device}, grad on {grad.device}")


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a @ b`` in the fixed order above; a [M, K], b [K, N] (any dtype, any strides)."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    if k == 0 or m == 0 or n == 0:
        return out
    pad = (-k) % K_CHUNK
    a32 = a.float()
    b32 = b.float()
    if pad:
        a32 = torch.cat([a32, a32.new_zeros(m, pad)], dim=1)
        b32 = torch.cat([b32, b32.new_zeros(pad, n)], dim=0)
    for r0 in range(0, m, _ROW_TILE):
        ar = a32[r0 : r0 + _ROW_TILE]
        for c0 in range(0, n, _COL_TILE):
            bc = b32[:, c0 : c0 + _COL_TILE]
            acc = out[r0 : r0 + _ROW_TILE, c0 : c0 + _COL_TILE]
            for k0 in range(0, k + pad, K_CHUNK):
                prod = ar[:, k0 : k0 + K_CHUNK, None] * bc[None, k0 : k0 + K_CHUNK, :]
                acc += tree_sum(prod, dim=1)
    return out


def det_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``a @ b (+ bias)``.

    Equivalent to ``torch.addmm(bias, a, b)`` (``torch.mm`` without bias) computed with fp32
    accumulation and rounded once to ``a.dtype``.

    Args:
        a: [M, K] float32 / bfloat16 / float16, any strides.
        b: [K, N] same dtype, any strides (an ``nn.Linear`` weight is passed as ``w.t()``).
        bias: optional [N], same dtype.

    Returns:
        [M, N] in ``a.dtype``.
    """
    _check(a, b, bias)
    acc = _mm_fp32(a, b)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(a.dtype)


def det_gemm_wgrad(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``a.t() @ grad`` in fp32: the weight gradient, reduced over rows in a fixed order.

    Rows are reduced in chunks of 16 (pairwise inside a chunk), chunks combined in row order.
    Appending zero rows adds exact zeros, so the result is invariant to zero padding.
    Returns fp32 [K, N].
    """
    return _mm_fp32(a.t(), grad)
