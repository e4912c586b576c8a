"""``triton`` provider of ``poly_norm`` / ``fused_mul_poly_norm``.

Numerics (family ``poly_norm/triton-b{LANES}``, version 3): one program per row. The row is
visited in blocks of ``BLOCK = min(LANES, pow2(H))`` columns from column 0 (``LANES`` = 256);
sums are kept per lane (lane ``j`` holds columns ``j, j + BLOCK, ...``, added in column order)
and each lane vector is summed once by a fixed halving tree (``logp``'s ``_tree_sum_rows``), so
a row's reductions depend on H alone, never on the layout the compiler picks, on the launch
setup (:class:`Config`: warps, blocks per loop step) or on other rows::

    a1 = x.float(); a2 = a1 * a1; a3 = a2 * a1
    r_k = 1 / sqrt_rn(tree(lanes of a_k^2) / H + eps)
    y32 = ((w0 * (a3 * r3) + w1 * (a2 * r2)) + w2 * (a1 * r1)) + b
    y = y32.to(x.dtype);  fused: (y.float() * mul.float()).to(x.dtype)

Backward: ``g`` (fused: ``(grad * mul)`` rounded to x's dtype), ``n_k = a_k r_k``. One pass
over the row gathers the three mean squares and ``t_k = tree(lanes of g * a_k)``,
``t_b = tree(lanes of g)``; since ``sum(g n_k) = r_k sum(g a_k)``, the weights' per-row
partials are ``p_k = r_k t_k`` and the reference's ``c_k = sum(g_k n_k) / H`` is ``(w_k p_k) /
H``; a second pass writes ``da_k = (g_k - n_k c_k) r_k``, ``dx = ((da1 + da2 (2 a1)) + da3 (3
a2)).to(x.dtype)`` (fused: and ``dmul = (grad * y)`` rounded). The partials ``[p3, p2, p1,
t_b]`` of each row are summed over rows by the reference's pairwise tree (:func:`sum_rows`: one
program, bitwise :func:`reference.sum_rows`, instead of its log2(M) launches). Row invariant;
dweight / dbias deterministic. Not promised: the ``native`` family's bits (the factored sums
round differently from the reference's ``sum(g_k n_k)``; within the gradient tolerance, and
``g * a3`` can overflow fp32 where ``g * n3`` would not: |x| ~ 1e10 with |g| ~ 1e9).

Structure (version 3): the whole blocks run without masks, ``unroll`` of them per loop step
(:func:`_unroll`); the masked tail block, if any, apart. In the sums the step's loads come
first (no store in that loop), then the adds in column order. The elementwise pass reads the
step's blocks as one ``[unroll, BLOCK]`` tile, so their loads go out together: a store between
two loads keeps them in order (the pointers may alias). The backward reads x and grad twice
(version 2: x three times, its first pass only for the mean squares). A row's work is the
``@triton.jit`` helpers ``_fwd_row`` / ``_bwd_row`` (parameters as fp32 values, partials at a
given address) and the row sum ``_sum_rows``; the kernels only place them (``grouped_poly_norm``'s
Triton provider calls the same helpers with each row's expert). Factoring them out left the
compiled kernels as they were: sm_90 TTGIR, LLVM IR and PTX identical without debug lines,
Triton 3.9 on the CPU (2026-11-28).

Why 256 lanes, one warp: the sums' registers are lanes x sums / threads. Version 2 kept 1024
lanes: its backward (seven sums) needed 167 registers a thread at two warps, six programs an
SM, one block of x and grad (4 KB) in flight each; version 3 at 256 lanes and one warp takes
92-116 registers with eight blocks a step (17-22 programs an SM, 8-12 KB each in flight),
the forward 58-69 (32 programs, 4-8 KB each). Compiled for sm_90a with the GPU images' Triton
3.6 and its ptxas: no spills (2026-11-27). **Not yet run on a GPU**: ``bash
scripts/gpu_poly_norm.sh`` (the launch-setup sweep, with ``OLD=`` a version-2 file for an A/B,
the GPU tests, fuzzing) is the one device call that times and checks it there; version 2's
figures are in the poly_norm page.

Not taken: one halving tree over the whole (padded) row, which would let a row stay in
registers (read once): on an H100 (2026-11-26) trees of 2048-8192 lanes ran the forward 5-10x
slower than lanes (every tree level is a layout change through shared memory, so a tree's
cost grows as N log N; a sequential lane sum is register adds and one small tree).
Also not taken (H200, 2026-11-26, version 2, same bits): the three (backward: seven) lane
vectors joined into one [4, BLOCK] / [8, BLOCK] tile (``tl.join`` + ``tl.permute``) and reduced
by one stacked tree: 2-17x slower (10x the warp shuffles of three trees). Kept from version 2:
the sums' loads marked ``evict_last`` and the elementwise pass walking the blocks last to first
with ``evict_first`` (the blocks read last are the ones still cached; H200 A/B: forward +5%,
backward +12%), few warps per row program (short rows +10-27%). Measured in
``benchmarks/results/h200/poly_norm_stacked_tree_rejected/``.

Every kernel launches with ``enable_fp_fusion=False``: each product and sum above rounds as
written. With contraction on, the compiler chose where to fuse a multiply into an add per
kernel, and the ``HAS_MUL`` specialisation fused differently from the plain one: the H200 fuzz
run of 2026-11-26 found ``fused_mul_poly_norm`` 1-2 ulps off ``poly_norm(x) * mul`` on 16 of
~800 cases (seeds in ``tests/test_fuzz.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.poly_norm import reference

if triton is not None:
    from rl_engine.ops.logp.triton import _tree_sum_rows

__all__ = ["PROVIDER", "fused_mul_poly_norm", "poly_norm", "poly_norm_backward"]

LANES = 256
_SUM_BLOCK = 2048  # rows per step of the row-sum program's levels in memory (speed only)
_SUM_RBLOCK = 2048  # rows of its last levels, in registers (speed only)


class Config(NamedTuple):
    """Launch setup of a row program. ``warps`` and ``unroll`` (blocks loaded per loop step)
    are speed only: every sum is the lane + tree order of the module docstring whatever they
    are. ``lanes`` is part of the numerics; anything but :data:`LANES` is for experiments
    (``benchmarks/sweep_poly_norm.py``) and changes the family."""

    lanes: int
    warps: int
    unroll: int


def _checked(cfg: Config) -> Config:
    for name, v, lo in (
        ("lanes", cfg.lanes, 16),
        ("warps", cfg.warps, 1),
        ("unroll", cfg.unroll, 1),
    ):
        if v < lo or v & (v - 1):
            raise ValueError(f"poly_norm[triton]: {name} must be a power of two >= {lo}, got {v}")
    return cfg


def _unroll(h: int, lanes: int) -> int:
    """Blocks per loop step: the largest power of two up to 8 that divides the row's whole
    blocks, so every whole block goes through the unrolled steps (speed only)."""
    n = h // lanes
    return min(8, n & -n) if n else 1


def launch_config(h: int) -> Config:
    """The launch setup of the forward and the backward for rows of ``h`` columns: one warp per
    row program, ``unroll`` as :func:`_unroll`. The forward's three lane vectors of 256 take 24
    registers a thread (58-69 with up to 8 blocks a step in flight: 32 programs an SM), the
    backward's seven 92-116 (17-22 programs)."""
    return Config(LANES, 1, _unroll(h, LANES))


def block_for(h: int, lanes: int = LANES) -> int:
    """Columns per block (= lanes): the next power of two of H, at most ``lanes`` (part of the
    numerics)."""
    return min(lanes, max(16, 1 << (h - 1).bit_length()))


if triton is not None:

    @triton.jit
    def _load_f32(ptr, c, H, MASKED: tl.constexpr, POLICY: tl.constexpr):
        # a row's columns at the offsets c (a [rows, BLOCK] tile) in fp32; masked: 0 past H
        if MASKED:
            v = tl.load(ptr + c, mask=c < H, other=0.0, eviction_policy=POLICY)
        else:
            v = tl.load(ptr + c, eviction_policy=POLICY)
        return v.to(tl.float32)

    @triton.jit
    def _grad_f32(G, MUL, c, H, HAS_MUL: tl.constexpr, MASKED: tl.constexpr,
                  POLICY: tl.constexpr, OUT_TY: tl.constexpr):  # fmt: skip
        # g of the module docstring: grad (fused: grad * mul rounded to x's dtype), fp32
        g = _load_f32(G, c, H, MASKED, POLICY)
        if HAS_MUL:
            m = _load_f32(MUL, c, H, MASKED, POLICY)
            g = (g * m).to(OUT_TY).to(tl.float32)
        return g

    @triton.jit
    def _sq_sums(a1, s1, s2, s3):
        # one block's terms of the three mean squares, added to the lane sums
        a2 = a1 * a1
        a3 = a2 * a1
        return s1 + a2, s2 + a2 * a2, s3 + a3 * a3

    @triton.jit
    def _rstd(s, h_f, eps, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
        return tl.div_rn(
            1.0, tl.sqrt_rn(tl.div_rn(_tree_sum_rows(s, 1, BLOCK, LOG_BLOCK), h_f) + eps)
        )

    @triton.jit
    def _row_rstd(X, H, h_f, eps, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr,
                  UNROLL: tl.constexpr):  # fmt: skip
        # the row's three inverse RMS values: lane sums over the blocks in column order, the
        # whole blocks UNROLL per step without masks, then the rest (the last one masked)
        cols = tl.arange(0, BLOCK)[None, :]
        s1 = tl.zeros((1, BLOCK), tl.float32)
        s2 = tl.zeros((1, BLOCK), tl.float32)
        s3 = tl.zeros((1, BLOCK), tl.float32)
        n_full = H // BLOCK
        n_main = n_full - n_full % UNROLL
        for b0 in range(0, n_main, UNROLL):
            for u in tl.static_range(UNROLL):
                a1 = _load_f32(X, (b0 + u) * BLOCK + cols, H, False, "evict_last")
                s1, s2, s3 = _sq_sums(a1, s1, s2, s3)
        for b in range(n_main, tl.cdiv(H, BLOCK)):
            a1 = _load_f32(X, b * BLOCK + cols, H, True, "evict_last")
            s1, s2, s3 = _sq_sums(a1, s1, s2, s3)
        return (_rstd(s1, h_f, eps, BLOCK, LOG_BLOCK), _rstd(s2, h_f, eps, BLOCK, LOG_BLOCK),
                _rstd(s3, h_f, eps, BLOCK, LOG_BLOCK))  # fmt: skip

    @triton.jit
    def _params(W, B):
        w0 = tl.load(W).to(tl.float32)
        w1 = tl.load(W + 1).to(tl.float32)
        w2 = tl.load(W + 2).to(tl.float32)
        return w0, w1, w2, tl.load(B).to(tl.float32)

    @triton.jit
    def _row_y(a1, r1, r2, r3, w0, w1, w2, b):
        a2 = a1 * a1
        a3 = a2 * a1
        return ((w0 * (a3 * r3[:, None]) + w1 * (a2 * r2[:, None])) + w2 * (a1 * r1[:, None])) + b

    @triton.jit
    def _fwd_block(x_row, m_row, y_row, c, H, r1, r2, r3, w0, w1, w2, b,
                   HAS_MUL: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
        a1 = _load_f32(x_row, c, H, MASKED, "evict_first")
        y = _row_y(a1, r1, r2, r3, w0, w1, w2, b).to(y_row.dtype.element_ty)
        if HAS_MUL:
            m = _load_f32(m_row, c, H, MASKED, "evict_first")
            y = (y.to(tl.float32) * m).to(y_row.dtype.element_ty)
        if MASKED:
            tl.store(y_row + c, y, mask=c < H)
        else:
            tl.store(y_row + c, y)

    @triton.jit
    def _fwd_row(x_row, m_row, y_row, w0, w1, w2, b, H, h_f, eps, HAS_MUL: tl.constexpr,
                 BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
        # one row's forward (the module docstring), its parameters given as fp32 values: the
        # body of _poly_fwd_kernel, shared with grouped_poly_norm's (its expert's parameters)
        r1, r2, r3 = _row_rstd(x_row, H, h_f, eps, BLOCK, LOG_BLOCK, UNROLL)
        cols = tl.arange(0, BLOCK)[None, :]
        # elementwise, so any block order: the last (masked) block first, then the whole ones
        # from last to first (the blocks the sums read last are the ones still cached), UNROLL
        # blocks as one [UNROLL, BLOCK] tile: their loads go out together (a store between
        # loads would order them)
        n_full = H // BLOCK
        for t in range(n_full, tl.cdiv(H, BLOCK)):
            _fwd_block(x_row, m_row, y_row, t * BLOCK + cols, H, r1, r2, r3, w0, w1, w2, b,
                       HAS_MUL, True)  # fmt: skip
        n_main = n_full - n_full % UNROLL
        steps = tl.arange(0, UNROLL)[:, None]
        for i0 in range(0, n_main, UNROLL):
            c = (n_full - UNROLL - i0 + steps) * BLOCK + cols
            _fwd_block(x_row, m_row, y_row, c, H, r1, r2, r3, w0, w1, w2, b, HAS_MUL, False)
        for i in range(n_main, n_full):
            c = (n_full - 1 - i) * BLOCK + cols
            _fwd_block(x_row, m_row, y_row, c, H, r1, r2, r3, w0, w1, w2, b, HAS_MUL, False)

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
        UNROLL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        w0, w1, w2, b = _params(W, B)
        _fwd_row(X + row * stride_x, MUL + row * stride_m, Y + row * stride_y, w0, w1, w2, b,
                 H, h_f, eps, HAS_MUL, BLOCK, LOG_BLOCK, UNROLL)  # fmt: skip

    @triton.jit
    def _bwd_sums(a1, g, s1, s2, s3, u1, u2, u3, ub):
        # one block's terms of the mean squares and of sum(g * a_k), sum(g)
        a2 = a1 * a1
        a3 = a2 * a1
        return (s1 + a2, s2 + a2 * a2, s3 + a3 * a3, u1 + g * a1, u2 + g * a2, u3 + g * a3,
                ub + g)  # fmt: skip

    @triton.jit
    def _bwd_block(x_row, g_row, m_row, dx_row, dm_row, c, H, r1, r2, r3, c1, c2, c3,
                   w0, w1, w2, b, HAS_MUL: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
        a1 = _load_f32(x_row, c, H, MASKED, "evict_first")
        g = _load_f32(g_row, c, H, MASKED, "evict_first")
        if HAS_MUL:
            m = _load_f32(m_row, c, H, MASKED, "evict_first")
            y = _row_y(a1, r1, r2, r3, w0, w1, w2, b).to(dx_row.dtype.element_ty)
            dm = (g * y.to(tl.float32)).to(dm_row.dtype.element_ty)
            g = (g * m).to(dx_row.dtype.element_ty).to(tl.float32)
        a2 = a1 * a1
        a3 = a2 * a1
        da1 = ((g * w2) - (a1 * r1[:, None]) * c1[:, None]) * r1[:, None]
        da2 = ((g * w1) - (a2 * r2[:, None]) * c2[:, None]) * r2[:, None]
        da3 = ((g * w0) - (a3 * r3[:, None]) * c3[:, None]) * r3[:, None]
        dx = ((da1 + da2 * (2.0 * a1)) + da3 * (3.0 * a2)).to(dx_row.dtype.element_ty)
        if MASKED:
            tl.store(dx_row + c, dx, mask=c < H)
            if HAS_MUL:
                tl.store(dm_row + c, dm, mask=c < H)
        else:
            tl.store(dx_row + c, dx)
            if HAS_MUL:
                tl.store(dm_row + c, dm)

    @triton.jit
    def _bwd_row(g_row, x_row, m_row, dx_row, dm_row, part, w0, w1, w2, b, H, h_f, eps,
                 HAS_MUL: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr,
                 UNROLL: tl.constexpr):  # fmt: skip
        # one row's backward: dx (dmul) and the row's four partials [p3, p2, p1, t_b] at
        # ``part``; the body of _poly_bwd_kernel, shared with grouped_poly_norm's
        cols = tl.arange(0, BLOCK)[None, :]
        # one pass: the mean squares and sum(g * a_k), sum(g), as lane sums in column order
        s1 = tl.zeros((1, BLOCK), tl.float32)
        s2 = tl.zeros((1, BLOCK), tl.float32)
        s3 = tl.zeros((1, BLOCK), tl.float32)
        u1 = tl.zeros((1, BLOCK), tl.float32)
        u2 = tl.zeros((1, BLOCK), tl.float32)
        u3 = tl.zeros((1, BLOCK), tl.float32)
        ub = tl.zeros((1, BLOCK), tl.float32)
        n_full = H // BLOCK
        n_main = n_full - n_full % UNROLL
        ty = x_row.dtype.element_ty
        for b0 in range(0, n_main, UNROLL):
            for u in tl.static_range(UNROLL):
                c = (b0 + u) * BLOCK + cols
                a1 = _load_f32(x_row, c, H, False, "evict_last")
                g = _grad_f32(g_row, m_row, c, H, HAS_MUL, False, "evict_last", ty)
                s1, s2, s3, u1, u2, u3, ub = _bwd_sums(a1, g, s1, s2, s3, u1, u2, u3, ub)
        for t in range(n_main, tl.cdiv(H, BLOCK)):
            c = t * BLOCK + cols
            a1 = _load_f32(x_row, c, H, True, "evict_last")
            g = _grad_f32(g_row, m_row, c, H, HAS_MUL, True, "evict_last", ty)
            s1, s2, s3, u1, u2, u3, ub = _bwd_sums(a1, g, s1, s2, s3, u1, u2, u3, ub)
        r1 = _rstd(s1, h_f, eps, BLOCK, LOG_BLOCK)
        r2 = _rstd(s2, h_f, eps, BLOCK, LOG_BLOCK)
        r3 = _rstd(s3, h_f, eps, BLOCK, LOG_BLOCK)
        # sum(g * n_k) = r_k * sum(g * a_k): the weights' partials and, times w_k / H, c_k
        p1 = r1 * _tree_sum_rows(u1, 1, BLOCK, LOG_BLOCK)
        p2 = r2 * _tree_sum_rows(u2, 1, BLOCK, LOG_BLOCK)
        p3 = r3 * _tree_sum_rows(u3, 1, BLOCK, LOG_BLOCK)
        c1 = tl.div_rn(w2 * p1, h_f)
        c2 = tl.div_rn(w1 * p2, h_f)
        c3 = tl.div_rn(w0 * p3, h_f)
        tl.store(part + tl.arange(0, 1), p3)
        tl.store(part + 1 + tl.arange(0, 1), p2)
        tl.store(part + 2 + tl.arange(0, 1), p1)
        tl.store(part + 3 + tl.arange(0, 1), _tree_sum_rows(ub, 1, BLOCK, LOG_BLOCK))
        # dx (and dmul), elementwise: the masked block first, then the whole ones last to first
        # in [UNROLL, BLOCK] tiles, as in the forward
        for t in range(n_full, tl.cdiv(H, BLOCK)):
            _bwd_block(x_row, g_row, m_row, dx_row, dm_row, t * BLOCK + cols, H, r1, r2, r3,
                       c1, c2, c3, w0, w1, w2, b, HAS_MUL, True)  # fmt: skip
        steps = tl.arange(0, UNROLL)[:, None]
        for i0 in range(0, n_main, UNROLL):
            c = (n_full - UNROLL - i0 + steps) * BLOCK + cols
            _bwd_block(x_row, g_row, m_row, dx_row, dm_row, c, H, r1, r2, r3, c1, c2, c3,
                       w0, w1, w2, b, HAS_MUL, False)  # fmt: skip
        for i in range(n_main, n_full):
            c = (n_full - 1 - i) * BLOCK + cols
            _bwd_block(x_row, g_row, m_row, dx_row, dm_row, c, H, r1, r2, r3, c1, c2, c3,
                       w0, w1, w2, b, HAS_MUL, False)  # fmt: skip

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
        UNROLL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        w0, w1, w2, b = _params(W, B)
        _bwd_row(G + row * stride_g, X + row * stride_x, MUL + row * stride_m,
                 DX + row * stride_dx, DMUL + row * stride_dm, PART + row * 4, w0, w1, w2, b,
                 H, h_f, eps, HAS_MUL, BLOCK, LOG_BLOCK, UNROLL)  # fmt: skip

    @triton.jit
    def _sum_rows(PART, TMP, OUT, M, HALF, K: tl.constexpr, BLOCK: tl.constexpr,
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

    @triton.jit
    def _sum_rows_kernel(PART, TMP, OUT, M, HALF, K: tl.constexpr, BLOCK: tl.constexpr,
                         LOG_BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                         LOG_RBLOCK: tl.constexpr):  # fmt: skip
        _sum_rows(PART, TMP, OUT, M, HALF, K, BLOCK, LOG_BLOCK, RBLOCK, LOG_RBLOCK)


def _launch_fwd(x, weight, bias, eps, mul, cfg: Config | None = None):
    _triton.check_device("poly_norm", x)
    h = x.shape[-1]
    cfg = launch_config(h) if cfg is None else _checked(cfg)
    x2 = _triton.rows(x)
    m2 = _triton.rows(mul) if mul is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    blk = block_for(h, cfg.lanes)
    if x2.shape[0]:
        with _triton.device_guard(x):
            _triton.launcher(_poly_fwd_kernel, x.device)[(x2.shape[0],)](
                x2, m2, y, weight.contiguous(), bias.contiguous(), h, float(h),
                x2.stride(0), m2.stride(0), y.stride(0), float(eps),
                HAS_MUL=mul is not None, BLOCK=blk, LOG_BLOCK=blk.bit_length() - 1,
                UNROLL=cfg.unroll, num_warps=cfg.warps, enable_fp_fusion=False,
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
    with _triton.device_guard(part):
        _triton.launcher(_sum_rows_kernel, part.device)[(1,)](
            part.contiguous(), tmp, out, m, half, K=k, BLOCK=_SUM_BLOCK,
            LOG_BLOCK=_SUM_BLOCK.bit_length() - 1, RBLOCK=_SUM_RBLOCK,
            LOG_RBLOCK=_SUM_RBLOCK.bit_length() - 1, num_warps=8,
        )  # fmt: skip
    return out


def _launch_bwd(grad, x, weight, bias, eps, mul, cfg: Config | None = None):
    _triton.check_device("poly_norm", x)
    h = x.shape[-1]
    cfg = launch_config(h) if cfg is None else _checked(cfg)
    x2, g2 = _triton.rows(x), _triton.rows(grad.to(x.dtype))
    m2 = _triton.rows(mul) if mul is not None else x2
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    dmul = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if mul is not None else None
    part = torch.empty((x2.shape[0], 4), dtype=torch.float32, device=x.device)
    blk = block_for(h, cfg.lanes)
    if x2.shape[0]:
        dm = dmul if dmul is not None else dx
        with _triton.device_guard(x):
            _triton.launcher(_poly_bwd_kernel, x.device)[(x2.shape[0],)](
                g2, x2, m2, dx, dm, part, weight.contiguous(), bias.contiguous(), h, float(h),
                g2.stride(0), x2.stride(0), m2.stride(0), dx.stride(0), dm.stride(0),
                float(eps), HAS_MUL=mul is not None, BLOCK=blk,
                LOG_BLOCK=blk.bit_length() - 1, UNROLL=cfg.unroll, num_warps=cfg.warps,
                enable_fp_fusion=False,
            )  # fmt: skip
    sums = sum_rows(part)
    return (
        dx.reshape(x.shape),
        dmul.reshape(x.shape) if dmul is not None else None,
        sums[:3],
        sums[3:],
    )


@signature_of(reference.poly_norm_backward)
def poly_norm_backward(
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dx, dmul, dweight, dbias)`` as :func:`reference.poly_norm_backward`."""
    grad, x, weight, bias, eps, mul = args
    return _launch_bwd(grad, x, weight, bias, eps, mul)


PROVIDER = _triton.triton_provider(
    numerics=f"poly_norm/triton-b{LANES}",
    fn=poly_norm,
    version="3",
    extras={"fused_mul": fused_mul_poly_norm, "backward": poly_norm_backward},
)
