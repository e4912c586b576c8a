"""``triton`` provider of ``det_gemm``: a batch- and column-invariant Triton GEMM.

Numerics (family ``det_gemm/triton-kc4096``): K is cut into chunks of ``K_CHUNK = 4096`` columns
from column 0 (a fixed number; the last chunk may be shorter). Each chunk is accumulated
**sequentially into a fresh fp32 partial** (``tl.dot`` chained over ``BLOCK_K`` steps; inside a
step the tensor cores reduce in their own fixed unit, k16 for bf16/fp16; fp32 inputs use IEEE FMA
dots, ``input_precision="ieee"``, no TF32), and the partials are added in chunk order,
``((0 + p0) + p1) + ...`` (one chunk: ``p0`` itself). ``out = (acc + bias[j]).to(a.dtype)``.
Output element (i, j) therefore depends on row i of ``a``, column j of ``b`` and K only: rows
outside the matrix are clamped loads that never mix into other rows, and neither the tile shape
nor the plan changes the order (a test proves every shipped config bitwise equal):

* one program per output tile walks all chunks and adds the partials in registers (pointer
  kernel, or the persistent TMA kernel on Hopper), or
* ``split_k``: one program (pointer kernel) or persistent work item (TMA kernel, ``split_k``
  with ``tma``) per (tile, chunk) writes its fp32 partial, and a second kernel adds
  the partials in chunk order. This is what gives decode-sized M enough programs to stream the
  weight at memory speed, without an M-dependent split: the chunking is the same for every M.

Weight gradient ``a.t() @ grad`` (fp32) is the same GEMM with K = tokens and chunks of
``WGRAD_CHUNK`` rows: each chunk sequentially into a fresh fp32 accumulator, chunk partials
added in token order. Three launch plans compute exactly that order: the persistent TMA kernel
(16-bit, TMA-compatible layouts, enough output tiles), one program per output tile walking all
chunks, or (few output tiles, many tokens) one program per (tile, chunk) writing partials that a
second kernel adds in chunk order. Appending zero rows adds exact zeros: invariant to zero
padding.

Version 2 (``-kc4096``): the forward's K chunks are new; version 1 accumulated all of K into one
accumulator, which gives the same bits for K <= 4096 (most hidden sizes: only deep reductions
such as an MLP down projection see chunks). The weight gradient's bits are unchanged.

Version 3: ``WGRAD_CHUNK`` 256 -> 4096 (= ``K_CHUNK``): new weight-gradient bits for more than
256 tokens (forward bits unchanged). With 256-token chunks the chunk loop was 4 K steps long and
the tensor-core pipeline drained at every chunk end.

Not promised: identity with the ``native`` family, across GPU models, or across Triton versions.
On the CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``); there 16-bit tiles
are widened to fp32 before the dot (the interpreter computes bf16 dots wrongly) and the K step
is 16, so interpreter results are a test vehicle, not the GPU's bits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import FLOAT_DTYPES
from rl_engine.ops._triton import (  # None without Triton: the provider says why
    _TensorDescriptor,
    tl,
    triton,
)
from rl_engine.ops.det_gemm.config import (
    K_CHUNK,
    WGRAD_CHUNK,
    DetGemmConfig,
    WgradConfig,
    get_config,
    get_tp_subtree_config,
    get_wgrad_config,
)
from rl_engine.ops.det_gemm.reference import _check, check_wgrad

__all__ = ["PROVIDER", "det_gemm", "det_gemm_tp_subtree", "det_gemm_wgrad"]

# Split the weight gradient over token chunks only while the partials stay this small.
_WGRAD_WORKSPACE_BYTES = 64 << 20
# ...and only when there are fewer output tiles than this (a launch-shape heuristic: both plans
# compute the same bits, so it may depend on anything).
_WGRAD_SPLIT_BELOW_TILES = 128


if triton is not None:

    @triton.jit
    def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of ``tile`` in the grouped launch order (GROUP_M row tiles share the
        column tiles of B in L2)."""
        num_in_group = GROUP_M * num_pid_n
        first_m = (tile // num_in_group) * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((tile % num_in_group) % group_size)
        pid_n = (tile % num_in_group) // group_size
        return pid_m, pid_n

    @triton.jit
    def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, INT64: tl.constexpr):  # fmt: skip
        """``(rm, rn, rk)`` of this program's output tile (program_id(0) in the
        :func:`_grouped_tile` order): its rows and columns (past M / N at the edges: mask or
        wrap them) and the K offsets of one step; int64 when ``INT64``."""
        pid_m, pid_n = _grouped_tile(
            tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M
        )
        if INT64:
            pid_m = pid_m.to(tl.int64)
            pid_n = pid_n.to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if INT64:
            rk = rk.to(tl.int64)
        return rm, rn, rk

    @triton.jit
    def _dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """``acc`` + ``a @ b``: the operands in fp32 first when ``UPCAST``, IEEE fp32 products
        when ``IEEE`` (else the dot's default precision)."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _k_step(
        acc, a_ptr, b_ptr, ram, rbn, rk, kt, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """``acc`` + K step ``kt`` of one tile (pointer loads; masked past K)."""
        kk = kt * BLOCK_K + rk
        a_ptrs = a_ptr + ram[:, None] * stride_am + kk[None, :] * stride_ak
        b_ptrs = b_ptr + kk[:, None] * stride_bk + rbn[None, :] * stride_bn
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=kk[:, None] < K, other=0.0)
        return _dot_acc(a, b, acc, UPCAST, IEEE)

    @triton.jit
    def _k_steps(
        acc, a_ptr, b_ptr, ram, rbn, rk, kt_lo, kt_hi, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """``acc`` + the K steps ``kt_lo .. kt_hi - 1`` of one tile, in order (pointer loads)."""
        for kt in range(kt_lo, kt_hi):
            acc = _k_step(
                acc, a_ptr, b_ptr, ram, rbn, rk, kt, K,
                stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, EVEN_K, UPCAST, IEEE,
            )  # fmt: skip
        return acc

    @triton.jit
    def _tma_k_steps(
        acc, a_desc, b_desc, off_m, off_n, kt_lo, kt_hi,
        BLOCK_K: tl.constexpr, A_MMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr,
    ):  # fmt: skip
        """``acc`` + the K steps ``kt_lo .. kt_hi - 1`` of one tile, in order (TMA loads; the
        descriptor zero-fills past K)."""
        for ki in range(kt_lo, kt_hi):
            off_k = ki * BLOCK_K
            if A_MMAJOR:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _det_gemm_fwd_kernel(
        a_ptr,
        b_ptr,
        bias_ptr,
        c_ptr,
        ws_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        KC_TILES: tl.constexpr,
        MULTI_CHUNK: tl.constexpr,
        SPLIT: tl.constexpr,
        FLAT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
        INT64: tl.constexpr,
    ):
        # K in chunks of KC_TILES * BLOCK_K: each chunk sequentially into a fresh fp32 partial,
        # partials added in chunk order. SPLIT: this program does chunk program_id(1) only and
        # writes its partial to ws[chunk] (the combine kernel adds them in order).
        rm, rn, rk = _program_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, INT64)
        k_tiles = tl.cdiv(K, BLOCK_K)
        if SPLIT:
            chunk = tl.program_id(1)
            kt_begin = chunk * KC_TILES
            kt_end = tl.minimum(k_tiles, kt_begin + KC_TILES)
        else:
            kt_begin = 0
            kt_end = k_tiles
        # Out-of-range rows / columns wrap around to valid ones: rows never mix in a dot, and
        # those results are not stored.
        ram = rm % M
        rbn = rn % N
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPLIT or not MULTI_CHUNK:  # one chunk: the split program's, or all of K
            acc = _k_steps(
                zero, a_ptr, b_ptr, ram, rbn, rk, kt_begin, kt_end, K,
                stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, EVEN_K, UPCAST, IEEE,
            )  # fmt: skip
        elif FLAT:
            # one K loop; a chunk's partial is added (and reset) after its last step
            acc = zero
            part = zero
            for kt in range(0, k_tiles):
                part = _k_step(
                    part, a_ptr, b_ptr, ram, rbn, rk, kt, K,
                    stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, EVEN_K, UPCAST, IEEE,
                )  # fmt: skip
                if (kt % KC_TILES == KC_TILES - 1) or (kt == k_tiles - 1):
                    acc = acc + part
                    part = zero
        else:
            # chunks in an outer loop, each an inner pipelined loop into a fresh partial
            acc = zero
            for c0 in range(0, k_tiles, KC_TILES):
                part = _k_steps(
                    zero, a_ptr, b_ptr, ram, rbn, rk, c0, tl.minimum(c0 + KC_TILES, k_tiles), K,
                    stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, EVEN_K, UPCAST, IEEE,
                )  # fmt: skip
                acc = acc + part
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT:
            w_ptrs = ws_ptr + chunk.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
            tl.store(w_ptrs, acc, mask=omask)
        else:
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
                acc = acc + bias.to(tl.float32)[None, :]
            c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _det_gemm_combine_kernel(
        ws_ptr,
        bias_ptr,
        c_ptr,
        numel,
        N,
        n_chunks,
        stride_cm,
        stride_cn,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # c = (((0 + ws[0]) + ws[1]) + ...) (+ bias): the chunk order of the in-register plan.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, n_chunks):
            total = total + tl.load(ws_ptr + c * numel + offs, mask=mask, other=0.0)
        row = offs // N
        col = offs % N
        if HAS_BIAS:
            total = total + tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            c_ptr + row * stride_cm + col * stride_cn,
            total.to(c_ptr.dtype.element_ty),
            mask=mask,
        )

    # M and the program count are runtime values that Triton must not specialize (on == 1 or
    # divisibility by 16): each variant is a compile, and a new row count inside a rollout or
    # training step must never wait for one (the TMA descriptors bound the tiles, no kernel
    # code depends on M's divisibility).
    @triton.jit(do_not_specialize=["M", "num_progs"])
    def _det_gemm_tma_kernel(
        a_desc,
        b_desc,
        bias_ptr,
        c_ptr,
        ws_ptr,
        M,
        N,
        K,
        stride_cm,
        stride_cn,
        num_progs,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        KC_TILES: tl.constexpr,
        MULTI_CHUNK: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        A_MMAJOR: tl.constexpr,
        B_KMAJOR: tl.constexpr,
        ACC_INIT: tl.constexpr,
    ):
        # Persistent variant (Hopper): TMA tile loads, tiles visited in the grouped order. Each
        # tile is computed exactly as in _det_gemm_fwd_kernel (K chunks, each in order into a
        # fresh fp32 partial, partials added in order; the TMA zero-fills the K tail), so the
        # bits are the same; num_progs only says how many programs share the tiles (a runtime
        # argument: as a constexpr every new tile count below the SM count, i.e. every new
        # small M, compiled a kernel inside a rollout step or a training step). A may be
        # stored K-contiguous ([M, K]) or M-contiguous (A_MMAJOR: the descriptor is over [K, M]),
        # B N-contiguous ([K, N]) or K-contiguous (B_KMAJOR: over [N, K]).
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        k_tiles = tl.cdiv(K, BLOCK_K)
        if SPLIT:
            # SPLIT: the work items are (K chunk, tile) pairs, chunk-major (the programs in
            # flight share the A rows of one chunk); each writes its chunk's fresh fp32 partial
            # to ws[chunk], which _det_gemm_combine_kernel adds in chunk order (bias there).
            n_chunks = tl.cdiv(k_tiles, KC_TILES)
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for item in tl.range(start, num_tiles * n_chunks, num_progs, flatten=True):
                chunk = item // num_tiles
                pid_m, pid_n = _grouped_tile(item % num_tiles, num_pid_m, num_pid_n, GROUP_M)
                off_m = pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                kt0 = chunk * KC_TILES
                part = _tma_k_steps(
                    zero, a_desc, b_desc, off_m, off_n, kt0,
                    tl.minimum(kt0 + KC_TILES, k_tiles), BLOCK_K, A_MMAJOR, B_KMAJOR,
                )  # fmt: skip
                rm = off_m + tl.arange(0, BLOCK_M)
                rn = off_n + tl.arange(0, BLOCK_N)
                w_ptrs = (
                    ws_ptr + chunk.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
                )
                tl.store(w_ptrs, part, mask=(rm[:, None] < M) & (rn[None, :] < N))
        else:
            _tma_tiles(
                a_desc, b_desc, bias_ptr, c_ptr, M, N, stride_cm, stride_cn, start, num_tiles,
                num_pid_m, num_pid_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, KC_TILES,
                num_progs, MULTI_CHUNK, HAS_BIAS, A_MMAJOR, B_KMAJOR, ACC_INIT,
            )  # fmt: skip

    @triton.jit
    def _tma_tiles(
        a_desc, b_desc, bias_ptr, c_ptr, M, N, stride_cm, stride_cn, start, num_tiles,
        num_pid_m, num_pid_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, KC_TILES: tl.constexpr, num_progs,
        MULTI_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, A_MMAJOR: tl.constexpr,
        B_KMAJOR: tl.constexpr, ACC_INIT: tl.constexpr,
    ):  # fmt: skip
        """The in-register plan of _det_gemm_tma_kernel: each tile walks all its K chunks.
        ``ACC_INIT`` (fp32 ``c``, no bias): the running sum starts from ``c`` instead of 0, so
        ``c = ((c + p0) + p1) + ...``: the chunk partials continue an earlier call's sum."""
        for tile in tl.range(start, num_tiles, num_progs, flatten=not MULTI_CHUNK):
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if MULTI_CHUNK:
                acc = zero
                if ACC_INIT:
                    acc = _c_tile(c_ptr, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
                for c0 in range(0, k_tiles, KC_TILES):
                    part = _tma_k_steps(
                        zero, a_desc, b_desc, off_m, off_n, c0,
                        tl.minimum(c0 + KC_TILES, k_tiles), BLOCK_K, A_MMAJOR, B_KMAJOR,
                    )  # fmt: skip
                    acc = acc + part
            else:
                acc = _tma_k_steps(
                    zero, a_desc, b_desc, off_m, off_n, 0, k_tiles, BLOCK_K, A_MMAJOR, B_KMAJOR
                )
                if ACC_INIT:
                    c = _c_tile(c_ptr, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
                    acc = c + acc
            rm = off_m + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
                acc = acc + bias.to(tl.float32)[None, :]
            c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
            tl.store(
                c_ptrs,
                acc.to(c_ptr.dtype.element_ty),
                mask=(rm[:, None] < M) & (rn[None, :] < N),
            )

    @triton.jit
    def _c_tile(c_ptr, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
        """The fp32 output tile at (off_m, off_n) as stored (out of range: 0)."""
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
        return tl.load(c_ptrs, mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)

    @triton.jit
    def _wgrad_tile(pid, N, BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
        """``(ro, rn, rt)`` of weight-gradient program ``pid``: its output rows ``ro`` (a's
        columns) and columns ``rn`` (g's; column tiles fastest) and the token offsets ``rt``."""
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_o = pid // num_pid_n
        pid_n = pid % num_pid_n
        ro = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rt = tl.arange(0, BLOCK_T)
        return ro, rn, rt

    @triton.jit
    def _wgrad_step(
        part, a_ptr, g_ptr, a_rows, g_rows, tmask, ro_c, rn_c,
        stride_at, stride_ak, stride_gt, stride_gn, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """``part`` + one token step of a weight-gradient tile: ``a[a_rows, ro_c].T @ g[g_rows,
        rn_c]`` (tokens where ``tmask`` is false load as 0)."""
        a_t = tl.load(
            a_ptr + a_rows[None, :] * stride_at + ro_c[:, None] * stride_ak,
            mask=tmask[None, :],
            other=0.0,
        )
        g = tl.load(
            g_ptr + g_rows[:, None] * stride_gt + rn_c[None, :] * stride_gn,
            mask=tmask[:, None],
            other=0.0,
        )
        return _dot_acc(a_t, g, part, UPCAST, IEEE)

    @triton.jit
    def _det_gemm_wgrad_kernel(
        a_ptr,
        g_ptr,
        out_ptr,
        T,
        KO,
        N,
        stride_at,
        stride_ak,
        stride_gt,
        stride_gn,
        stride_os,
        stride_ok,
        stride_on,
        chunks_per_prog,
        CHUNK: tl.constexpr,
        BLOCK_O: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
        INT64: tl.constexpr,
        ACC_INIT: tl.constexpr,
    ):
        # out[split, o, n] = sum over this program's token chunks (in order) of
        #   chunk partial = sum_t a[t, o] * g[t, n]   (fresh fp32 accumulator per chunk);
        # ACC_INIT (one split, fp32 out): the sum starts from out instead of 0
        pid = tl.program_id(0)
        split = tl.program_id(1)
        ro, rn, rt = _wgrad_tile(pid, N, BLOCK_O, BLOCK_N, BLOCK_T)
        if INT64:
            ro = ro.to(tl.int64)
            rn = rn.to(tl.int64)
            rt = rt.to(tl.int64)
        ro_c = ro % KO
        rn_c = rn % N
        t_begin = split * chunks_per_prog * CHUNK
        t_end = tl.minimum(T, t_begin + chunks_per_prog * CHUNK)
        total = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
        if ACC_INIT:
            i_ptrs = out_ptr + ro[:, None] * stride_ok + rn[None, :] * stride_on
            total = tl.load(i_ptrs, mask=(ro[:, None] < KO) & (rn[None, :] < N), other=0.0)
        for c0 in range(t_begin, t_end, CHUNK):
            part = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
            # steps past the last token would add exact zeros: the chunk stops at T
            for t0 in range(c0, tl.minimum(c0 + CHUNK, T), BLOCK_T):
                t = t0 + rt
                part = _wgrad_step(
                    part, a_ptr, g_ptr, t, t, t < T, ro_c, rn_c,
                    stride_at, stride_ak, stride_gt, stride_gn, UPCAST, IEEE,
                )  # fmt: skip
            total = total + part
        o_ptrs = out_ptr + split * stride_os + ro[:, None] * stride_ok + rn[None, :] * stride_on
        tl.store(
            o_ptrs, total.to(out_ptr.dtype.element_ty), mask=(ro[:, None] < KO) & (rn[None, :] < N)
        )

    @triton.jit
    def _det_gemm_wgrad_combine_kernel(
        ws_ptr, out_ptr, n_parts, numel, BLOCK: tl.constexpr, ACC_INIT: tl.constexpr
    ):
        # out = ((0 + ws[0]) + ws[1]) + ...: the same order as the in-program chunk loop
        # (ACC_INIT, fp32 out: from out instead of 0). out is contiguous.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        if ACC_INIT:
            total = tl.load(out_ptr + offs, mask=mask, other=0.0)
        for s in range(0, n_parts):
            total = total + tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tp_group_product(
        a_ptr, b_ptr, ram, rbn, rk, g, GL, HALF,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        CHUNK: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """The fp32 product of group ``g`` in the weight-gradient kernel's order (K = the
        group's ``L`` positions): chunks of ``CHUNK`` positions from the group's start, each
        in ``BLOCK_K`` steps into a fresh fp32 partial (masked past ``L``), the partials added
        to a zero total in chunk order. Position ``p`` of group ``g`` is column
        ``g * GL + p`` of the shard; ``GLU``: gate column ``g * GL + p`` for ``p < GL``, then up
        column ``HALF + g * GL + p - GL`` (``L = 2 GL``)."""
        if GLU:
            length = 2 * GL
        else:
            length = GL
        base = g * GL
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, length, CHUNK):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t0 in range(c0, tl.minimum(c0 + CHUNK, length), BLOCK_K):
                p = t0 + rk
                if GLU:
                    kk = tl.where(p < GL, base + p, HALF + base + p - GL)
                else:
                    kk = base + p
                live = p < length
                a = tl.load(
                    a_ptr + ram[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=live[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_ptr + kk[:, None] * stride_bk + rbn[None, :] * stride_bn,
                    mask=live[:, None],
                    other=0.0,
                )
                part = _dot_acc(a, b, part, UPCAST, IEEE)
            total = total + part
        return total

    @triton.jit
    def _pair_tree_start(zero):
        """``(x, lv0, .., lv4)`` of an empty :func:`_pair_tree_push` tree: every level and the
        climbing leaf ``zero`` (an fp32 tile of zeros of the leaves' shape)."""
        return zero, zero, zero, zero, zero, zero

    @triton.jit
    def _pair_tree_push(x, i: tl.constexpr, lv0, lv1, lv2, lv3, lv4):
        """Leaf ``i`` (``x``) of an adjacent-pair tree kept as a binary counter; returns ``(x,
        lv0, .., lv4)`` after it. ``lv<l>`` holds the finished left subtree of 2^l leaves
        waiting for its right neighbour; the leaf climbs while bit l of ``i`` is 1, ``x = lv<l>
        + x`` (left + right: pair_tree's order). After the last leaf of a power-of-two count,
        ``x`` is the whole tree. ``i`` is a constexpr: every branch is resolved at compile
        time. At most 32 leaves (five levels)."""
        if i % 2 == 0:
            lv0 = x
        else:
            x = lv0 + x
            if (i // 2) % 2 == 0:
                lv1 = x
            else:
                x = lv1 + x
                if (i // 4) % 2 == 0:
                    lv2 = x
                else:
                    x = lv2 + x
                    if (i // 8) % 2 == 0:
                        lv3 = x
                    else:
                        x = lv3 + x
                        if (i // 16) % 2 == 0:
                            lv4 = x
                        else:
                            x = lv4 + x
        return x, lv0, lv1, lv2, lv3, lv4

    @triton.jit
    def _tp_subtree_tile(
        a_ptr, b_ptr, ram, rbn, rk, GL, HALF,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUPS: tl.constexpr, CHUNK: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """fp32 [BM, BN] tile (rows ``ram``, columns ``rbn``) of the adjacent-pair tree of the
        ``GROUPS`` group products (each as :func:`_tp_group_product`), in group order through
        :func:`_pair_tree_push` (static: GROUPS is a constexpr). At most 32 groups."""
        x, lv0, lv1, lv2, lv3, lv4 = _pair_tree_start(tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        for g in tl.static_range(GROUPS):
            x = _tp_group_product(
                a_ptr, b_ptr, ram, rbn, rk, g, GL, HALF,
                stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, GLU, UPCAST, IEEE,
            )  # fmt: skip
            x, lv0, lv1, lv2, lv3, lv4 = _pair_tree_push(x, g, lv0, lv1, lv2, lv3, lv4)
        return x

    @triton.jit
    def _det_gemm_tp_subtree_kernel(
        a_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        GL,
        HALF,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_om,
        stride_on,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        GROUPS: tl.constexpr,
        CHUNK: tl.constexpr,
        GLU: tl.constexpr,
        UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
        INT64: tl.constexpr,
    ):
        # One program per output tile: the GROUPS group products of the tile and their
        # adjacent-pair tree (_tp_subtree_tile), in registers, written once in fp32.
        rm, rn, rk = _program_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, INT64)
        x = _tp_subtree_tile(
            a_ptr, b_ptr, rm % M, rn % N, rk, GL, HALF, stride_am, stride_ak, stride_bk,
            stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS, CHUNK, GLU, UPCAST, IEEE,
        )  # fmt: skip
        o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
        tl.store(o_ptrs, x, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``: a cached launcher for CUDA tensors, interpreted for CPU tensors."""
    return _triton.launcher(globals()[name], device)


def _check_device(*tensors: torch.Tensor) -> None:
    _triton.check_device("det_gemm", *tensors)


def _needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether some element offset (span of a tensor in memory) can exceed int32."""
    for t in tensors:
        if t.numel() < _triton.INT32_MAX and t.is_contiguous():
            continue  # the common case, without the per-dim sum
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
        if span >= _triton.INT32_MAX:
            return True
    return False


_guard = _triton.device_guard


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a unit-stride last dim, 16-byte aligned base and other strides."""
    es = t.element_size()
    return (
        t.stride(1) == 1
        and (t.stride(0) * es) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[1] * es >= 16
    )


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


class _Plan:
    """Every launch decision of one product, made once per (dtypes, shapes, strides, 16-byte
    alignment, bias or not, config, device) and kept (``_PLANS``): which kernel and grid, the
    constexprs, the TMA descriptor layouts, the workspace. ``run`` allocates the workspace, builds
    the descriptors and launches the prepared kernels (``_triton.Prepared``) for the given tensors.
    A launch choice only: the bits are the kernels'."""

    __slots__ = ("a_t", "a_block", "b_t", "b_block", "ws_shape", "main", "combine")

    def __init__(self, a_t, a_block, b_t, b_block, ws_shape, main, combine):
        self.a_t = a_t  # None: pointer kernel; else the TMA descriptor is over a.t() (bool)
        self.a_block = a_block
        self.b_t = b_t
        self.b_block = b_block
        self.ws_shape = ws_shape  # fp32 partials of the split plans, or None
        self.main = main
        self.combine = combine

    def run(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
        ws = (
            torch.empty(self.ws_shape, dtype=torch.float32, device=out.device)
            if self.ws_shape is not None
            else out
        )
        bo = bias if bias is not None else out
        if self.a_t is None:
            self.main(a, b, bo, out, ws)
        else:
            sa = a.t() if self.a_t else a
            sb = b.t() if self.b_t else b
            self.main(
                _TensorDescriptor(sa, sa.shape, sa.stride(), self.a_block),
                _TensorDescriptor(sb, sb.shape, sb.stride(), self.b_block),
                bo,
                out,
                ws,
            )
        if self.combine is not None:
            self.combine(ws, bo, out)


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 8192  # shapes seen in one process; beyond, the cache starts over


def _plan_key(a, b, bias, out, cfg, k_chunk, group_m, acc_init=False) -> tuple:
    """What decides a plan (everything ``_plan_for`` reads of the tensors)."""
    return (
        a.get_device(),
        a.dtype,
        out.dtype,
        *a.shape,
        b.shape[1],
        *a.stride(),
        *b.stride(),
        *out.stride(),
        a.data_ptr() % 16 == 0,
        b.data_ptr() % 16 == 0,
        None if bias is None else (bias.dtype, bias.data_ptr() % 16 == 0),
        cfg,
        k_chunk,
        group_m,
        acc_init,
    )


def _tma_plan(a, b, has_bias, out, block_m, block_n, block_k, group_m, num_warps, num_stages,
              k_chunk, split, acc_init=False) -> _Plan | None:  # fmt: skip
    """The persistent TMA kernel's plan for ``out = a @ b (+ bias)`` (``a`` [M, K], ``b`` [K, N],
    either stored contiguous along either dim); ``None`` when the layouts do not allow TMA.
    ``split`` (with more than one K chunk): one work item per (chunk, tile) writing fp32
    partials, then the ordered combine kernel. ``acc_init`` (fp32 ``out``, no bias, no split):
    the chunk sum starts from ``out`` (``ACC_INIT`` of the kernel)."""
    if acc_init and (split or has_bias or out.dtype != torch.float32):
        raise ValueError("det_gemm[triton]: acc_init needs an fp32 out, no bias and no split")
    if a.dtype == torch.float32:
        return None
    if _tma_ok(a):
        a_t, a_block = False, [block_m, block_k]
    elif _tma_ok(a.t()):
        a_t, a_block = True, [block_k, block_m]
    else:
        return None
    if _tma_ok(b):
        b_t, b_block = False, [block_k, block_n]
    elif _tma_ok(b.t()):
        b_t, b_block = True, [block_n, block_k]
    else:
        return None
    m, k = a.shape
    n = b.shape[1]
    tiles = _triton.cdiv(m, block_m) * _triton.cdiv(n, block_n)
    n_chunks = _triton.cdiv(k, k_chunk)
    split = split and n_chunks > 1
    progs = max(1, min(_num_sms(a.device), tiles * (n_chunks if split else 1)))
    main = _triton.Prepared(
        _triton.launcher(_det_gemm_tma_kernel, a.device),
        (progs,),
        (m, n, k, out.stride(0), out.stride(1), progs),
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            KC_TILES=k_chunk // block_k,
            MULTI_CHUNK=k > k_chunk,
            SPLIT=split,
            HAS_BIAS=has_bias,
            A_MMAJOR=a_t,
            B_KMAJOR=b_t,
            num_warps=num_warps,
            num_stages=num_stages,
            ACC_INIT=acc_init,
        ),
    )
    ws_shape = (n_chunks, m, n) if split else None
    combine = _combine_step(out, has_bias, n_chunks) if split else None
    return _Plan(a_t, a_block, b_t, b_block, ws_shape, main, combine)


def _combine_step(out: torch.Tensor, has_bias: bool, n_chunks: int) -> _triton.Prepared:
    """``out = (((0 + ws[0]) + ws[1]) + ...) (+ bias)`` in ``out.dtype`` (the split plans);
    leading arguments ``(ws, bias or out, out)``."""
    m, n = out.shape
    block = 1024
    return _triton.Prepared(
        _kernel("_det_gemm_combine_kernel", out.device),
        (_triton.cdiv(m * n, block),),
        (m * n, n, n_chunks, out.stride(0), out.stride(1)),
        dict(HAS_BIAS=has_bias, BLOCK=block, num_warps=4),
    )


def _plan_for(a, b, bias, out, cfg: DetGemmConfig, k_chunk: int) -> _Plan:
    m, k = a.shape
    n = b.shape[1]
    on_cpu = a.device.type == "cpu"
    if on_cpu:
        cfg = cfg.for_interpreter()
    if k_chunk % cfg.block_k:
        raise ValueError(f"det_gemm[triton]: block_k={cfg.block_k} must divide k_chunk={k_chunk}")
    n_chunks = _triton.cdiv(k, k_chunk)
    if cfg.tma and not on_cpu:
        plan = _tma_plan(
            a,
            b,
            bias is not None,
            out,
            cfg.block_m,
            cfg.block_n,
            cfg.block_k,
            cfg.group_m,
            cfg.num_warps,
            cfg.num_stages,
            k_chunk,
            cfg.split_k,
        )
        if plan is not None:
            return plan
    split = cfg.split_k and n_chunks > 1
    grid = (_triton.cdiv(m, cfg.block_m) * _triton.cdiv(n, cfg.block_n), n_chunks if split else 1)
    ws_shape = (n_chunks, m, n) if split else None
    main = _triton.Prepared(
        _kernel("_det_gemm_fwd_kernel", a.device),
        grid,
        (m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1)),
        dict(
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            KC_TILES=k_chunk // cfg.block_k,
            MULTI_CHUNK=n_chunks > 1,
            SPLIT=split,
            FLAT=cfg.flat_k,
            HAS_BIAS=bias is not None,
            EVEN_K=k % cfg.block_k == 0,
            UPCAST=on_cpu and a.dtype != torch.float32,
            IEEE=a.dtype == torch.float32 or on_cpu,
            # the workspace spans no more than out does per chunk; out's span is in the list
            INT64=_needs_int64(a, b, out) or (split and n_chunks * m * n >= _triton.INT32_MAX),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ),
    )
    combine = _combine_step(out, bias is not None, n_chunks) if split else None
    return _Plan(None, None, None, None, ws_shape, main, combine)


def _run(
    a, b, bias, out, cfg: DetGemmConfig, k_chunk: int, group_m: int | None = None, acc_init=False
) -> None:
    """``out = a @ b (+ bias)`` through the plan of these arguments (made on first sight);
    ``acc_init`` (the weight gradient's TMA plan only): ``out`` is where the chunk sum starts."""
    key = _plan_key(a, b, bias, out, cfg, k_chunk, group_m, acc_init)
    plan = _PLANS.get(key)
    if plan is None:
        if group_m is not None:  # the weight gradient's TMA plan (no pointer fallback here)
            plan = _tma_plan(
                a, b, False, out, cfg.block_m, cfg.block_n, cfg.block_k, group_m,
                cfg.num_warps, cfg.num_stages, k_chunk, False, acc_init,
            )  # fmt: skip
            if plan is None:
                raise ValueError("det_gemm[triton]: these layouts cannot use TMA")
        else:
            plan = _plan_for(a, b, bias, out, cfg, k_chunk)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    with _guard(a):
        plan.run(a, b, bias, out)


def _valid_cuda_args(a: Any, b: Any, bias: Any) -> bool:
    """The checks of ``_check`` + ``_check_device`` for the common case (CUDA tensors), in a few
    attribute reads: ``True`` when the arguments are valid CUDA inputs. ``False`` says nothing:
    the caller runs the full checks, which raise with the reason (or pass, e.g. on the CPU)."""
    try:
        ok = (
            a.is_cuda
            and a.dim() == 2
            and b.dim() == 2
            and a.dtype in FLOAT_DTYPES
            and b.dtype == a.dtype
            and a.shape[1] == b.shape[0]
            and b.get_device() == a.get_device()
        )
        if ok and bias is not None:
            ok = (
                bias.dim() == 1
                and bias.dtype == a.dtype
                and bias.shape[0] == b.shape[1]
                and bias.get_device() == a.get_device()
            )
    except AttributeError:  # not tensors
        return False
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return bool(ok) and tensors and (bias is None or isinstance(bias, torch.Tensor))


def det_gemm_with_config(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: DetGemmConfig | None,
    *,
    k_chunk: int = K_CHUNK,
) -> torch.Tensor:
    """:func:`det_gemm` with an explicit launch config (tests and tuning; same numerics).

    ``k_chunk`` other than ``K_CHUNK`` is another numerics (tests use a small one to exercise
    many chunks on small shapes).
    """
    if not _valid_cuda_args(a, b, bias):  # the slow checks, for their error messages
        _check(a, b, bias)
        _check_device(a)
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"det_gemm[triton]: dtype {a.dtype} is not supported")
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        if bias is not None:
            acc = acc + bias.float()
        return acc.to(a.dtype)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernels read bias[j] at offset j
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    _run(a, b, bias, out, cfg or get_config(m, n, k, a.dtype), k_chunk)
    return out


def det_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch- and column-invariant ``a @ b (+ bias)`` on the GPU (Triton).

    Args:
        a: [M, K] float32 / bfloat16 / float16, any strides.
        b: [K, N] same dtype, any strides (an ``nn.Linear`` weight as ``w.t()``).
        bias: optional [N], same dtype.

    Returns:
        [M, N] in ``a.dtype``: K in ``K_CHUNK`` chunks, each accumulated in order into a fresh
        fp32 partial, partials added in chunk order, one final rounding.
    """
    return det_gemm_with_config(a, b, bias, None)


@functools.cache
def _wgrad_gemm_config(cfg: WgradConfig) -> DetGemmConfig:
    """The forward-kernel config of a weight-gradient TMA launch (made once per config)."""
    return DetGemmConfig(cfg.block_o, cfg.block_n, cfg.block_t, 8, cfg.num_warps, cfg.num_stages)


def det_gemm_wgrad_with_plan(
    a: torch.Tensor,
    grad: torch.Tensor,
    *,
    split: bool | None,
    cfg: WgradConfig | None = None,
    tma: bool | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    chunk: int | None = None,
) -> torch.Tensor:
    """:func:`det_gemm_wgrad` with an explicit launch plan: ``tma`` (the persistent TMA GEMM
    kernel with K = tokens and ``WGRAD_CHUNK`` chunks), else ``split`` over token chunks or one
    program per tile (``None`` = heuristic). All plans give the same bits."""
    check_wgrad(a, grad)
    _check_device(a)
    t, ko = a.shape
    n = grad.shape[1]
    if out is not None:
        _check_wgrad_out(out, (ko, n), a, accumulate)
    elif accumulate:
        raise ValueError("det_gemm_wgrad: accumulate=True needs out")
    on_cpu = a.device.type == "cpu"
    cfg = cfg or get_wgrad_config(a.dtype)
    if on_cpu:
        cfg = cfg.for_interpreter()
    chunk = WGRAD_CHUNK if chunk is None else chunk
    if chunk <= 0 or chunk % cfg.block_t:
        raise ValueError(
            f"det_gemm_wgrad: chunk={chunk} must be a positive multiple of the token step "
            f"{cfg.block_t}"
        )
    tiles = _triton.cdiv(ko, cfg.block_o) * _triton.cdiv(n, cfg.block_n)
    n_chunks = _triton.cdiv(t, chunk) if t > 0 else 0
    if tma is None:
        tma = cfg.tma and tiles >= _WGRAD_SPLIT_BELOW_TILES
    if tma and not on_cpu and t > 0 and ko > 0 and n > 0:
        if a.dtype != torch.float32 and (_tma_ok(grad) or _tma_ok(grad.t())):
            if _tma_ok(a) or _tma_ok(a.t()):
                if out is None:
                    out = torch.empty((ko, n), dtype=torch.float32, device=a.device)
                cfg_t = _wgrad_gemm_config(cfg)
                _run(a.t(), grad, None, out, cfg_t, chunk, group_m=8, acc_init=accumulate)
                return out
    if out is None:
        out = torch.zeros((ko, n), dtype=torch.float32, device=a.device)
    if t == 0 or ko == 0 or n == 0:
        return out if accumulate else out.zero_()
    if split is None:
        split = (
            n_chunks > 1
            and tiles < _WGRAD_SPLIT_BELOW_TILES
            and n_chunks * ko * n * 4 <= _WGRAD_WORKSPACE_BYTES
        )
    split = split and n_chunks > 1
    if split:
        dest = torch.empty((n_chunks, ko, n), dtype=torch.float32, device=a.device)
        chunks_per_prog, n_progs = 1, n_chunks
    else:
        dest = out.unsqueeze(0)
        chunks_per_prog, n_progs = n_chunks, 1
    common = dict(
        CHUNK=chunk,
        BLOCK_O=cfg.block_o,
        BLOCK_N=cfg.block_n,
        BLOCK_T=cfg.block_t,
        UPCAST=on_cpu and a.dtype != torch.float32,
        IEEE=a.dtype == torch.float32 or on_cpu,
        INT64=_needs_int64(a, grad, dest),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    with _guard(a):
        _kernel("_det_gemm_wgrad_kernel", a.device)[(tiles, n_progs)](
            a,
            grad,
            dest,
            t,
            ko,
            n,
            a.stride(0),
            a.stride(1),
            grad.stride(0),
            grad.stride(1),
            dest.stride(0),
            dest.stride(1),
            dest.stride(2),
            chunks_per_prog,
            **common,
            ACC_INIT=accumulate and not split,
        )
        if split:
            numel = ko * n
            block = 1024
            _kernel("_det_gemm_wgrad_combine_kernel", a.device)[(_triton.cdiv(numel, block),)](
                dest, out, n_chunks, numel, BLOCK=block, ACC_INIT=accumulate
            )
    return out


def _check_wgrad_out(out: Any, shape: tuple[int, int], a: torch.Tensor, accumulate: bool) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"det_gemm_wgrad: out must be a tensor of shape {shape}, got {got}")
    if out.device != a.device:
        raise ValueError(f"det_gemm_wgrad: out on {out.device}, inputs on {a.device}")
    allowed = (torch.float32,) if accumulate else (torch.float32, a.dtype)
    if out.dtype not in allowed:
        what = "accumulate=True needs an fp32 out" if accumulate else "out must be fp32 or a.dtype"
        raise TypeError(f"det_gemm_wgrad: {what}, got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("det_gemm_wgrad: out must be contiguous")


def det_gemm_wgrad(
    a: torch.Tensor,
    grad: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    chunk: int | None = None,
) -> torch.Tensor:
    """``a.t() @ grad`` in fp32 (the weight gradient), tokens reduced in fixed chunks.

    Args:
        a: [T, K] (the layer input), any strides.
        grad: [T, N] (the output gradient), same dtype.
        out: optional contiguous [K, N] destination: fp32, or ``a.dtype`` (the fp32 sum rounded
            once, the same bits as ``det_gemm_wgrad(a, grad).to(a.dtype)``).
        accumulate: the sum starts from ``out`` (fp32) instead of 0: ``out = ((out + p0) + p1)
            + ...`` over this call's chunk partials ``p``. So calls over consecutive
            chunk-aligned token ranges, the first without ``accumulate``, give the bits of
            one call over all the tokens.
        chunk: tokens per chunk (default ``WGRAD_CHUNK``; another value is another numerics,
            e.g. ``linear_logp``'s dhidden reduction over the vocabulary). A multiple of the
            kernels' token step.

    Returns:
        fp32 [K, N] (or ``out``): chunks of ``WGRAD_CHUNK`` tokens, each summed in token order
        into a fresh fp32 accumulator, partials added in chunk order. Deterministic; invariant to
        appended zero rows.
    """
    return det_gemm_wgrad_with_plan(
        a, grad, split=None, out=out, accumulate=accumulate, chunk=chunk
    )


# Groups of the one-launch subtree kernel: its pair tree holds one register tile per level.
_TP_MAX_GROUPS = 32


def det_gemm_tp_subtree(
    a: torch.Tensor,
    b: torch.Tensor,
    groups: int,
    *,
    glu: bool = False,
    out: torch.Tensor | None = None,
    cfg: DetGemmConfig | None = None,
) -> torch.Tensor:
    """One rank's fp32 subtree of the TP-invariant reduction in one launch: the ``groups``
    group products of ``a [M, K] @ b [K, N]`` and their adjacent-pair tree.

    The bits of ``tp.subtree_per_group`` with this provider (one :func:`det_gemm_wgrad`
    launch per group, ``torch.stack`` and :func:`rl_engine.ops.det_gemm.tp.pair_tree`): each
    group product in the weight-gradient kernel's order (``WGRAD_CHUNK`` chunks of the group,
    each into a fresh fp32 partial, partials in chunk order), the tree's adds in its order.
    ``cfg`` is a launch shape only (``get_tp_subtree_config``).

    Args:
        a: [M, K] (K = ``groups`` equal groups; ``glu``: two halves of ``groups`` each, group
            ``j`` = gate block ``j`` then up block ``j``), any strides.
        b: [K, N], same dtype, any strides.
        groups: this rank's group count, a power of two <= 32.
        out: optional fp32 [M, N] destination (e.g. a symmetric-memory buffer).
    Returns:
        fp32 [M, N] (``out`` when given).
    """
    _check_device(a)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"det_gemm_tp_subtree: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply"
        )
    if a.dtype != b.dtype or a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"det_gemm_tp_subtree: dtypes {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"det_gemm_tp_subtree: a on {a.device}, b on {b.device}")
    if groups < 1 or groups & (groups - 1) or groups > _TP_MAX_GROUPS:
        raise ValueError(
            f"det_gemm_tp_subtree: {groups} groups; expected a power of two <= {_TP_MAX_GROUPS}"
        )
    m, k = a.shape
    n = b.shape[1]
    unit = groups * (2 if glu else 1)
    if k % unit:
        raise ValueError(f"det_gemm_tp_subtree: {k} columns do not split into {unit} blocks")
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    elif (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (m, n)
        or out.dtype != torch.float32
        or out.device != a.device
    ):
        raise ValueError(f"det_gemm_tp_subtree: out must be fp32 [{m}, {n}] on {a.device}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    on_cpu = a.device.type == "cpu"
    cfg = cfg or get_tp_subtree_config(m, n, groups, a.dtype)
    if on_cpu:
        cfg = cfg.for_interpreter()
    if WGRAD_CHUNK % cfg.block_k:
        raise ValueError(f"det_gemm_tp_subtree: block_k={cfg.block_k} must divide {WGRAD_CHUNK}")
    gl = k // unit
    grid = (_triton.cdiv(m, cfg.block_m) * _triton.cdiv(n, cfg.block_n),)
    with _guard(a):
        _kernel("_det_gemm_tp_subtree_kernel", a.device)[grid](
            a,
            b,
            out,
            m,
            n,
            gl,
            k // 2,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            GROUPS=groups,
            CHUNK=WGRAD_CHUNK,
            GLU=glu,
            UPCAST=on_cpu and a.dtype != torch.float32,
            IEEE=a.dtype == torch.float32 or on_cpu,
            INT64=_needs_int64(a, b, out),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out


PROVIDER = _triton.triton_provider(
    numerics=f"det_gemm/triton-kc{K_CHUNK}",
    fn=det_gemm,
    # 2: forward K chunks of 4096; 3: weight-gradient token chunks 256 -> 4096
    version="3",
    extras={"wgrad": det_gemm_wgrad, "tp_subtree": det_gemm_tp_subtree},
)
