"""``triton`` provider of ``silu_and_mul``: the SwiGLU activation as one memory-bound kernel.

Numerics (family ``silu_and_mul/triton-f32``). With ``a = x[..., :D]``, ``b = x[..., D:]`` in
fp32 (one load, one widening)::

    e    = exp(-a)                    # Triton's fp32 exp
    silu = a / (1 + e)
    y    = (silu * b).to(x.dtype)     # one rounding

Backward (fp32, one rounding per output): ``s = 1 / (1 + e)``,
``da = ((grad * b) * (s * (1 + a * (1 - s)))).to(x.dtype)``, ``db = (grad * silu).to(x.dtype)``.

Each output element is computed from its own inputs by the same instruction sequence whatever
the tile it sits in (there is no reduction), so the op is row invariant for any launch shape;
the tile shape still depends on D only. Not promised: identity with the ``native`` family (that
one evaluates ``exp`` in float64), across GPU models or Triton versions. On the CPU the kernels
run in the Triton interpreter (``TRITON_INTERPRET=1``), a test vehicle whose bits are not the
GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.silu_and_mul.reference import _check

__all__ = ["PROVIDER", "SiluAndMulConfig", "get_config", "silu_and_mul", "silu_and_mul_backward"]


@dataclass(frozen=True)
class SiluAndMulConfig:
    """Launch configuration; a function of D (half the last dim) only.

    Attributes:
        block_d: columns of the output per program (power of two).
        rows: rows per program.
        num_warps: warps per program.
    """

    block_d: int
    rows: int
    num_warps: int


def get_config(d: int) -> SiluAndMulConfig:
    """Tiles of about 2048 outputs (8 per thread with 8 warps); small D packs several rows."""
    if d <= 0:
        raise ValueError(f"silu_and_mul[triton]: D must be > 0, got {d}")
    block_d = min(2048, max(16, 1 << (d - 1).bit_length()))
    rows = max(1, 2048 // block_d)
    return SiluAndMulConfig(block_d, rows, 8 if rows * block_d >= 2048 else 4)


if triton is not None:

    @triton.jit
    def _load_gate_up(
        x_ptr,
        M,
        stride_x,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        INT64: tl.constexpr,
    ):
        """This program's tile of ``x`` [M, 2D]: its ``rows``, ``cols`` and ``mask``, and the
        gate ``a = x[rows, cols]`` and up ``b = x[rows, D + cols]`` widened to fp32 (masked
        lanes 0)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        if INT64:
            rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < M) & (cols[None, :] < D)
        xp = x_ptr + rows[:, None] * stride_x + cols[None, :]
        a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(xp + D, mask=mask, other=0.0).to(tl.float32)
        return rows, cols, mask, a, b

    @triton.jit
    def _silu_and_mul_fwd_kernel(
        x_ptr,
        y_ptr,
        M,
        stride_x,
        stride_y,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        INT64: tl.constexpr,
    ):
        rows, cols, mask, a, b = _load_gate_up(x_ptr, M, stride_x, D, BLOCK_D, ROWS, INT64)
        silu = a / (1.0 + tl.exp(-a))
        y = silu * b
        tl.store(
            y_ptr + rows[:, None] * stride_y + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _silu_and_mul_bwd_kernel(
        g_ptr,
        x_ptr,
        dx_ptr,
        M,
        stride_g,
        stride_x,
        stride_dx,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        INT64: tl.constexpr,
    ):
        rows, cols, mask, a, b = _load_gate_up(x_ptr, M, stride_x, D, BLOCK_D, ROWS, INT64)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        den = 1.0 + tl.exp(-a)
        s = 1.0 / den
        silu = a / den
        da = (g * b) * (s * (1.0 + a * (1.0 - s)))
        db = g * silu
        dp = dx_ptr + rows[:, None] * stride_dx + cols[None, :]
        tl.store(dp, da.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dp + D, db.to(dx_ptr.dtype.element_ty), mask=mask)


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``: a cached launcher for CUDA tensors, interpreted for CPU tensors."""
    return _triton.launcher(globals()[name], device)


_guard = _triton.device_guard


def _grid(m: int, d: int, cfg: SiluAndMulConfig) -> tuple[int, int]:
    return (_triton.cdiv(m, cfg.rows), _triton.cdiv(d, cfg.block_d))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``silu(x[..., :D]) * x[..., D:]`` on the GPU (Triton).

    Args:
        x: [..., 2D] float32 / bfloat16 / float16 (gate then up), any strides.

    Returns:
        [..., D] in ``x.dtype``.
    """
    _check(x)
    _triton.check_device("silu_and_mul", x)
    d = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], d)
    if d == 0 or x.numel() == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    cfg = get_config(d)
    x2 = _triton.rows(x, 2 * d)
    m = x2.shape[0]
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    with _guard(x):
        _kernel("_silu_and_mul_fwd_kernel", x.device)[_grid(m, d, cfg)](
            x2,
            y,
            m,
            x2.stride(0),
            y.stride(0),
            D=d,
            BLOCK_D=cfg.block_d,
            ROWS=cfg.rows,
            INT64=_triton.int64_offsets(m + cfg.rows, x2.stride(0)),
            num_warps=cfg.num_warps,
        )
    return y.reshape(out_shape)


def silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. ``x`` [..., 2D] given ``grad`` [..., D]; in ``x.dtype`` (row invariant)."""
    _triton.check_device("silu_and_mul", x)
    d = x.shape[-1] // 2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if d == 0 or x.numel() == 0:
        return dx
    cfg = get_config(d)
    x2 = _triton.rows(x, 2 * d)
    g2 = _triton.rows(grad.to(x.dtype), d)
    m = x2.shape[0]
    dx2 = dx.view(m, 2 * d)
    with _guard(x):
        _kernel("_silu_and_mul_bwd_kernel", x.device)[_grid(m, d, cfg)](
            g2,
            x2,
            dx2,
            m,
            g2.stride(0),
            x2.stride(0),
            dx2.stride(0),
            D=d,
            BLOCK_D=cfg.block_d,
            ROWS=cfg.rows,
            INT64=_triton.int64_offsets(m + cfg.rows, x2.stride(0), g2.stride(0)),
            num_warps=cfg.num_warps,
        )
    return dx


PROVIDER = _triton.triton_provider(
    numerics="silu_and_mul/triton-f32",
    fn=silu_and_mul,
    version="1",
    extras={"backward": silu_and_mul_backward},
)
