"""``triton`` provider of ``poly_norm`` / ``fused_mul_poly_norm``.

Numerics (family ``poly_norm/triton-c{CHUNK}``, version 3): one program per row. A row of H
columns is cut into chunks of ``C = min(8192, pow2(H))`` columns (zero padded); each sum over
the row is a halving tree over every chunk (first half + second half, repeated), then a
halving tree over the chunk sums (their count padded to a power of two with zeros). So a row's
reductions depend on H alone, never on the layout the compiler picks or on other rows (with
one chunk, H <= 8192, the order of the reference's :func:`~rl_engine.ops._common.tree_sum`; the
bits are still not promised equal to ``native``'s: torch may divide by H as a multiply by 1/H)::

    a1 = x.float(); a2 = a1 * a1; a3 = a2 * a1
    r_k = 1 / sqrt_rn(tree(a_k^2) / H + eps)
    y32 = ((w0 * (a3 * r3) + w1 * (a2 * r2)) + w2 * (a1 * r1)) + b
    y = y32.to(x.dtype);  fused: (y.float() * mul.float()).to(x.dtype)

Backward, the reference's expressions with the same trees: ``g`` (fused: ``(grad * mul)``
rounded), ``c_k = tree(g_k * n_k) / H``, ``da_k = (g_k - n_k c_k) r_k``, ``dx = ((da1 + da2 (2
a1)) + da3 (3 a2)).to(x.dtype)``; the per-row partials ``tree(g * n_k)`` and ``tree(g)`` are
summed over the rows by the reference's pairwise tree (:func:`reference.sum_rows`), computed by
one program (:func:`_sum_rows_kernel`). Row invariant; dweight / dbias deterministic.

Memory traffic: a row of up to ``RESIDENT_FWD`` (forward) / ``RESIDENT_BWD`` (backward)
padded columns is loaded once and kept in registers (one read of x, grad, mul; one write);
longer rows stream chunk by chunk, reading x two (forward) or three (backward) times. Version 2
(lanes of 1024 columns summed in column order, every row read that way) ran at 0.6 / 0.4 of the
copy bandwidth on an H100; the chunk trees are what lets a row stay in registers.

Every kernel launches with ``enable_fp_fusion=False``: each product and sum above rounds as
written. With contraction on, the compiler chose where to fuse a multiply into an add per
kernel, and the ``HAS_MUL`` specialisation fused differently from the plain one: the H200 fuzz
run of 2026-11-26 found ``fused_mul_poly_norm`` 1-2 ulps off ``poly_norm(x) * mul`` on 16 of
~800 cases (seeds in ``tests/test_fuzz.py``).
"""

from __future__ import annotations

import torch

from rl_engine.ops import _triton as _tr
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.poly_norm import reference

if triton is not None:
    from rl_engine.ops.logp.triton import _tree_sum_rows

__all__ = ["PROVIDER", "fused_mul_poly_norm", "poly_norm", "poly_norm_backward"]

CHUNK = 8192  # columns per chunk at most: part of the numerics
RESIDENT_FWD = 16384  # padded columns a forward program keeps in registers (speed only)
RESIDENT_BWD = 8192  # the same for the backward (it holds x and grad)
_SUM_BLOCK = 2048  # rows per step of the row-sum program's levels in memory (speed only)
_SUM_RBLOCK = 2048  # rows of its last levels, in registers (speed only)


def chunk_for(h: int) -> int:
    """Columns per chunk: the next power of two of H, at most ``CHUNK`` (part of the numerics)."""
    return min(CHUNK, max(16, 1 << (h - 1).bit_length()))


if triton is not None:

    @triton.jit
    def _sq_sums(a1, ROWS: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr):
        # [ROWS] halving-tree sums of a_k^2 over each row of a [ROWS, C] tile of chunks
        a2 = a1 * a1
        a3 = a2 * a1
        t1 = _tree_sum_rows(a1 * a1, ROWS, C, LOG_C)
        t2 = _tree_sum_rows(a2 * a2, ROWS, C, LOG_C)
        t3 = _tree_sum_rows(a3 * a3, ROWS, C, LOG_C)
        return t1, t2, t3

    @triton.jit
    def _rstd(t, h_f, eps, NCH: tl.constexpr, LOG_NCH: tl.constexpr):
        # 1 / sqrt(tree(chunk sums) / H + eps): the chunk sums' tree, [1]
        s = _tree_sum_rows(t[None, :], 1, NCH, LOG_NCH)
        return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(s, h_f) + eps))

    @triton.jit
    def _put(vec, k, val, NCH: tl.constexpr):
        # vec[k] = val (an exact select: the chunk sums of a streamed row)
        return tl.where(tl.arange(0, NCH) == k, val, vec)

    @triton.jit
    def _params(W, B):
        return (tl.load(W).to(tl.float32), tl.load(W + 1).to(tl.float32),
                tl.load(W + 2).to(tl.float32), tl.load(B).to(tl.float32))  # fmt: skip

    @triton.jit
    def _cols(k, ROWS: tl.constexpr, C: tl.constexpr):
        # column indices of chunks k .. k + ROWS - 1 as a [ROWS, C] tile
        return (k + tl.arange(0, ROWS))[:, None] * C + tl.arange(0, C)[None, :]

    @triton.jit
    def _y(a1, r1, r2, r3, w0, w1, w2, b):
        a2 = a1 * a1
        a3 = a2 * a1
        return ((w0 * (a3 * r3[:, None]) + w1 * (a2 * r2[:, None])) + w2 * (a1 * r1[:, None])) + b

    @triton.jit
    def _store_y(Y, MUL, row, c, a1, r1, r2, r3, w0, w1, w2, b, H, stride_m, stride_y,
                 HAS_MUL: tl.constexpr):  # fmt: skip
        ok = c < H
        y = _y(a1, r1, r2, r3, w0, w1, w2, b).to(Y.dtype.element_ty)
        if HAS_MUL:
            m = tl.load(MUL + row * stride_m + c, mask=ok, other=0.0)
            y = (y.to(tl.float32) * m.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * stride_y + c, y, mask=ok)

    @triton.jit
    def _stream_rstd(x_row, H, h_f, eps, C: tl.constexpr, LOG_C: tl.constexpr,
                     NCH: tl.constexpr, LOG_NCH: tl.constexpr):  # fmt: skip
        # the three inverse RMS values of a row read chunk by chunk
        t1 = tl.zeros((NCH,), tl.float32)
        t2 = tl.zeros((NCH,), tl.float32)
        t3 = tl.zeros((NCH,), tl.float32)
        for k in range(0, tl.cdiv(H, C)):
            c = _cols(k, 1, C)
            a1 = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
            s1, s2, s3 = _sq_sums(a1, 1, C, LOG_C)
            t1 = _put(t1, k, s1, NCH)
            t2 = _put(t2, k, s2, NCH)
            t3 = _put(t3, k, s3, NCH)
        r1 = _rstd(t1, h_f, eps, NCH, LOG_NCH)
        r2 = _rstd(t2, h_f, eps, NCH, LOG_NCH)
        r3 = _rstd(t3, h_f, eps, NCH, LOG_NCH)
        return r1, r2, r3

    @triton.jit
    def _poly_fwd_kernel(X, MUL, Y, W, B, H, h_f, stride_x, stride_m, stride_y, eps,
                         HAS_MUL: tl.constexpr, RESIDENT: tl.constexpr, C: tl.constexpr,
                         LOG_C: tl.constexpr, NCH: tl.constexpr, LOG_NCH: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        w0, w1, w2, b = _params(W, B)
        if RESIDENT:  # the whole row in registers: one read
            c = _cols(0, NCH, C)
            a1 = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
            t1, t2, t3 = _sq_sums(a1, NCH, C, LOG_C)
            r1 = _rstd(t1, h_f, eps, NCH, LOG_NCH)
            r2 = _rstd(t2, h_f, eps, NCH, LOG_NCH)
            r3 = _rstd(t3, h_f, eps, NCH, LOG_NCH)
            _store_y(Y, MUL, row, c, a1, r1, r2, r3, w0, w1, w2, b, H, stride_m, stride_y,
                     HAS_MUL)  # fmt: skip
        else:
            r1, r2, r3 = _stream_rstd(x_row, H, h_f, eps, C, LOG_C, NCH, LOG_NCH)
            for k in range(0, tl.cdiv(H, C)):
                c = _cols(k, 1, C)
                a1 = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
                _store_y(Y, MUL, row, c, a1, r1, r2, r3, w0, w1, w2, b, H, stride_m, stride_y,
                         HAS_MUL)  # fmt: skip

    @triton.jit
    def _load_g(G, MUL, row, c, ok, stride_g, stride_m, X_TY: tl.constexpr,
                HAS_MUL: tl.constexpr):  # fmt: skip
        # the gradient the norm sees (fused: (grad * mul) rounded to x's dtype) and grad itself
        gr = tl.load(G + row * stride_g + c, mask=ok, other=0.0)
        gn = gr
        if HAS_MUL:
            m = tl.load(MUL + row * stride_m + c, mask=ok, other=0.0)
            gn = (gr.to(tl.float32) * m.to(tl.float32)).to(X_TY)
        return gn.to(tl.float32), gr

    @triton.jit
    def _grad_sums(a1, g, r1, r2, r3, w0, w1, w2, ROWS: tl.constexpr, C: tl.constexpr,
                   LOG_C: tl.constexpr):  # fmt: skip
        # per tile row: tree(g_k n_k) (k = 1, 2, 3), tree(g n_k) (k = 3, 2, 1), tree(g)
        a2 = a1 * a1
        a3 = a2 * a1
        n1 = a1 * r1[:, None]
        n2 = a2 * r2[:, None]
        n3 = a3 * r3[:, None]
        q1 = _tree_sum_rows((g * w2) * n1, ROWS, C, LOG_C)
        q2 = _tree_sum_rows((g * w1) * n2, ROWS, C, LOG_C)
        q3 = _tree_sum_rows((g * w0) * n3, ROWS, C, LOG_C)
        p3 = _tree_sum_rows(g * n3, ROWS, C, LOG_C)
        p2 = _tree_sum_rows(g * n2, ROWS, C, LOG_C)
        p1 = _tree_sum_rows(g * n1, ROWS, C, LOG_C)
        pb = _tree_sum_rows(g, ROWS, C, LOG_C)
        return q1, q2, q3, p3, p2, p1, pb

    @triton.jit
    def _store_dx(DX, DMUL, row, c, ok, a1, g, gr, r1, r2, r3, c1, c2, c3, w0, w1, w2, b,
                  stride_dx, stride_dm, HAS_MUL: tl.constexpr):  # fmt: skip
        if HAS_MUL:  # dmul = (grad * poly_norm(x)) rounded
            y = _y(a1, r1, r2, r3, w0, w1, w2, b).to(DX.dtype.element_ty)
            dm = (gr.to(tl.float32) * y.to(tl.float32)).to(DMUL.dtype.element_ty)
            tl.store(DMUL + row * stride_dm + c, dm, mask=ok)
        a2 = a1 * a1
        da1 = ((g * w2) - (a1 * r1[:, None]) * c1[:, None]) * r1[:, None]
        da2 = ((g * w1) - (a2 * r2[:, None]) * c2[:, None]) * r2[:, None]
        da3 = ((g * w0) - ((a2 * a1) * r3[:, None]) * c3[:, None]) * r3[:, None]
        dx = (da1 + da2 * (2.0 * a1)) + da3 * (3.0 * a2)
        tl.store(DX + row * stride_dx + c, dx.to(DX.dtype.element_ty), mask=ok)

    @triton.jit
    def _poly_bwd_kernel(G, X, MUL, DX, DMUL, PART, W, B, H, h_f, stride_g, stride_x, stride_m,
                         stride_dx, stride_dm, eps, HAS_MUL: tl.constexpr,
                         RESIDENT: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr,
                         NCH: tl.constexpr, LOG_NCH: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        x_ty = X.dtype.element_ty
        w0, w1, w2, b = _params(W, B)
        if RESIDENT:  # the whole row (x, grad, mul) in registers: one read
            c = _cols(0, NCH, C)
            ok = c < H
            a1 = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
            t1, t2, t3 = _sq_sums(a1, NCH, C, LOG_C)
            r1 = _rstd(t1, h_f, eps, NCH, LOG_NCH)
            r2 = _rstd(t2, h_f, eps, NCH, LOG_NCH)
            r3 = _rstd(t3, h_f, eps, NCH, LOG_NCH)
            g, gr = _load_g(G, MUL, row, c, ok, stride_g, stride_m, x_ty, HAS_MUL)
            vq1, vq2, vq3, vp3, vp2, vp1, vpb = _grad_sums(a1, g, r1, r2, r3, w0, w1, w2, NCH,
                                                           C, LOG_C)  # fmt: skip
        else:
            r1, r2, r3 = _stream_rstd(x_row, H, h_f, eps, C, LOG_C, NCH, LOG_NCH)
            vq1 = tl.zeros((NCH,), tl.float32)
            vq2 = tl.zeros((NCH,), tl.float32)
            vq3 = tl.zeros((NCH,), tl.float32)
            vp3 = tl.zeros((NCH,), tl.float32)
            vp2 = tl.zeros((NCH,), tl.float32)
            vp1 = tl.zeros((NCH,), tl.float32)
            vpb = tl.zeros((NCH,), tl.float32)
            for k in range(0, tl.cdiv(H, C)):
                c = _cols(k, 1, C)
                ok = c < H
                a1 = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
                g, gr = _load_g(G, MUL, row, c, ok, stride_g, stride_m, x_ty, HAS_MUL)
                q1, q2, q3, p3, p2, p1, pb = _grad_sums(a1, g, r1, r2, r3, w0, w1, w2, 1, C,
                                                        LOG_C)  # fmt: skip
                vq1 = _put(vq1, k, q1, NCH)
                vq2 = _put(vq2, k, q2, NCH)
                vq3 = _put(vq3, k, q3, NCH)
                vp3 = _put(vp3, k, p3, NCH)
                vp2 = _put(vp2, k, p2, NCH)
                vp1 = _put(vp1, k, p1, NCH)
                vpb = _put(vpb, k, pb, NCH)
        c1 = tl.div_rn(_tree_sum_rows(vq1[None, :], 1, NCH, LOG_NCH), h_f)
        c2 = tl.div_rn(_tree_sum_rows(vq2[None, :], 1, NCH, LOG_NCH), h_f)
        c3 = tl.div_rn(_tree_sum_rows(vq3[None, :], 1, NCH, LOG_NCH), h_f)
        part = PART + row * 4 + tl.arange(0, 1)
        tl.store(part, _tree_sum_rows(vp3[None, :], 1, NCH, LOG_NCH))
        tl.store(part + 1, _tree_sum_rows(vp2[None, :], 1, NCH, LOG_NCH))
        tl.store(part + 2, _tree_sum_rows(vp1[None, :], 1, NCH, LOG_NCH))
        tl.store(part + 3, _tree_sum_rows(vpb[None, :], 1, NCH, LOG_NCH))
        if RESIDENT:
            _store_dx(DX, DMUL, row, c, ok, a1, g, gr, r1, r2, r3, c1, c2, c3, w0, w1, w2, b,
                      stride_dx, stride_dm, HAS_MUL)  # fmt: skip
        else:
            for k in range(0, tl.cdiv(H, C)):
                c = _cols(k, 1, C)
                ok = c < H
                a1 = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
                g, gr = _load_g(G, MUL, row, c, ok, stride_g, stride_m, x_ty, HAS_MUL)
                _store_dx(DX, DMUL, row, c, ok, a1, g, gr, r1, r2, r3, c1, c2, c3, w0, w1, w2,
                          b, stride_dx, stride_dm, HAS_MUL)  # fmt: skip

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


def _plan(h: int, resident_max: int) -> dict:
    """The kernels' constexprs for rows of H: chunk width, chunk count (a power of two), and
    whether the padded row stays in registers (speed only; the numerics are the chunks')."""
    c = chunk_for(h)
    nch = 1 << (-(-h // c) - 1).bit_length()
    resident = nch * c <= resident_max
    # ~16 fp32 elements per thread of the widest tile a program holds
    width = nch * c if resident else c
    warps = min(16, max(1, width // 512))
    return dict(RESIDENT=resident, C=c, LOG_C=c.bit_length() - 1, NCH=nch,
                LOG_NCH=nch.bit_length() - 1, num_warps=warps)  # fmt: skip


def _launch_fwd(x, weight, bias, eps, mul):
    _tr.check_device("poly_norm", x)
    h = x.shape[-1]
    x2 = _rows(x)
    m2 = _rows(mul) if mul is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        with _tr.device_guard(x):
            _tr.launcher(_poly_fwd_kernel, x.device)[(x2.shape[0],)](
                x2, m2, y, weight.contiguous(), bias.contiguous(), h, float(h),
                x2.stride(0), m2.stride(0), y.stride(0), float(eps),
                HAS_MUL=mul is not None, **_plan(h, RESIDENT_FWD), enable_fp_fusion=False,
            )  # fmt: skip
    return y.reshape(x.shape)


def poly_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Batch-invariant PolyNorm in Triton (module docstring); same contract as the reference."""
    reference._check(x, weight, bias, eps)
    return _launch_fwd(x, weight, bias, eps, None)


def fused_mul_poly_norm(
    x: torch.Tensor,
    mul: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``poly_norm(x) * mul`` in one pass (bitwise the unfused composition)."""
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


def poly_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dx, dmul, dweight, dbias)`` as :func:`reference.poly_norm_backward`."""
    _tr.check_device("poly_norm", x)
    h = x.shape[-1]
    x2, g2 = _rows(x), _rows(grad.to(x.dtype))
    m2 = _rows(mul) if mul is not None else x2
    m = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    dmul = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if mul is not None else None
    part = torch.empty((m, 4), dtype=torch.float32, device=x.device)
    if m:
        with _tr.device_guard(x):
            _tr.launcher(_poly_bwd_kernel, x.device)[(m,)](
                g2, x2, m2, dx, dmul if dmul is not None else dx, part,
                weight.contiguous(), bias.contiguous(), h, float(h),
                g2.stride(0), x2.stride(0), m2.stride(0), dx.stride(0),
                (dmul if dmul is not None else dx).stride(0), float(eps),
                HAS_MUL=mul is not None, **_plan(h, RESIDENT_BWD), enable_fp_fusion=False,
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
    numerics=f"poly_norm/triton-c{CHUNK}",
    fn=poly_norm,
    version="3",
    extras={"fused_mul": fused_mul_poly_norm, "backward": poly_norm_backward},
)
