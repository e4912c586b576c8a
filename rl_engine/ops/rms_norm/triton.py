"""``triton`` provider of ``rms_norm``: batch-invariant RMSNorm (+ fused residual) in Triton.

Numerics (family ``rms_norm/triton``). Rows are the flattened leading dims of ``x`` [..., H]. A
program loads ``ROWS`` whole rows (``ROWS`` and the tile shape come from :func:`get_config`,
which depends on H only, never on the number of rows) and, per row::

    r    = x                                   # or (x.float() + residual.float()).to(x.dtype),
                                               #    which is torch's ``x + residual`` bit for bit
    x32  = r.float()
    rstd = 1 / sqrt_rn(tl.sum(x32 * x32) / H + eps)   # one fixed reduction tree per H
    y    = ((x32 * rstd) * weight.float()).to(x.dtype)

Every row of a tile is reduced by the same tree (it depends on the tile shape, i.e. on H), rows
beyond the end are masked and never mix with real rows: a row's output depends on that row,
``weight``, ``eps`` and H only (row invariant). The fused op computes ``r`` in registers and
stores it; ``rms_norm(x + residual)`` reads the same bits back, so fused == unfused bitwise.

Backward (version 3). The backward has its own launch rule, :func:`get_bwd_config` (a function
of H only: the dX tile of ``rows`` rows and ``num_warps`` warps, and ``wgrad_chunk``). Per row,
with ``g = grad.float() * weight.float()`` and ``rstd`` recomputed from ``r``::

    ss, sgx = tl.reduce((x32 * x32, g * x32))   # ONE joint reduction (one fixed tree per tile)
    rstd = 1 / sqrt_rn(ss / H + eps)
    n    = x32 * rstd
    c    = (sgx / H) * rstd                      # = mean(g * n)
    dx   = ((g - n * c) * rstd).to(r.dtype)

(row invariant). Weight gradient (fp32): rows in chunks of ``wgrad_chunk`` rows (fixed per H);
inside a chunk, tiles of ``rows`` consecutive rows (the dX tile) are summed by a fixed tree and
the tile sums of ``grad.float() * n`` are added in row order into a fresh fp32 partial; the chunk
partials are then added in chunk (row) order by a second kernel. No count of SMs or of rows
enters: deterministic, and appending zero rows only adds exact zeros (zero-padding invariant).

The autograd runs the fused backward (:func:`rms_norm_backward`, extra ``"backward"``): one
program per chunk walks its tiles, computes dX of each tile exactly as the dX kernel does (same
tile, warps and expressions: both call ``_bwd_rows``) and adds the tile into the chunk's partial,
so ``r`` and ``grad`` are read once (three passes over [M, H] instead of five). For the fused
residual op it also adds the gradient of ``x + residual`` (16-bit dtypes; fp32 adds it in torch).
The separate extras (``"dx"``, ``"wgrad"``; the latter is the fused kernel with the dX store
compiled out) give the same bits and serve the cases that need one gradient only.

Version 2 (dX and forward bits as version 1): the weight gradient's row groups became the dX
tile, which changes its bits for H <= 2048 (groups of ``4096 // block_h`` instead of
``2048 // block_h`` rows, 8 instead of 4 warps); for H > 2048 the tiles were already equal.

Version 3 (forward bits unchanged; dX and dW bits change): the backward got its own launch rule
(fewer warps: about 32 live columns per thread instead of 16, e.g. 8 warps instead of 16 at
H = 8192; weight-gradient chunks of 32 rows below H = 4096 and 64 from there, instead of
``2^18 // block_h``), and the two row sums of the backward became one joint reduction with
``c = (sum(g * x) / H) * rstd`` in place of ``sum(g * n) / H``. Both change the reduction trees,
so the dX and dW bits differ from version 2 (same accuracy class against the reference). Speed:
the fused backward at 16384 x 8192 bf16 went from 0.32x of copy bandwidth (H100) to ~0.85x
(H200, kernel time; see :func:`get_bwd_config`).

Not promised: identity with the ``native`` family (its row sum is a different tree), across GPU
models or across Triton versions. On the CPU the kernels run in the Triton interpreter
(``TRITON_INTERPRET=1``): a test vehicle whose bits are not the GPU's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.ops import _interpret, _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.rms_norm import reference
from rl_engine.ops.rms_norm.reference import _check

__all__ = [
    "PROVIDER",
    "RmsNormBwdConfig",
    "RmsNormConfig",
    "get_bwd_config",
    "get_config",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_dx",
    "rms_norm_wgrad",
]

MAX_HIDDEN = 65536  # one row lives in registers; larger rows raise (no silent fallback)


def _block_h(h: int) -> int:
    """Columns of a tile: the next power of two >= ``h`` (at least 16)."""
    if h <= 0 or h > MAX_HIDDEN:
        raise ValueError(f"rms_norm[triton]: hidden size {h} is not in [1, {MAX_HIDDEN}]")
    return max(16, 1 << (h - 1).bit_length())


@dataclass(frozen=True)
class RmsNormConfig:
    """Forward launch configuration; a function of the hidden size H only (part of the numerics).

    Attributes:
        block_h: columns per tile (next power of two >= H).
        rows: rows per tile of the forward kernel.
        num_warps: warps per program of the forward kernel.
        wgrad_chunk: rows per weight-gradient partial; a copy of
            ``get_bwd_config(H).wgrad_chunk`` (the backward has its own configuration).
    """

    block_h: int
    rows: int
    num_warps: int
    wgrad_chunk: int


@dataclass(frozen=True)
class RmsNormBwdConfig:
    """Backward launch configuration; a function of the hidden size H only.

    ``block_h``, ``rows``, ``num_warps`` (the dX tile and its reduction tree) and ``wgrad_chunk``
    (the weight-gradient row chunks) are part of the numerics; the other fields move loads and
    registers around and never change a bit.

    Attributes:
        block_h: columns per tile (next power of two >= H).
        rows: rows per tile of the dX and fused backward kernels.
        num_warps: warps per program of those kernels.
        wgrad_chunk: rows per weight-gradient partial (a multiple of ``rows``).
        prefetch: the fused kernel loads the next tile into registers while it computes one.
        stages: software-pipelining depth Triton is asked for on the fused kernel's tile loop
            when ``prefetch`` is off (1: none).
        reload_weight: re-read the weight per tile (L1 hit) instead of keeping it in registers.
        combine_block: columns per program of the partial-combining kernel.
        combine_unroll: partials that kernel loads per step (all in flight together).
        combine_warps: warps per program of that kernel.
    """

    block_h: int
    rows: int
    num_warps: int
    wgrad_chunk: int
    prefetch: bool = False
    stages: int = 1
    reload_weight: bool = False
    combine_block: int = 64
    combine_unroll: int = 32
    combine_warps: int = 2

    def __post_init__(self) -> None:
        ok = (
            self.block_h >= 16
            and self.block_h & (self.block_h - 1) == 0
            and self.rows >= 1
            and self.rows & (self.rows - 1) == 0
            and self.num_warps in (1, 2, 4, 8, 16, 32)
            and self.wgrad_chunk >= self.rows
            and self.wgrad_chunk % self.rows == 0
            and self.stages >= 1
            and self.combine_block >= 16
            and self.combine_unroll >= 1
            and self.combine_warps in (1, 2, 4, 8)
        )
        if not ok:
            raise ValueError(f"rms_norm[triton]: invalid backward configuration {self}")


@functools.cache
def get_config(h: int) -> RmsNormConfig:
    """The checked-in forward launch rule for hidden size ``h`` (never depends on the row count).

    Tiles hold about 4096 elements (16 per thread for the big rows), small rows are packed
    several per tile.
    """
    block_h = _block_h(h)
    rows = max(1, 4096 // block_h)
    num_warps = max(1, min(16, rows * block_h // 512))
    return RmsNormConfig(block_h, rows, num_warps, get_bwd_config(h).wgrad_chunk)


@functools.cache
def get_bwd_config(h: int) -> RmsNormBwdConfig:
    """The checked-in backward launch rule for hidden size ``h`` (never depends on the row count).

    Why it is fast (measured on an H200, 16384 rows, bf16; ``benchmarks/sweep_rms_norm_bwd.py``
    re-measures every alternative). A program of the fused kernel keeps its tile of ``r`` and
    ``grad``, the normalised row and the fp32 weight-gradient accumulator in registers: about
    240 registers per thread at 32 live columns per thread, i.e. ~7.5K registers per warp, so
    an SM holds 8 / num_warps programs (1 at H = 8192, 2 at 4096, 4 at 2048). Three things keep
    HBM busy:

    * the two row sums of a tile share ONE reduction (``_bwd_rows``); two dependent block-wide
      reductions per row were what made version 2 slow (0.32x of copy bandwidth on an H100);
    * the next tile's loads are issued before the current tile's reduction (``prefetch``: 16
      to 32 KiB in flight per program at H >= 4096), so each SM streams without waiting;
    * about 32 live columns per thread (at most 40: ``num_warps`` = the power of two >=
      H / 1280): fewer warps than the forward kernel, so the block-wide reduction combines
      fewer partial sums; more columns per thread spill registers (H = 8192 with 4 warps ran
      15x slower).

    ``wgrad_chunk``: 64 rows from H = 4096 up, 32 below (16384 rows make 256 or 512 programs,
    about two waves at these occupancies); a chunk's fp32 partial adds 8 / wgrad_chunk bytes
    per element to the 6 the op must move (2-4%). Where a thread would hold more than 32
    columns the weight is re-read per tile (an L1 hit) instead of living in registers, which
    avoids a spill at H = 5120. Measured (kernel time, fraction of the 4.18 TB/s copy
    bandwidth): H = 8192 0.85-0.88, 5120 0.83, 4096 0.81, 2048 0.64 (version 2 on an H100:
    0.32, 0.27, 0.39, 0.17). To ship another configuration change the fields below.
    """
    block_h = _block_h(h)
    rows = max(1, 2048 // block_h)  # small rows: several per tile (>= 2048 slots)
    live = rows * min(h, block_h)  # the tile's live (unmasked) elements
    num_warps = min(16, _next_pow2(-(-live // 1280)))  # <= 40 live elements per thread
    # (also a multiple of the forward tile, 4096 // block_h rows, which only matters for
    # H < 128: RmsNormConfig.wgrad_chunk mirrors this value)
    wgrad_chunk = max(rows, 4096 // block_h, 64 if h >= 4096 else 32)
    per_thread = -(-live // (32 * num_warps))
    return RmsNormBwdConfig(
        block_h=block_h,
        rows=rows,
        num_warps=num_warps,
        wgrad_chunk=wgrad_chunk,
        prefetch=rows * block_h <= 8192,  # larger tiles would spill registers
        stages=1,
        reload_weight=per_thread > 32,
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:

    @triton.jit
    def _row_tile(
        M, H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, INT64: tl.constexpr
    ):
        # This program's tile of ROWS rows (int64 indices when INT64): rows, columns, and the
        # mask of the elements inside the [M, H] matrix.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        if INT64:
            rows = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        return rows, cols, (rows[:, None] < M) & (cols[None, :] < H)

    @triton.jit
    def _tile_ptrs(ptr, rows, stride, cols):
        # [rows, cols] addresses of a row-major matrix with row stride ``stride``
        return ptr + rows[:, None] * stride + cols[None, :]

    @triton.jit
    def _chunk_mask(rows, end, cmask):
        # the elements of rows ``rows`` before the chunk's end row ``end``, in the H columns
        return (rows[:, None] < end) & cmask[None, :]

    @triton.jit
    def _load_r_g(r_ptr, g_ptr, rows, end, cols, cmask, stride_r, stride_g):
        # a backward tile: r and grad of rows ``rows`` (zeros outside _chunk_mask) and the mask
        mask = _chunk_mask(rows, end, cmask)
        r = tl.load(_tile_ptrs(r_ptr, rows, stride_r, cols), mask=mask, other=0.0)
        g = tl.load(_tile_ptrs(g_ptr, rows, stride_g, cols), mask=mask, other=0.0)
        return r, g, mask

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        y_ptr,
        s_ptr,
        M,
        stride_x,
        stride_res,
        stride_y,
        stride_s,
        eps,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ROWS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        INT64: tl.constexpr,
    ):
        rows, cols, mask = _row_tile(M, H, BLOCK_H, ROWS, INT64)
        x = tl.load(_tile_ptrs(x_ptr, rows, stride_x, cols), mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        if HAS_RESIDUAL:
            res = tl.load(_tile_ptrs(res_ptr, rows, stride_res, cols), mask=mask, other=0.0)
            # torch's x + residual: fp32 add, one rounding to x.dtype
            s = (x32 + res.to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(_tile_ptrs(s_ptr, rows, stride_s, cols), s, mask=mask)
            x32 = s.to(tl.float32)
        var = tl.div_rn(tl.sum(x32 * x32, axis=1), H * 1.0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = (x32 * rstd[:, None]) * w[None, :]
        tl.store(_tile_ptrs(y_ptr, rows, stride_y, cols), y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_pair(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    _interpret.sequential_sum_combiner(_sum_pair)  # (interpreter speed only)

    @triton.jit
    def _bwd_rows(x32, dy, w, eps, H: tl.constexpr, HAS_W: tl.constexpr):
        # The row math of every backward kernel (one place, so the dX kernel and the fused
        # kernel compile the same expressions). Both row sums come from ONE joint reduction
        # (one pass through shared memory and its barriers instead of two dependent ones):
        #   ss = sum(x^2), sgx = sum(g * x), rstd = 1 / sqrt(ss / H + eps),
        #   n = x * rstd, c = (sgx / H) * rstd (= mean(g * n)), dx = (g - n * c) * rstd.
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        ss, sgx = tl.reduce((x32 * x32, g * x32), 1, _sum_pair)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, H * 1.0) + eps))
        n = x32 * rstd[:, None]
        c = tl.div_rn(sgx, H * 1.0) * rstd
        dx = (g - n * c[:, None]) * rstd[:, None]
        return n, dx

    @triton.jit
    def _rms_norm_bwd_dx_kernel(
        g_ptr,
        r_ptr,
        w_ptr,
        dx_ptr,
        M,
        stride_g,
        stride_r,
        stride_dx,
        eps,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ROWS: tl.constexpr,
        INT64: tl.constexpr,
    ):
        # One tile of ROWS rows per program: the fused kernel's tile (same tile shape, warps
        # and expressions, see _bwd_rows), so both give the same dX bits.
        rows, cols, mask = _row_tile(M, H, BLOCK_H, ROWS, INT64)
        x32 = tl.load(_tile_ptrs(r_ptr, rows, stride_r, cols), mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(_tile_ptrs(g_ptr, rows, stride_g, cols), mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        _, dx = _bwd_rows(x32, dy, w, eps, H, True)
        tl.store(
            _tile_ptrs(dx_ptr, rows, stride_dx, cols), dx.to(dx_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _bwd_tile_step(
        acc,
        x,
        dy,
        rows,
        mask,
        cols,
        cmask,
        w,
        w_ptr,
        gs_ptr,
        dx_ptr,
        stride_gs,
        stride_dx,
        eps,
        H: tl.constexpr,
        STORE_DX: tl.constexpr,
        HAS_GS: tl.constexpr,
        RELOAD_W: tl.constexpr,
    ):
        # One tile of the fused kernel: dX stored (when asked), acc += column sums of dy * n.
        x32 = x.to(tl.float32)
        dy = dy.to(tl.float32)
        if STORE_DX and RELOAD_W:
            # the weight is re-read (an L1 / L2 hit) instead of living in registers across
            # the loop: frees BLOCK_H / threads registers per thread; the same values
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        n, dx = _bwd_rows(x32, dy, w, eps, H, STORE_DX)
        if STORE_DX:
            dx = dx.to(dx_ptr.dtype.element_ty)
            if HAS_GS:
                # torch's dx + grad_sum (16-bit dtypes only: the rounding of dx above keeps
                # the add from being contracted into an FMA)
                gs = tl.load(_tile_ptrs(gs_ptr, rows, stride_gs, cols), mask=mask, other=0.0)
                dx = (dx.to(tl.float32) + gs.to(tl.float32)).to(dx_ptr.dtype.element_ty)
            tl.store(_tile_ptrs(dx_ptr, rows, stride_dx, cols), dx, mask=mask)
        # rows past the end are zeros, but 0 * rstd is NaN when eps == 0: mask them out
        return acc + tl.sum(tl.where(mask, dy * n, 0.0), axis=0)

    @triton.jit
    def _rms_norm_bwd_kernel(
        g_ptr,
        r_ptr,
        w_ptr,
        gs_ptr,
        dx_ptr,
        part_ptr,
        M,
        stride_g,
        stride_r,
        stride_gs,
        stride_dx,
        eps,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ROWS: tl.constexpr,
        CHUNK: tl.constexpr,
        STORE_DX: tl.constexpr,
        HAS_GS: tl.constexpr,
        PREFETCH: tl.constexpr,
        STAGES: tl.constexpr,
        RELOAD_W: tl.constexpr,
        INT64: tl.constexpr,
    ):
        # One program per chunk of CHUNK rows, walked in tiles of ROWS rows (the dX kernel's
        # tile): per tile, dx exactly as _rms_norm_bwd_dx_kernel computes it, and acc +=
        # tl.sum over the tile's rows of grad * (r * rstd); part[chunk, :] = acc. x and grad
        # are read once for both gradients. PREFETCH, STAGES and RELOAD_W change the schedule
        # only (where loads are issued, what stays in registers), never a value.
        pid = tl.program_id(0)
        if INT64:
            first = pid.to(tl.int64) * CHUNK
        else:
            first = pid * CHUNK
        end = tl.minimum(M, first + CHUNK)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        if STORE_DX and not RELOAD_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            w = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        if PREFETCH:
            # register double buffering: the next tile's loads are issued before this tile's
            # reductions, so they are in flight while it computes (rows past the chunk are
            # masked, so nothing is read twice)
            rows0 = first + tl.arange(0, ROWS)
            r_next, g_next, _ = _load_r_g(r_ptr, g_ptr, rows0, end, cols, cmask, stride_r, stride_g)
            for i in range(0, end - first, ROWS):
                rows = first + i + tl.arange(0, ROWS)
                mask = _chunk_mask(rows, end, cmask)
                x = r_next
                dy = g_next
                nrows = rows + ROWS
                r_next, g_next, _ = _load_r_g(
                    r_ptr, g_ptr, nrows, end, cols, cmask, stride_r, stride_g
                )
                acc = _bwd_tile_step(
                    acc, x, dy, rows, mask, cols, cmask, w, w_ptr, gs_ptr, dx_ptr,
                    stride_gs, stride_dx, eps, H, STORE_DX, HAS_GS, RELOAD_W,
                )  # fmt: skip
        else:
            # STAGES > 1 asks Triton's software pipeliner to stream the loads STAGES - 1 tiles
            # ahead (through shared memory where it can)
            for i in tl.range(0, end - first, ROWS, num_stages=STAGES):
                rows = first + i + tl.arange(0, ROWS)
                x, dy, mask = _load_r_g(r_ptr, g_ptr, rows, end, cols, cmask, stride_r, stride_g)
                acc = _bwd_tile_step(
                    acc, x, dy, rows, mask, cols, cmask, w, w_ptr, gs_ptr, dx_ptr,
                    stride_gs, stride_dx, eps, H, STORE_DX, HAS_GS, RELOAD_W,
                )  # fmt: skip
        tl.store(part_ptr + pid.to(tl.int64) * H + cols, acc, mask=cmask)

    @triton.jit
    def _rms_norm_wgrad_combine_kernel(
        part_ptr,
        out_ptr,
        n_parts,
        H: tl.constexpr,
        BLOCK: tl.constexpr,
        UNROLL: tl.constexpr,
    ):
        # out = ((0 + part[0]) + part[1]) + ...: chunk partials added in row order. The UNROLL
        # loads of a step are independent (all in flight at once); the adds stay in order.
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        ptrs = part_ptr + cols
        for c0 in range(0, n_parts, UNROLL):
            for u in tl.static_range(UNROLL):
                live = (tl.zeros((BLOCK,), dtype=tl.int32) + (c0 + u)) < n_parts
                p = tl.load(ptrs + u * H, mask=cmask & live, other=0.0)
                acc = acc + p
            ptrs += UNROLL * H
        tl.store(out_ptr + cols, acc, mask=cmask)


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``: a cached launcher for CUDA tensors, interpreted for CPU tensors."""
    return _triton.launcher(globals()[name], device)


_guard = _triton.device_guard


@signature_of(reference.rms_norm)
def rms_norm(*args: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant RMSNorm on the GPU (Triton), optionally with the residual add fused.

    The reference's arguments ``(x, weight, eps=1e-6, residual=None)``: ``x`` [..., H] float32 /
    bfloat16 / float16, any strides (H <= 65536); ``weight`` [H]; ``eps`` added to the mean
    square; ``residual`` optional, same shape and dtype as ``x``.

    Returns:
        ``y`` [..., H] in ``x.dtype``; with ``residual``, ``(y, x + residual)``.
    """
    x, weight, eps, residual = args
    _check(x, weight, eps, residual)
    _triton.check_device("rms_norm", x)
    h = x.shape[-1]
    cfg = get_config(h)
    x2 = _triton.rows(x, h)
    m = x2.shape[0]
    y = torch.empty((m, h), dtype=x.dtype, device=x.device)
    res2 = _triton.rows(residual, h) if residual is not None else x2
    s = torch.empty((m, h), dtype=x.dtype, device=x.device) if residual is not None else y
    if m > 0:
        w = weight.contiguous()
        key = (
            "rms_norm_fwd",
            x.get_device(),
            x.dtype,
            w.dtype,
            m,
            h,
            x2.stride(0),
            res2.stride(0),
            residual is not None,
            _triton.aligned(x2),
            _triton.aligned(res2),
            _triton.aligned(w),
            float(eps),
        )
        step = _triton.prepared(
            key,
            lambda: _triton.Prepared(
                _kernel("_rms_norm_fwd_kernel", x.device),
                (_triton.cdiv(m, cfg.rows),),
                (m, x2.stride(0), res2.stride(0), h, h, float(eps)),
                dict(
                    H=h,
                    BLOCK_H=cfg.block_h,
                    ROWS=cfg.rows,
                    HAS_RESIDUAL=residual is not None,
                    INT64=_triton.int64_offsets(m + cfg.rows, x2.stride(0), res2.stride(0), h),
                    num_warps=cfg.num_warps,
                ),
            ),
        )
        with _guard(x):
            step(x2, res2, w, y, s)
    if x.dim() != 2:
        y = y.reshape(x.shape)
    if residual is None:
        return y
    return y, (s if x.dim() == 2 else s.reshape(x.shape))


def rms_norm_dx(
    grad: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Gradient w.r.t. the normalised input ``r`` [..., H] (row invariant), in ``r.dtype``."""
    return _dx(grad, r, weight, eps)


def _dx(
    grad: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    cfg: RmsNormBwdConfig | None = None,
) -> torch.Tensor:
    """:func:`rms_norm_dx` with an optional backward configuration (benchmarks and tests)."""
    _triton.check_device("rms_norm", r)
    h = r.shape[-1]
    cfg = cfg if cfg is not None else get_bwd_config(h)
    r2 = _triton.rows(r, h)
    g2 = _triton.rows(grad.to(r.dtype), h)
    m = r2.shape[0]
    dx = torch.empty((m, h), dtype=r.dtype, device=r.device)
    if m > 0:
        with _guard(r):
            _kernel("_rms_norm_bwd_dx_kernel", r.device)[(_triton.cdiv(m, cfg.rows),)](
                g2,
                r2,
                weight.contiguous(),
                dx,
                m,
                g2.stride(0),
                r2.stride(0),
                dx.stride(0),
                float(eps),
                H=h,
                BLOCK_H=cfg.block_h,
                ROWS=cfg.rows,
                INT64=_triton.int64_offsets(m + cfg.rows, g2.stride(0), r2.stride(0), h),
                num_warps=cfg.num_warps,
            )
    return dx.reshape(r.shape)


def _backward(
    grad: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    grad_sum: torch.Tensor | None,
    *,
    cfg: RmsNormBwdConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One pass of ``_rms_norm_bwd_kernel`` (dx only when ``weight`` is given) + the combine.

    ``cfg`` (default :func:`get_bwd_config`) lets benchmarks and tests try other launches.
    """
    _triton.check_device("rms_norm", r)
    h = r.shape[-1]
    for name, t in (("grad", grad), ("grad_sum", grad_sum)):
        if t is not None and t.shape != r.shape:
            raise ValueError(
                f"rms_norm[triton] backward: {name} shape {tuple(t.shape)} != input shape "
                f"{tuple(r.shape)}"
            )
    if weight is not None and weight.shape != (h,):
        raise ValueError(f"rms_norm[triton] backward: weight shape {tuple(weight.shape)} != ({h},)")
    cfg = cfg if cfg is not None else get_bwd_config(h)
    r2 = _triton.rows(r, h)
    g2 = _triton.rows(grad if grad.dtype == r.dtype else grad.to(r.dtype), h)
    m = r2.shape[0]
    store_dx = weight is not None
    dx = torch.empty((m, h), dtype=r.dtype, device=r.device) if store_dx else None
    # the add of grad_sum is fused for 16-bit dtypes only (see the kernel); fp32 adds in torch
    fuse_gs = grad_sum is not None and r.dtype != torch.float32
    gs2 = _triton.rows(grad_sum.to(r.dtype), h) if fuse_gs else g2
    # with rows, the combine kernel writes every column: no fill kernel (a launch less per call,
    # which measurably shortened the autograd backward's host time)
    alloc = torch.empty if m > 0 else torch.zeros
    out = alloc((h,), dtype=torch.float32, device=r.device)
    if m > 0:
        n_parts = _triton.cdiv(m, cfg.wgrad_chunk)
        parts = torch.empty((n_parts, h), dtype=torch.float32, device=r.device)
        w = weight.contiguous() if store_dx else r2
        key = (
            "rms_norm_bwd",
            r.get_device(),
            r.dtype,
            w.dtype,
            m,
            h,
            g2.stride(0),
            r2.stride(0),
            gs2.stride(0),
            store_dx,
            fuse_gs,
            _triton.aligned(g2),
            _triton.aligned(r2),
            _triton.aligned(w),
            _triton.aligned(gs2),
            float(eps),
            cfg,
        )
        main, combine = _triton.prepared(key, lambda: _bwd_steps(r, m, h, g2, r2, gs2, store_dx,
                                                             fuse_gs, float(eps), cfg, n_parts))  # fmt: skip
        with _guard(r):
            main(g2, r2, w, gs2, dx if store_dx else parts, parts)
            combine(parts, out)
    if dx is not None:
        dx = dx.reshape(r.shape)
        if grad_sum is not None and not fuse_gs:
            dx = dx + grad_sum.to(r.dtype)
    return dx, out


def _bwd_steps(r, m, h, g2, r2, gs2, store_dx, fuse_gs, eps, cfg, n_parts):
    """The two prepared launches of :func:`_backward` (the fused kernel, the ordered combine)."""
    main = _triton.Prepared(
        _kernel("_rms_norm_bwd_kernel", r.device),
        (n_parts,),
        (m, g2.stride(0), r2.stride(0), gs2.stride(0), h if store_dx else 0, eps),
        dict(
            H=h,
            BLOCK_H=cfg.block_h,
            ROWS=cfg.rows,
            CHUNK=cfg.wgrad_chunk,
            STORE_DX=store_dx,
            HAS_GS=fuse_gs,
            PREFETCH=cfg.prefetch,
            STAGES=cfg.stages,
            RELOAD_W=cfg.reload_weight,
            INT64=_triton.int64_offsets(
                m + cfg.wgrad_chunk + cfg.rows, g2.stride(0), r2.stride(0), gs2.stride(0), h
            ),
            num_warps=cfg.num_warps,
        ),
    )
    block = min(cfg.combine_block, cfg.block_h)
    combine = _triton.Prepared(
        _kernel("_rms_norm_wgrad_combine_kernel", r.device),
        (_triton.cdiv(h, block),),
        (n_parts,),
        dict(H=h, BLOCK=block, UNROLL=cfg.combine_unroll, num_warps=cfg.combine_warps),
    )
    return main, combine


def rms_norm_wgrad(grad: torch.Tensor, r: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 [H] weight gradient ``sum_rows(grad * r * rstd)`` in fixed row chunks (see module).

    The same kernel as :func:`rms_norm_backward` with the dX store compiled out: equal bits.
    """
    return _backward(grad, r, None, eps, None)[1]


def rms_norm_backward(
    grad: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    grad_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward: dX and the weight gradient from one read of ``r`` and ``grad``.

    Args:
        grad: [..., H] gradient of ``y`` (cast to ``r.dtype`` as the autograd does).
        r: [..., H] the normalised input (``x``, or ``x + residual`` of the fused op).
        weight: [H].
        eps: as in the forward.
        grad_sum: optional [..., H] gradient flowing into ``r`` directly (the fused op's
            ``x + residual`` output), added to dX as torch adds it (``dx + grad_sum`` in
            ``r.dtype``).

    Returns:
        ``(dx, dweight)``: ``dx`` [..., H] in ``r.dtype``, bitwise ``rms_norm_dx(grad, r, weight,
        eps)`` (``+ grad_sum``); ``dweight`` [H] fp32, bitwise ``rms_norm_wgrad(grad, r, eps)``.
    """
    dx, dw = _backward(grad, r, weight, eps, grad_sum)
    assert dx is not None
    return dx, dw


PROVIDER = _triton.triton_provider(
    numerics="rms_norm/triton",
    fn=rms_norm,
    # 2: weight-gradient groups = the dX tile (H <= 2048 changed); forward and dX bits as in 1
    # 3: backward launch rule of its own + one joint row reduction: new dX and dW bits; forward
    #    bits as in 1
    version="3",
    extras={"dx": rms_norm_dx, "wgrad": rms_norm_wgrad, "backward": rms_norm_backward},
)
