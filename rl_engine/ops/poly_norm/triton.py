"""``triton`` provider of ``poly_norm`` / ``fused_mul_poly_norm``.

Numerics (family ``poly_norm/triton-b{BLOCK}``): one program per row. The row is visited in
blocks of ``BLOCK`` columns from column 0 (``BLOCK`` depends on H only); sums are kept per lane
(lane ``j`` holds columns ``j, j + BLOCK, ...``, added in column order) and each lane vector is
summed once by a fixed halving tree (``logp``'s ``_tree_sum_rows``), so a row's reductions
depend on H alone, never on the layout the compiler picks or on other rows::

    a1 = x.float(); a2 = a1 * a1; a3 = a2 * a1
    r_k = 1 / sqrt_rn(tree(lanes of a_k^2) / H + eps)
    y32 = ((w0 * (a3 * r3) + w1 * (a2 * r2)) + w2 * (a1 * r1)) + b
    y = y32.to(x.dtype);  fused: (y.float() * mul.float()).to(x.dtype)

Backward, the reference's expressions with the same lane + tree sums: ``g`` (fused: ``(grad *
mul)`` rounded), ``c_k = tree(lanes of g_k * n_k) / H``, ``da_k = (g_k - n_k c_k) r_k``,
``dx = ((da1 + da2 (2 a1)) + da3 (3 a2)).to(x.dtype)``; per-row partials of ``g * n_k`` and
``g`` (lane + tree) are summed over rows by the reference's pairwise tree (:func:`sum_rows`: one
program, bitwise :func:`reference.sum_rows`, instead of its log2(M) launches).
Row invariant; dweight / dbias deterministic. Not promised: the ``native`` family's bits.

Not taken: one halving tree over the whole (padded) row, which would let a row stay in
registers (read once): on an H100 (2026-11-26) trees of 2048-8192 lanes ran the forward 5-10x
slower than these lanes (every tree level is a layout change through shared memory, so a tree's
cost grows as N log N; a sequential lane sum is register adds and one 1024-lane tree).

Also not taken (H200, 2026-11-26, same bits): the three (backward: seven) lane vectors joined
into one [4, BLOCK] / [8, BLOCK] tile (``tl.join`` + ``tl.permute``) and reduced by one stacked
tree: 2-17x slower (10x the warp shuffles of three trees); two blocks loaded per step: +2%.
Kept: the sums' loads marked ``evict_last`` and the elementwise pass walking the blocks last to
first with ``evict_first`` (the blocks read last are the ones still cached); speed only, the
same expressions per element (H200 A/B: forward +5%, backward +12%); and fewer warps per row program
(:func:`fwd_warps`, ``BWD_WARPS``), which keeps the trees' first levels inside a warp (short
rows +10-27%). All measured in ``benchmarks/results/h200/poly_norm_stacked_tree_rejected/``.

Every kernel launches with ``enable_fp_fusion=False``: each product and sum above rounds as
written. With contraction on, the compiler chose where to fuse a multiply into an add per
kernel, and the ``HAS_MUL`` specialisation fused differently from the plain one: the H200 fuzz
run of 2026-11-26 found ``fused_mul_poly_norm`` 1-2 ulps off ``poly_norm(x) * mul`` on 16 of
~800 cases (seeds in ``tests/test_fuzz.py``). Version 2 of the family.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton as _tr
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.poly_norm import reference

if triton is not None:
    from rl_engine.ops.logp.triton import _tree_sum_rows

__all__ = ["PROVIDER", "fused_mul_poly_norm", "poly_norm", "poly_norm_backward"]

MAX_BLOCK = 1024
_SUM_BLOCK = 2048  # rows per step of the row-sum program's levels in memory (speed only)
_SUM_RBLOCK = 2048  # rows of its last levels, in registers (speed only)
BWD_WARPS = 2  # warps of the backward's row program (speed only, as fwd_warps)


def fwd_warps(h: int) -> int:
    """Warps of the forward's row program (speed only: every sum is the lane + tree order above,
    whatever the layout). One warp up to H = 4096: each 1,024-lane tree then runs in registers
    and warp shuffles, with no barrier between warps (H200, 2026-11-26: +10-19% at H 2048-4096);
    longer rows keep 4 warps (one warp measured equal there, or up to 4% slower)."""
    return 1 if h <= 4096 else 4


def block_for(h: int) -> int:
    """Columns per block: the next power of two of H, at most 1024 (part of the numerics)."""
    return min(MAX_BLOCK, max(16, 1 << (h - 1).bit_length()))


if triton is not None:

    @triton.jit
    def _row_rstd(X, H, h_f, eps, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        s1 = tl.zeros((1, BLOCK), tl.float32)
        s2 = tl.zeros((1, BLOCK), tl.float32)
        s3 = tl.zeros((1, BLOCK), tl.float32)
        for c0 in range(0, H, BLOCK):
            c = c0 + cols
            a1 = tl.load(X + c, mask=c < H, other=0.0, eviction_policy="evict_last").to(tl.float32)[
                None, :
            ]
            a2 = a1 * a1
            a3 = a2 * a1
            s1 += a1 * a1
            s2 += a2 * a2
            s3 += a3 * a3
        r1 = tl.div_rn(
            1.0, tl.sqrt_rn(tl.div_rn(_tree_sum_rows(s1, 1, BLOCK, LOG_BLOCK), h_f) + eps)
        )
        r2 = tl.div_rn(
            1.0, tl.sqrt_rn(tl.div_rn(_tree_sum_rows(s2, 1, BLOCK, LOG_BLOCK), h_f) + eps)
        )
        r3 = tl.div_rn(
            1.0, tl.sqrt_rn(tl.div_rn(_tree_sum_rows(s3, 1, BLOCK, LOG_BLOCK), h_f) + eps)
        )
        return r1, r2, r3

    @triton.jit
    def _row_setup(x_row, W, B, H, h_f, eps, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
        # the row's three inverse RMS values and the fp32 parameters (w0, w1, w2, b)
        r1, r2, r3 = _row_rstd(x_row, H, h_f, eps, BLOCK, LOG_BLOCK)
        w0 = tl.load(W).to(tl.float32)
        w1 = tl.load(W + 1).to(tl.float32)
        w2 = tl.load(W + 2).to(tl.float32)
        return r1, r2, r3, w0, w1, w2, tl.load(B).to(tl.float32)

    @triton.jit
    def _row_y(a1, r1, r2, r3, w0, w1, w2, b):
        a2 = a1 * a1
        a3 = a2 * a1
        return ((w0 * (a3 * r3[:, None]) + w1 * (a2 * r2[:, None])) + w2 * (a1 * r1[:, None])) + b

    @triton.jit
    def _poly_fwd_kernel(
        X,
        MUL,
        Y,
        W,
        B,
        H,
        h_f,
        stride_x,
        stride_m,
        stride_y,
        eps,
        HAS_MUL: tl.constexpr,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        r1, r2, r3, w0, w1, w2, b = _row_setup(x_row, W, B, H, h_f, eps, BLOCK, LOG_BLOCK)
        cols = tl.arange(0, BLOCK)
        nb = tl.cdiv(H, BLOCK)
        for i in range(0, nb):  # last block first: the ones the sums read last are cached
            c = (nb - 1 - i) * BLOCK + cols
            ok = (c < H)[None, :]
            a1 = tl.load(x_row + c, mask=c < H, other=0.0, eviction_policy="evict_first")
            a1 = a1.to(tl.float32)[None, :]
            y = _row_y(a1, r1, r2, r3, w0, w1, w2, b).to(Y.dtype.element_ty)
            if HAS_MUL:
                m = tl.load(MUL + row * stride_m + c, mask=c < H, other=0.0)[None, :]
                y = (y.to(tl.float32) * m.to(tl.float32)).to(Y.dtype.element_ty)
            tl.store(Y + row * stride_y + c[None, :], y, mask=ok)

    @triton.jit
    def _poly_bwd_kernel(
        G,
        X,
        MUL,
        DX,
        DMUL,
        PART,
        W,
        B,
        H,
        h_f,
        stride_g,
        stride_x,
        stride_m,
        stride_dx,
        stride_dm,
        eps,
        HAS_MUL: tl.constexpr,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        r1, r2, r3, w0, w1, w2, b = _row_setup(x_row, W, B, H, h_f, eps, BLOCK, LOG_BLOCK)
        cols = tl.arange(0, BLOCK)
        q1 = tl.zeros((1, BLOCK), tl.float32)
        q2 = tl.zeros((1, BLOCK), tl.float32)
        q3 = tl.zeros((1, BLOCK), tl.float32)
        p1 = tl.zeros((1, BLOCK), tl.float32)
        p2 = tl.zeros((1, BLOCK), tl.float32)
        p3 = tl.zeros((1, BLOCK), tl.float32)
        pb = tl.zeros((1, BLOCK), tl.float32)
        for c0 in range(0, H, BLOCK):
            c = c0 + cols
            a1 = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)[None, :]
            gr = tl.load(G + row * stride_g + c, mask=c < H, other=0.0)[None, :]
            if HAS_MUL:
                m = tl.load(MUL + row * stride_m + c, mask=c < H, other=0.0)[None, :]
                gr = (gr.to(tl.float32) * m.to(tl.float32)).to(X.dtype.element_ty)
            g = gr.to(tl.float32)
            a2 = a1 * a1
            a3 = a2 * a1
            n1 = a1 * r1[:, None]
            n2 = a2 * r2[:, None]
            n3 = a3 * r3[:, None]
            q1 += (g * w2) * n1
            q2 += (g * w1) * n2
            q3 += (g * w0) * n3
            p1 += g * n1
            p2 += g * n2
            p3 += g * n3
            pb += g
        c1 = tl.div_rn(_tree_sum_rows(q1, 1, BLOCK, LOG_BLOCK), h_f)
        c2 = tl.div_rn(_tree_sum_rows(q2, 1, BLOCK, LOG_BLOCK), h_f)
        c3 = tl.div_rn(_tree_sum_rows(q3, 1, BLOCK, LOG_BLOCK), h_f)
        part = PART + row * 4
        tl.store(part + tl.arange(0, 1), _tree_sum_rows(p3, 1, BLOCK, LOG_BLOCK))
        tl.store(part + 1 + tl.arange(0, 1), _tree_sum_rows(p2, 1, BLOCK, LOG_BLOCK))
        tl.store(part + 2 + tl.arange(0, 1), _tree_sum_rows(p1, 1, BLOCK, LOG_BLOCK))
        tl.store(part + 3 + tl.arange(0, 1), _tree_sum_rows(pb, 1, BLOCK, LOG_BLOCK))
        nb = tl.cdiv(H, BLOCK)
        for i in range(0, nb):  # last block first (cached), as in the forward
            c = (nb - 1 - i) * BLOCK + cols
            ok = (c < H)[None, :]
            a1 = tl.load(x_row + c, mask=c < H, other=0.0, eviction_policy="evict_first")
            a1 = a1.to(tl.float32)[None, :]
            gr = tl.load(
                G + row * stride_g + c, mask=c < H, other=0.0, eviction_policy="evict_first"
            )[None, :]
            if HAS_MUL:
                m = tl.load(
                    MUL + row * stride_m + c, mask=c < H, other=0.0, eviction_policy="evict_first"
                )[None, :]
                y = _row_y(a1, r1, r2, r3, w0, w1, w2, b).to(X.dtype.element_ty)
                dm = (gr.to(tl.float32) * y.to(tl.float32)).to(DMUL.dtype.element_ty)
                tl.store(DMUL + row * stride_dm + c[None, :], dm, mask=ok)
                gr = (gr.to(tl.float32) * m.to(tl.float32)).to(X.dtype.element_ty)
            g = gr.to(tl.float32)
            a2 = a1 * a1
            a3 = a2 * a1
            da1 = ((g * w2) - (a1 * r1[:, None]) * c1[:, None]) * r1[:, None]
            da2 = ((g * w1) - (a2 * r2[:, None]) * c2[:, None]) * r2[:, None]
            da3 = ((g * w0) - (a3 * r3[:, None]) * c3[:, None]) * r3[:, None]
            dx = (da1 + da2 * (2.0 * a1)) + da3 * (3.0 * a2)
            tl.store(DX + row * stride_dx + c[None, :], dx.to(DX.dtype.element_ty), mask=ok)

    @triton.jit
    def _sum_rows_kernel(PART, TMP, OUT, M, HALF, K: tl.constexpr, BLOCK: tl.constexpr,
                         LOG_BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                         LOG_RBLOCK: tl.constexpr):  # fmt: skip
        # OUT[j] = reference.sum_rows(PART)[j] for the K columns of PART [M, K] (fp32): the rows
        # zero-padded to 2 * HALF (a power of two), then element i of the first half + element
        # i of the second half, repeated. One program: while more than RBLOCK elements are
        # left, each level goes through TMP [K, HALF] (BLOCK rows a step); the last RBLOCK in
        # registers (more zero padding in front of a halving tree adds exact zeros)
        j = tl.arange(0, K)[:, None]
        if HALF * 2 <= RBLOCK:
            i = tl.arange(0, RBLOCK)[None, :]
            v = tl.load(PART + i * K + j, mask=i < M, other=0.0)
        else:
            for i0 in range(0, HALF, BLOCK):
                i = (i0 + tl.arange(0, BLOCK))[None, :]
                lo = tl.load(PART + i * K + j, mask=i < M, other=0.0)
                hi = tl.load(PART + (i + HALF) * K + j, mask=i + HALF < M, other=0.0)
                tl.store(TMP + j * HALF + i, lo + hi, mask=i < HALF)
            n = HALF
            while n > RBLOCK:
                tl.debug_barrier()  # the level above is written
                n = n // 2
                for i0 in range(0, n, BLOCK):
                    i = (i0 + tl.arange(0, BLOCK))[None, :]
                    lo = tl.load(TMP + j * HALF + i, mask=i < n, other=0.0)
                    hi = tl.load(TMP + j * HALF + i + n, mask=i < n, other=0.0)
                    tl.store(TMP + j * HALF + i, lo + hi, mask=i < n)
            tl.debug_barrier()
            i = tl.arange(0, RBLOCK)[None, :]
            v = tl.load(TMP + j * HALF + i, mask=i < n, other=0.0)
        tl.store(OUT + tl.arange(0, K), _tree_sum_rows(v, K, RBLOCK, LOG_RBLOCK))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [M, H] with a unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_fwd(x, weight, bias, eps, mul):
    _tr.check_device("poly_norm", x)
    h = x.shape[-1]
    x2 = _rows(x)
    m2 = _rows(mul) if mul is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    blk = block_for(h)
    if x2.shape[0]:
        with _tr.device_guard(x):
            _tr.launcher(_poly_fwd_kernel, x.device)[(x2.shape[0],)](
                x2, m2, y, weight.contiguous(), bias.contiguous(), h, float(h),
                x2.stride(0), m2.stride(0), y.stride(0), float(eps),
                HAS_MUL=mul is not None, BLOCK=blk, LOG_BLOCK=blk.bit_length() - 1,
                num_warps=fwd_warps(h), enable_fp_fusion=False,
            )  # fmt: skip
    return y.reshape(x.shape)


@signature_of(reference.poly_norm)
def poly_norm(*args: Any) -> torch.Tensor:
    """Batch-invariant PolyNorm in Triton (module docstring); same contract as the reference."""
    x, weight, bias, eps = args
    reference._check(x, weight, bias, eps)
    return _launch_fwd(x, weight, bias, eps, None)


@signature_of(reference.fused_mul_poly_norm)
def fused_mul_poly_norm(*args: Any) -> torch.Tensor:
    """``poly_norm(x) * mul`` in one pass (bitwise the unfused composition)."""
    x, mul, weight, bias, eps = args
    reference._check(x, weight, bias, eps, mul)
    return _launch_fwd(x, weight, bias, eps, mul)


def sum_rows(part: torch.Tensor) -> torch.Tensor:
    """:func:`reference.sum_rows` of fp32 ``part`` [M, K] (K a power of two), bitwise, in one
    program (:func:`_sum_rows_kernel`) instead of log2(M) launches."""
    m, k = part.shape
    if m < 2:
        return part.sum(0) if m == 0 else part[0]  # the tree's empty sum / single row
    half = (1 << (m - 1).bit_length()) // 2
    out = torch.empty((k,), dtype=torch.float32, device=part.device)
    tmp = torch.empty((k, half), dtype=torch.float32, device=part.device)
    with _tr.device_guard(part):
        _tr.launcher(_sum_rows_kernel, part.device)[(1,)](
            part.contiguous(), tmp, out, m, half, K=k, BLOCK=_SUM_BLOCK,
            LOG_BLOCK=_SUM_BLOCK.bit_length() - 1, RBLOCK=_SUM_RBLOCK,
            LOG_RBLOCK=_SUM_RBLOCK.bit_length() - 1, num_warps=8,
        )  # fmt: skip
    return out


@signature_of(reference.poly_norm_backward)
def poly_norm_backward(
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dx, dmul, dweight, dbias)`` as :func:`reference.poly_norm_backward`."""
    grad, x, weight, bias, eps, mul = args
    _tr.check_device("poly_norm", x)
    h = x.shape[-1]
    x2, g2 = _rows(x), _rows(grad.to(x.dtype))
    m2 = _rows(mul) if mul is not None else x2
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    dmul = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if mul is not None else None
    part = torch.empty((x2.shape[0], 4), dtype=torch.float32, device=x.device)
    blk = block_for(h)
    if x2.shape[0]:
        with _tr.device_guard(x):
            _tr.launcher(_poly_bwd_kernel, x.device)[(x2.shape[0],)](
                g2, x2, m2, dx, dmul if dmul is not None else dx, part,
                weight.contiguous(), bias.contiguous(), h, float(h),
                g2.stride(0), x2.stride(0), m2.stride(0), dx.stride(0),
                (dmul if dmul is not None else dx).stride(0), float(eps),
                HAS_MUL=mul is not None, BLOCK=blk, LOG_BLOCK=blk.bit_length() - 1,
                num_warps=BWD_WARPS, enable_fp_fusion=False,
            )  # fmt: skip
    sums = sum_rows(part)
    return (
        dx.reshape(x.shape),
        dmul.reshape(x.shape) if dmul is not None else None,
        sums[:3],
        sums[3:],
    )


PROVIDER = _tr.triton_provider(
    op="poly_norm",
    numerics=f"poly_norm/triton-b{MAX_BLOCK}",
    fn=poly_norm,
    version="2",
    extras={"fused_mul": fused_mul_poly_norm, "backward": poly_norm_backward},
)
