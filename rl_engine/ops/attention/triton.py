"""``triton`` provider of ``attention``: one forward kernel for varlen prefill and paged attention.

Numerics (family ``attention/triton``): a program owns ``BLOCK_M`` *rows* of one sequence and one
KV head, a row being a (query token, query head of that KV head's group) pair, so GQA heads share
the key/value tiles. It walks the KV tiles of ``BLOCK_N`` positions aligned to absolute position
0, in order, up to the tile holding its last row's position, with the reference's online softmax in
base 2 (version 2): raw fp32 scores ``s = q @ k``, running max ``m = max(m, max(s) * c)`` with
``c = scale * log2(e)`` (rounded once, on the host), ``p = exp2(fma(s, c, -m))`` (one explicit FMA),
``alpha = 1`` when the max does not move, exact zeros for masked positions (a masked score is
``-inf``), ``P`` rounded to the input dtype before ``P @ V``; ``lse = (m + log2(l)) * ln(2)``. The
tiles every row of a program sees whole run without masks (the causal interior: the FA2 split
of the loop); for a row that sees a tile whole, the masked and unmasked steps do the same
operations on the same values, so a row's bits do not depend on which step its program took
(which depends on the other rows of the block). Prefill (``PAGED=False``: keys are
packed rows) and paged attention (``PAGED=True``: keys are gathered through the block table) are
the *same* kernel with the same tile shape, warps and order; only the addresses differ. A tile that
is fully masked for a row leaves that row bitwise unchanged, and rows never mix inside a tile,
so a token's output is the same in a full prefill, a chunked prefill, a decode step, with any
page size and in any batch. The tile configuration depends on the head dim only (never on the
token count); there is no split-KV.

Backward (deterministic, no atomics): ``delta = rowsum(dO * O)`` kernel; a dK/dV kernel where a
program owns one KV tile and loops over the query row blocks in order; a dQ kernel where a
program owns a row block and loops over the KV tiles in order (dQ is row invariant). Both
recompute ``P`` in base 2 and skip the masks on the blocks / tiles that need none.

Not promised: identity with the ``native`` family, across GPU models, or across Triton versions.
On the CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``); test fp32 / fp16
there (the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.attention import reference

__all__ = [
    "PROVIDER",
    "SPLIT_PROVIDER",
    "attention",
    "attention_bwd",
    "attention_split",
    "paged_attention",
    "paged_attention_split",
    "write_kv_cache",
]

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634  # log2(e): the kernels' softmax runs in base 2
# The split family (provider ``triton_split``): KV splits of SPLIT_POSITIONS positions from
# position 0 (part of its numerics; never derived from the batch or the sequence count).
SPLIT_POSITIONS = 512
# Decode-sized paged calls run the split programs + combine while their fp32 partials
# (splits x tokens x heads x head dim) fit in this many bytes; bigger calls take the one-pass
# kernel of the same family (the same bits: a launch choice, not numerics).
SPLIT_PARTIAL_BYTES = 256 * 2**20


@dataclass(frozen=True)
class AttentionConfig:
    """Launch configuration; a function of the head dim only (part of the numerics).

    Not only ``block_n`` (the KV tile): the row tile and the warps set the register layout of
    the score tile, hence the order of the row sums of the online softmax. A 16-row, 8-warp
    launch for decode-shaped calls (1.4x the KV bandwidth of this one at 64 x 4k) gave the
    same bits as this launch on full 4k contexts (``benchmarks/sweep_attention_fwd.py``) but
    not on chunked prefill of short ones (1 ulp on 10 of 2.6M outputs, the GPU test
    ``test_gpu_llama_shape_paths_and_numerics``); it is not used. Only the pipeline depth
    changes no bit (the same operations, scheduled earlier)."""

    block_m: int  # rows (query token x group head) per program
    block_n: int  # KV tile (positions), aligned to absolute position 0
    num_warps: int
    num_stages: int


# Checked-in table, keyed by the padded head dim. Nothing here depends on the token count.
# Head dim 128: 3 pipeline stages (sweep on an H200, results/h200/attention_fwd_sweep.json):
# 642 / 629 / 8,772 us against 682 / 677 / 9,286 us with 2 stages at 1 x 4k (32 / 8 heads),
# 2 x 4k (16 / 8), 1 x 16k (32 / 8), and 474 against 488 us for decode at 64 x 4k; bitwise the
# same outputs and log-sum-exps as 2 stages in all four.
_CONFIGS = {
    16: AttentionConfig(64, 64, 4, 2),
    32: AttentionConfig(64, 64, 4, 2),
    64: AttentionConfig(64, 64, 4, 2),
    128: AttentionConfig(64, 64, 4, 3),
    256: AttentionConfig(64, 32, 8, 1),
}


@dataclass(frozen=True)
class BwdKernelConfig:
    """Launch of one backward kernel: rows (query token x group head) and KV positions per tile.
    The backward is only promised deterministic (its bits may change with this table; the
    forward's never do)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# dK/dV (a program per KV tile, looping over row tiles) and dQ (a program per row tile, looping
# over KV tiles), keyed by the padded head dim. Head dim 128: benchmarks/sweep_attention_bwd.py
# on an H200 (results/h200/attention_bwd_sweep.json): 64 x 64 tiles, 4 warps, 2 stages were the
# fastest of 49 candidates per kernel summed over 2 x 4096 (16 / 8 heads) and 16384 (32 / 8)
# tokens: dK/dV 15.1 ms, dQ 9.8 ms against 29.0 / 25.0 ms for the previous 8 warps, 1 stage; the
# gradients were bitwise those of the previous launch (the tile loops accumulate in the same
# order). Smaller head dims take the same launch (fewer registers per tile).
_BWD_CONFIGS = {
    16: (BwdKernelConfig(64, 64, 4, 2), BwdKernelConfig(64, 64, 4, 2)),
    32: (BwdKernelConfig(64, 64, 4, 2), BwdKernelConfig(64, 64, 4, 2)),
    64: (BwdKernelConfig(64, 64, 4, 2), BwdKernelConfig(64, 64, 4, 2)),
    128: (BwdKernelConfig(64, 64, 4, 2), BwdKernelConfig(64, 64, 4, 2)),
    256: (BwdKernelConfig(64, 32, 8, 1), BwdKernelConfig(64, 32, 8, 1)),
}


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def get_config(head_dim: int) -> AttentionConfig:
    """The configuration for ``head_dim`` (raises for an unsupported head dim)."""
    if head_dim % 16 != 0 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"attention[triton]: head_dim {head_dim} is not supported (a multiple of 16 in "
            f"16..{MAX_HEAD_DIM}; e.g. 64, 80, 96, 128, 256); use backend='native'"
        )
    return _CONFIGS[_block_d(head_dim)]


if triton is not None:

    @triton.jit
    def _find_seq(CU, pid, num_seqs, n_search, ROWS_PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
        # Sequence b owns programs [start(b), start(b + 1)) with
        # start(b) = cu[b] * ROWS_PER_TOKEN // BLOCK + b (strictly increasing, and
        # start(b + 1) - start(b) >= cdiv(rows of b, BLOCK)): binary search for the last
        # start <= pid. The grid size depends on the shapes only (CUDA-graph friendly).
        lo = pid * 0
        hi = lo + num_seqs
        for _ in range(n_search):
            mid = (lo + hi) // 2
            start = tl.load(CU + mid) * ROWS_PER_TOKEN // BLOCK + mid
            go = start <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        return lo

    @triton.jit
    def _find_token_seq(CU, t, num_seqs, n_search):
        # The last sequence b in [0, num_seqs) with cu[b] <= t (token t's sequence when t is
        # not padding; empty sequences before it are skipped because cu is non-decreasing).
        lo = t * 0
        hi = lo + num_seqs
        for _ in range(n_search):
            mid = (lo + hi) // 2
            go = tl.load(CU + mid) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        return lo

    @triton.jit
    def _seq_block(CU, num_seqs, n_search, ROWS_PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
        # This program's KV head (program_id(1)); the sequence b (_find_seq) of its block
        # (program_id(0)), the sequence's first packed token and its length, and the first row
        # (token x ROWS_PER_TOKEN) of the block in the sequence (at or past the sequence's rows
        # for a spare program, which then returns).
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        b = _find_seq(CU, pid, num_seqs, n_search, ROWS_PER_TOKEN, BLOCK)
        start = tl.load(CU + b)
        seq_len = tl.load(CU + b + 1) - start
        row0 = (pid - (start * ROWS_PER_TOKEN // BLOCK + b)) * BLOCK
        return kvh, b, start, seq_len, row0

    @triton.jit
    def _row_block(row0, n_rows, kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
        # Rows row0 .. row0 + BLOCK_M - 1 (row = token x G + head of the group) of KV head kvh
        # in a sequence of n_rows rows: in range, token in the sequence, query head.
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        tok = rows // G
        head = kvh * G + rows % G
        return row_ok, tok, head

    @triton.jit
    def _row_ptrs(X, t, h, stride_t, stride_h, offs_d):
        # [rows, BLOCK_D] addresses of X[t, h, :] (a token and a head per row)
        return X + t[:, None] * stride_t + h[:, None] * stride_h + offs_d[None, :]

    @triton.jit
    def _kv_ptrs(X, t, kvh, stride_t, stride_h, offs_d):
        # [positions, BLOCK_D] addresses of X[t, kvh, :] (a token per position, one KV head)
        return X + t[:, None] * stride_t + kvh * stride_h + offs_d[None, :]

    @triton.jit
    def _load_kv_rows(kv, kv_rows, kvh, msk, offs_d):
        # The backward's K and V tiles of packed tokens kv_rows (zero where masked);
        # kv = (K, V, stride_kt, stride_kh, stride_vt, stride_vh)
        K, V, stride_kt, stride_kh, stride_vt, stride_vh = kv
        k = tl.load(_kv_ptrs(K, kv_rows, kvh, stride_kt, stride_kh, offs_d), mask=msk, other=0.0)
        v = tl.load(_kv_ptrs(V, kv_rows, kvh, stride_vt, stride_vh, offs_d), mask=msk, other=0.0)
        return k, v

    @triton.jit
    def _load_q_rows(ops, q_rows, head, row_ok, r_msk, offs_d):
        # The backward's per-row operands of a row block: q, dO (zero where masked), lse, delta;
        # ops = (Q, DO, LSE, DELTA, stride_qt, stride_qh, stride_dot, stride_doh, stride_lt)
        Q, DO, LSE, DELTA, stride_qt, stride_qh, stride_dot, stride_doh, stride_lt = ops
        q = tl.load(_row_ptrs(Q, q_rows, head, stride_qt, stride_qh, offs_d), mask=r_msk, other=0.0)
        do = tl.load(
            _row_ptrs(DO, q_rows, head, stride_dot, stride_doh, offs_d), mask=r_msk, other=0.0
        )
        lse = tl.load(LSE + q_rows * stride_lt + head, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + q_rows * stride_lt + head, mask=row_ok, other=0.0)
        return q, do, lse, delta

    @triton.jit
    def _attend_tile(
        q,
        kv,
        blk,
        qk_scale,
        j,
        m_i,
        l_i,
        acc,
        BLOCK_N: tl.constexpr,
        PAGED: tl.constexpr,
        CAUSAL: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        # KV tile j: one step of the online softmax (module docstring), in base 2: the running
        # max m is in units of log2 (scores times qk_scale = scale * log2(e)). MASKED=False is
        # for a tile every row of the block sees whole (no position past a row's own, none past
        # kv_len): it skips the masks, and for a row that sees the whole tile both variants run
        # the same operations on the same values (a masked score is -inf and adds an exact 0).
        # kv: the keys / values and their addressing (_attention_fwd_kernel); blk: the row block.
        K, V, BLOCK_TABLE, page_size, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, \
            stride_vh, stride_bt = kv  # fmt: skip
        b, kvh, q_start, kv_len, q_pos, row_ok, offs_d, d_ok = blk
        kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_len
        if MASKED:
            ld_msk = kv_ok[:, None] & d_ok[None, :]
        else:
            ld_msk = d_ok[None, :]
        if PAGED:
            if MASKED:
                page = tl.load(
                    BLOCK_TABLE + b.to(tl.int64) * stride_bt + kv_pos // page_size,
                    mask=kv_ok,
                    other=0,
                ).to(tl.int64)
            else:
                page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt + kv_pos // page_size)
                page = page.to(tl.int64)
            slot = (kv_pos % page_size).to(tl.int64)
            k_off = page * stride_kb + slot * stride_kt
            v_off = page * stride_vb + slot * stride_vt
        else:
            kv_rows = (q_start + kv_pos).to(tl.int64)
            k_off = kv_rows * stride_kt
            v_off = kv_rows * stride_vt
        kk = tl.load(K + k_off[:, None] + kvh * stride_kh + offs_d[None, :], mask=ld_msk, other=0.0)
        s = tl.dot(q, tl.trans(kk), input_precision="ieee")  # raw scores
        if MASKED:
            mask = row_ok[:, None] & kv_ok[None, :]
            if CAUSAL:
                mask = mask & (kv_pos[None, :] <= q_pos[:, None])
            s = tl.where(mask, s, float("-inf"))
        # max(s) * c == max(s * c) (rounding is monotonic, c > 0); exponent as one explicit FMA
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_use))
        p = tl.exp2(tl.fma(s, qk_scale, -m_use[:, None]))  # exp2(-inf) = 0: masked scores
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vv = tl.load(V + v_off[:, None] + kvh * stride_vh + offs_d[None, :], mask=ld_msk, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _attend_tiles(
        q,
        kv,
        blk,
        qk_scale,
        j_begin,
        j_end,
        j_full,
        m_i,
        l_i,
        acc,
        BLOCK_N: tl.constexpr,
        PAGED: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        # KV tiles j_begin .. j_end - 1 in order; tiles below j_full (whole for every row of the
        # block) without masks, the rest with them.
        j_mid = tl.minimum(tl.maximum(j_full, j_begin), j_end)
        for j in range(j_begin, j_mid):
            m_i, l_i, acc = _attend_tile(
                q, kv, blk, qk_scale, j, m_i, l_i, acc, BLOCK_N, PAGED, CAUSAL, False
            )
        for j in range(j_mid, j_end):
            m_i, l_i, acc = _attend_tile(
                q, kv, blk, qk_scale, j, m_i, l_i, acc, BLOCK_N, PAGED, CAUSAL, True
            )
        return m_i, l_i, acc

    @triton.jit
    def _row_tiles(row_ok, pos, kv_len, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        # The KV tiles of a row block whose rows sit at positions pos of kv_len: n_tiles (up to
        # the tile of its last row's position; all of kv_len without CAUSAL), and j_full: the
        # tiles below it every row of the block sees whole (up to its first row's position).
        if CAUSAL:
            hi = tl.minimum(tl.max(tl.where(row_ok, pos, 0), axis=0) + 1, kv_len)
            j_full = (tl.min(tl.where(row_ok, pos, kv_len), axis=0) + 1) // BLOCK_N
        else:
            hi = kv_len
            j_full = kv_len // BLOCK_N
        return tl.cdiv(hi, BLOCK_N), j_full

    @triton.jit
    def _store_cast(ptrs, x, mask):
        # x rounded once to the destination's dtype
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _merge_split(m_t, l_t, acc_t, m_s, l_s, acc_s):
        # The running state (m_t, l_t, acc_t) absorbs one KV split's (m_s, l_s, acc_s); a split
        # that saw no key (l_s == 0) is skipped, so visiting more (fully masked) splits cannot
        # change a row. Explicit FMAs: the same operations wherever this is inlined.
        m_new = tl.maximum(m_t, m_s)
        a = tl.where(m_new == m_t, 1.0, tl.exp2(m_t - m_new))
        b = tl.where(m_new == m_s, 1.0, tl.exp2(m_s - m_new))
        take = l_s > 0.0
        l_new = tl.fma(l_t, a, l_s * b)
        acc_new = tl.fma(acc_t, a[:, None], acc_s * b[:, None])
        return (
            tl.where(take, m_new, m_t),
            tl.where(take, l_new, l_t),
            tl.where(take[:, None], acc_new, acc_t),
        )

    @triton.jit
    def _attention_fwd_kernel(
        Q,
        K,
        V,
        OUT,
        LSE,
        CU_Q,
        SEQ_LENS,
        BLOCK_TABLE,
        PART_ML,
        PART_ACC,
        num_seqs,
        n_search,
        page_size,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_bt,
        stride_lt,
        stride_ps,
        qk_scale,
        G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGED: tl.constexpr,
        CAUSAL: tl.constexpr,
        STORE_LSE: tl.constexpr,
        SPLIT_TILES: tl.constexpr,
        SPLIT_PROGRAM: tl.constexpr,
    ):
        # SPLIT_TILES = 0: one online softmax over all tiles (family attention/triton).
        # SPLIT_TILES > 0: the tiles in splits of SPLIT_TILES (fixed positions from 0), each its
        # own online softmax, merged in order (_merge_split); SPLIT_PROGRAM: this program
        # computes split program_id(2) only and stores its (m, l, acc) in PART_* for
        # _attention_combine_kernel, which merges them in the same order.
        kvh, b, q_start, q_len, row0 = _seq_block(CU_Q, num_seqs, n_search, G, BLOCK_M)
        if row0 >= q_len * G:
            return
        row_ok, tok, head = _row_block(row0, q_len * G, kvh, G, BLOCK_M)
        if PAGED:
            kv_len = tl.load(SEQ_LENS + b)
        else:
            kv_len = q_len
        q_pos = kv_len - q_len + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + tok).to(tl.int64)
        n_tiles, j_full = _row_tiles(row_ok, q_pos, kv_len, BLOCK_N, CAUSAL)
        if SPLIT_PROGRAM:
            j_begin = tl.program_id(2) * SPLIT_TILES
            if j_begin >= n_tiles:
                return
        q = tl.load(
            _row_ptrs(Q, q_rows, head, stride_qt, stride_qh, offs_d),
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv = (K, V, BLOCK_TABLE, page_size, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
              stride_vh, stride_bt)  # fmt: skip
        blk = (b, kvh, q_start, kv_len, q_pos, row_ok, offs_d, d_ok)
        if SPLIT_PROGRAM:
            j_end = tl.minimum(j_begin + SPLIT_TILES, n_tiles)
            m_i, l_i, acc = _attend_tiles(
                q, kv, blk, qk_scale, j_begin, j_end, j_full, m_i, l_i, acc, BLOCK_N, PAGED, CAUSAL
            )
            split = tl.program_id(2).to(tl.int64) * stride_ps
            hrow = q_rows * stride_lt + head
            tl.store(PART_ML + split * 2 + hrow * 2, m_i, mask=row_ok)
            tl.store(PART_ML + split * 2 + hrow * 2 + 1, l_i, mask=row_ok)
            tl.store(
                PART_ACC + split * BLOCK_D + hrow[:, None] * BLOCK_D + offs_d[None, :],
                acc,
                mask=row_ok[:, None],
            )
            return
        if SPLIT_TILES == 0:
            m_i, l_i, acc = _attend_tiles(
                q, kv, blk, qk_scale, 0, n_tiles, j_full, m_i, l_i, acc, BLOCK_N, PAGED, CAUSAL
            )
        else:
            m_t = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_t = tl.zeros([BLOCK_M], tl.float32)
            acc_t = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for j0 in range(0, n_tiles, SPLIT_TILES):
                j_end = tl.minimum(j0 + SPLIT_TILES, n_tiles)
                m_s, l_s, acc_s = _attend_tiles(
                    q, kv, blk, qk_scale, j0, j_end, j_full, m_i, l_i, acc, BLOCK_N, PAGED, CAUSAL
                )
                m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m_s, l_s, acc_s)
            m_i, l_i, acc = m_t, l_t, acc_t
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            _row_ptrs(OUT, q_rows, head, stride_ot, stride_oh, offs_d),
            out.to(OUT.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        if STORE_LSE:
            lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # base 2 -> natural log
            tl.store(LSE + q_rows * stride_lt + head, lse, mask=row_ok)

    @triton.jit
    def _attention_combine_kernel(
        OUT,
        CU_Q,
        SEQ_LENS,
        PART_ML,
        PART_ACC,
        num_seqs,
        n_search,
        stride_ot,
        stride_oh,
        stride_ps,
        HQ: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_TILES: tl.constexpr,
    ):
        # One token (all its query heads): merge its splits 0 .. (the split of its position) in
        # order with _merge_split, then normalise as the single-pass kernel does. Splits past
        # the token's position were fully masked for it (skipped by the merge either way).
        t = tl.program_id(0)
        b = _find_token_seq(CU_Q, t, num_seqs, n_search)
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
        if t - q_start >= q_len:  # padding after the last sequence
            return
        q_pos = tl.load(SEQ_LENS + b) - q_len + (t - q_start)
        n_split = tl.cdiv(tl.cdiv(q_pos + 1, BLOCK_N), SPLIT_TILES)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = offs_h < HQ
        hrow = t.to(tl.int64) * HQ + offs_h
        m_t = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_t = tl.zeros([BLOCK_H], tl.float32)
        acc_t = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for sp in range(0, n_split):
            split = sp * stride_ps
            m_s = tl.load(PART_ML + split * 2 + hrow * 2, mask=h_ok, other=float("-inf"))
            l_s = tl.load(PART_ML + split * 2 + hrow * 2 + 1, mask=h_ok, other=0.0)
            acc_s = tl.load(
                PART_ACC + split * BLOCK_D + hrow[:, None] * BLOCK_D + offs_d[None, :],
                mask=h_ok[:, None],
                other=0.0,
            )
            m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m_s, l_s, acc_s)
        l_safe = tl.where(l_t == 0.0, 1.0, l_t)
        out = acc_t / l_safe[:, None]
        tl.store(
            OUT + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        )

    @triton.jit
    def _attention_bwd_delta_kernel(
        OUT,
        DO,
        DELTA,
        n_rows,
        n_heads,
        stride_ot,
        stride_oh,
        stride_dot,
        stride_doh,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < n_rows
        t = (rows // n_heads).to(tl.int64)
        h = rows % n_heads
        offs_d = tl.arange(0, BLOCK_D)
        msk = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        o = tl.load(_row_ptrs(OUT, t, h, stride_ot, stride_oh, offs_d), mask=msk, other=0.0)
        do = tl.load(_row_ptrs(DO, t, h, stride_dot, stride_doh, offs_d), mask=msk, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + rows, delta, mask=ok)

    @triton.jit
    def _dkdv_block(
        ops, tile, dk, dv, i, qk_scale,
        G: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        # Row block i's share of the KV tile's dK / dV. MASKED=False: a block whose rows are all
        # in the sequence and all at or past the tile's last position (no mask needed). ops: the
        # per-row operands (_load_q_rows); tile: the KV tile (_attention_bwd_dkdv_kernel).
        k, v, start, kv_pos, kv_ok, kvh, n_rows, offs_d, d_ok = tile
        row_ok, tok, head = _row_block(i * BLOCK_M, n_rows, kvh, G, BLOCK_M)
        q_rows = (start + tok).to(tl.int64)
        if MASKED:
            r_msk = row_ok[:, None] & d_ok[None, :]
        else:
            r_msk = d_ok[None, :]
        q, do, lse, delta = _load_q_rows(ops, q_rows, head, row_ok, r_msk, offs_d)
        st = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BLOCK_N, BLOCK_M] raw scores
        pt = tl.exp2(st * qk_scale - (lse * 1.4426950408889634)[None, :])
        if MASKED:
            mask = kv_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                mask = mask & (kv_pos[:, None] <= tok[None, :])
            pt = tl.where(mask, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision="ieee")
        dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
        dst = pt * (dpt - delta[None, :])
        if MASKED:
            dst = tl.where(mask, dst, 0.0)
        dk += tl.dot(dst.to(q.dtype), q, input_precision="ieee")
        return dk, dv

    @triton.jit
    def _dq_tile(
        kv, rows, dq, j, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr
    ):
        # KV tile j's share of the row block's dQ. MASKED=False: a tile every row of the block
        # sees whole (padding rows, with zero q / dO, add exact zeros and are not stored). kv:
        # the keys / values (_load_kv_rows); rows: the row block (_attention_bwd_dq_kernel).
        q, do, lse2, delta, start, seq_len, kvh, row_ok, tok, offs_d, d_ok = rows
        kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < seq_len
        kv_rows = (start + kv_pos).to(tl.int64)
        if MASKED:
            t_msk = kv_ok[:, None] & d_ok[None, :]
        else:
            t_msk = d_ok[None, :]
        kk, vv = _load_kv_rows(kv, kv_rows, kvh, t_msk, offs_d)
        s = tl.dot(q, tl.trans(kk), input_precision="ieee")
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            mask = row_ok[:, None] & kv_ok[None, :]
            if CAUSAL:
                mask = mask & (kv_pos[None, :] <= tok[:, None])
            p = tl.where(mask, p, 0.0)
        dp = tl.dot(do, tl.trans(vv), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        if MASKED:
            ds = tl.where(mask, ds, 0.0)
        dq += tl.dot(ds.to(kk.dtype), kk, input_precision="ieee")
        return dq

    @triton.jit
    def _attention_bwd_dkdv_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        CU,
        num_seqs,
        n_search,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_dot,
        stride_doh,
        stride_dkt,
        stride_dkh,
        stride_dvt,
        stride_dvh,
        stride_lt,
        scale,
        qk_scale,
        G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        kvh, b, start, seq_len, n0 = _seq_block(CU, num_seqs, n_search, 1, BLOCK_N)
        if n0 >= seq_len:
            return
        kv_pos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < seq_len
        kv_rows = (start + kv_pos).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        kv_msk = kv_ok[:, None] & d_ok[None, :]
        k, v = _load_kv_rows(
            (K, V, stride_kt, stride_kh, stride_vt, stride_vh), kv_rows, kvh, kv_msk, offs_d
        )
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        n_rows = seq_len * G
        i_end = tl.cdiv(n_rows, BLOCK_M)
        i_whole = n_rows // BLOCK_M  # blocks below this one have every row in the sequence
        if CAUSAL:
            i_first = (n0 * G) // BLOCK_M
            # blocks from i_free on start at or past the tile's last position
            i_free = tl.maximum(tl.cdiv((n0 + BLOCK_N - 1) * G, BLOCK_M), i_first)
        else:
            i_first = 0
            i_free = 0
        if n0 + BLOCK_N > seq_len:  # a tile past the sequence's end: masks everywhere
            i_free = i_end
        ops = (Q, DO, LSE, DELTA, stride_qt, stride_qh, stride_dot, stride_doh, stride_lt)
        tile = (k, v, start, kv_pos, kv_ok, kvh, n_rows, offs_d, d_ok)
        # in order: masked blocks (diagonal), unmasked ones, masked ones (the partial last)
        for i in range(i_first, i_free):
            dk, dv = _dkdv_block(ops, tile, dk, dv, i, qk_scale, G, BLOCK_M, CAUSAL, True)
        for i in range(i_free, i_whole):
            dk, dv = _dkdv_block(ops, tile, dk, dv, i, qk_scale, G, BLOCK_M, CAUSAL, False)
        for i in range(tl.maximum(i_free, i_whole), i_end):
            dk, dv = _dkdv_block(ops, tile, dk, dv, i, qk_scale, G, BLOCK_M, CAUSAL, True)
        dk = dk * scale
        _store_cast(_kv_ptrs(DK, kv_rows, kvh, stride_dkt, stride_dkh, offs_d), dk, kv_msk)
        _store_cast(_kv_ptrs(DV, kv_rows, kvh, stride_dvt, stride_dvh, offs_d), dv, kv_msk)

    @triton.jit
    def _attention_bwd_dq_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        CU,
        num_seqs,
        n_search,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_dot,
        stride_doh,
        stride_dqt,
        stride_dqh,
        stride_lt,
        scale,
        qk_scale,
        G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        kvh, b, start, seq_len, row0 = _seq_block(CU, num_seqs, n_search, G, BLOCK_M)
        if row0 >= seq_len * G:
            return
        row_ok, tok, head = _row_block(row0, seq_len * G, kvh, G, BLOCK_M)
        q_rows = (start + tok).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        r_msk = row_ok[:, None] & d_ok[None, :]
        ops = (Q, DO, LSE, DELTA, stride_qt, stride_qh, stride_dot, stride_doh, stride_lt)
        q, do, lse, delta = _load_q_rows(ops, q_rows, head, row_ok, r_msk, offs_d)
        n_tiles, j_full = _row_tiles(row_ok, tok, seq_len, BLOCK_N, CAUSAL)
        j_full = tl.minimum(j_full, n_tiles)
        lse2 = lse * 1.4426950408889634  # base 2, as the scores
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv = (K, V, stride_kt, stride_kh, stride_vt, stride_vh)
        rows = (q, do, lse2, delta, start, seq_len, kvh, row_ok, tok, offs_d, d_ok)
        for j in range(0, j_full):
            dq = _dq_tile(kv, rows, dq, j, qk_scale, BLOCK_N, CAUSAL, False)
        for j in range(j_full, n_tiles):
            dq = _dq_tile(kv, rows, dq, j, qk_scale, BLOCK_N, CAUSAL, True)
        dq = dq * scale
        _store_cast(_row_ptrs(DQ, q_rows, head, stride_dqt, stride_dqh, offs_d), dq, r_msk)

    @triton.jit
    def _write_kv_cache_kernel(
        K,
        V,
        KC,
        VC,
        SLOTS,
        page_size,
        num_slots,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kct,
        stride_kch,
        stride_vcb,
        stride_vct,
        stride_vch,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        N_HEADS: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if (slot < 0) | (slot >= num_slots):  # skip (-1); never a write outside the cache
            return
        blk = slot // page_size
        off = slot % page_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        msk = (offs_h < N_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=msk)
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=msk)
        kc = KC + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch
        vc = VC + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch
        tl.store(kc + offs_d[None, :], k, mask=msk)
        tl.store(vc + offs_d[None, :], v, mask=msk)


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``: a cached launcher for CUDA tensors, interpreted for CPU tensors."""
    return _triton.launcher(globals()[name], device)


def _check_device(t: torch.Tensor) -> None:
    _triton.check_device("attention", t)


def _check_query(q: torch.Tensor) -> None:
    """The Triton-only checks of a query (or of the backward's q): a device the kernels run on,
    no bfloat16 in the interpreter, a supported head dim (:func:`get_config`)."""
    _check_device(q)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise TypeError(
            "attention[triton]: bfloat16 is not supported in the Triton interpreter (its bf16 "
            "tl.dot is wrong); use float32 / float16 there, or backend='native'"
        )
    get_config(q.shape[2])


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention[triton]: the caches need a unit stride on head_dim")


_guard = _triton.device_guard


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride on the last dim (an exact copy only when needed)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _n_search(num_seqs: int) -> int:
    return max(1, int(num_seqs).bit_length())


def _th_strides(*ts: torch.Tensor) -> tuple[int, ...]:
    """The (token, head) strides of each [T, H, ...] tensor in turn: the kernels'
    ``stride_<x>t, stride_<x>h`` arguments."""
    return tuple(st for t in ts for st in (t.stride(0), t.stride(1)))


def _launch_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    cu_q: torch.Tensor,
    seq_lens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    scale: float,
    causal: bool,
    split_tiles: int = 0,
    config: AttentionConfig | None = None,
) -> None:
    """The forward kernel; with ``split_tiles`` > 0 the split family, and for a paged call with
    few query rows (decode) the split programs + the combine kernel (the same bits as the one
    pass, more programs in flight). ``config`` replaces the shipped launch: for
    ``benchmarks/sweep_attention_fwd.py`` only, which checks each candidate's bits."""
    t, hq, d = q.shape
    paged = k.dim() == 4
    hkv = k.shape[-2]
    g = hq // hkv
    num_seqs = cu_q.shape[0] - 1
    cfg = get_config(d)
    if config is not None:  # the sweep's candidates (it checks their bits against cfg's)
        if config.block_n != cfg.block_n:
            raise ValueError(f"attention[triton]: block_n is numerics ({cfg.block_n} here)")
        cfg = config
    if t == 0 or num_seqs == 0:
        return
    grid = (t * g // cfg.block_m + num_seqs, hkv)
    # (block, token, head) strides of the keys and values; packed rows have no block
    if paged:
        kv_strides = (*k.stride()[:3], *v.stride()[:3])
        page_size = k.shape[1]
        bt, bt_stride = block_table, block_table.stride(0)
        lens = seq_lens
    else:
        kv_strides = (0, *_th_strides(k), 0, *_th_strides(v))
        page_size, bt, bt_stride, lens = 1, cu_q, 0, cu_q
    block_d = _block_d(d)
    # split programs: decode-sized paged calls (a shape-only choice, CUDA-graph friendly)
    n_split = 0
    if split_tiles and paged:
        n_split = _triton.cdiv(block_table.shape[1] * page_size, split_tiles * cfg.block_n)
        if n_split * t * hq * block_d * 4 > SPLIT_PARTIAL_BYTES:
            n_split = 0
    part_ml, part_acc = out, out  # not read unless n_split
    if n_split:
        part_ml = torch.empty((n_split, t, hq, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((n_split, t, hq, block_d), dtype=torch.float32, device=q.device)
        grid = (*grid, n_split)
    with _guard(q):
        _kernel("_attention_fwd_kernel", q.device)[grid](
            q,
            k,
            v,
            out,
            lse if lse is not None else out,
            cu_q,
            lens,
            bt,
            part_ml,
            part_acc,
            num_seqs,
            _n_search(num_seqs),
            page_size,
            *_th_strides(q),
            *kv_strides,
            *_th_strides(out),
            bt_stride,
            hq,
            t * hq,
            scale * LOG2E,  # the kernel's scores are in base 2
            G=g,
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            PAGED=paged,
            CAUSAL=causal,
            STORE_LSE=lse is not None,
            SPLIT_TILES=split_tiles,
            SPLIT_PROGRAM=bool(n_split),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if n_split:
            _kernel("_attention_combine_kernel", q.device)[(t,)](
                out,
                cu_q,
                lens,
                part_ml,
                part_acc,
                num_seqs,
                _n_search(num_seqs),
                *_th_strides(out),
                t * hq,
                HQ=hq,
                HEAD_DIM=d,
                BLOCK_H=triton.next_power_of_2(hq),
                BLOCK_D=block_d,
                BLOCK_N=cfg.block_n,
                SPLIT_TILES=split_tiles,
                num_warps=4,
            )


def _split_tiles(head_dim: int, split: bool) -> int:
    return SPLIT_POSITIONS // get_config(head_dim).block_n if split else 0


@signature_of(reference.attention)
def attention(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill (Triton). Same contract as :func:`reference.attention`; returns (out, lse).

    ``cu_seqlens`` is trusted (not read back on the host): it must start at 0, be
    non-decreasing and end at ``T``.
    """
    return _attention(*args, split=False)


def _attention(q, k, v, cu_seqlens, scale=None, causal=True, *, split: bool):
    reference._check_attention(q, k, v, cu_seqlens, scale, causal)
    _check_query(q)
    scale = reference.default_scale(q.shape[2], scale)
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    cu_seqlens = cu_seqlens.contiguous()  # the kernels index metadata with unit stride
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    tiles = _split_tiles(q.shape[2], split)
    _launch_fwd(q, k, v, out, lse, cu_seqlens, None, None, scale, causal, tiles)
    return out, lse


@signature_of(reference.paged_attention)
def paged_attention(*args: Any) -> torch.Tensor:
    """Paged prefill / decode (Triton): the prefill kernel with ``PAGED=True``.

    The metadata (offsets, lengths, block ids) is trusted (not read back on the host).
    """
    return _paged(*args, split=False)


def _paged(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start_loc,
    scale=None,
    out=None,
    *,
    split: bool,
):
    reference._check_paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    _check_query(q)
    _check_caches(k_cache, v_cache)
    scale = reference.default_scale(q.shape[2], scale)
    q = _last_contig(q)
    # the kernels index metadata with unit stride (a no-op for the usual contiguous slices)
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    block_table = _last_contig(block_table)
    if out is None:
        out = torch.zeros_like(q)  # padding tokens after query_start_loc[-1] stay zero
    tiles = _split_tiles(q.shape[2], split)
    _launch_fwd(
        q, k_cache, v_cache, out, None, query_start_loc, seq_lens, block_table, scale, True, tiles
    )
    return out


@signature_of(reference.paged_attention_out)
def paged_attention_out(*args: Any) -> None:
    """:func:`paged_attention` written into ``out`` (the sequences' rows; padding untouched)."""
    _paged(*args, split=False)


@signature_of(reference.write_kv_cache)
def write_kv_cache(*args: Any) -> None:
    """Exact copy of ``k`` / ``v`` into the caches at ``slot_mapping`` (``-1`` skips)."""
    k, v, k_cache, v_cache, slot_mapping = args
    reference._check_write(k, v, k_cache, v_cache, slot_mapping)
    _check_device(k)
    _check_caches(k_cache, v_cache)
    t, hkv, d = k.shape
    if t == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    reference.check_slots(slot_mapping, num_slots, on_device=False)
    k, v = _last_contig(k), _last_contig(v)
    slot_mapping = slot_mapping.contiguous()
    with _guard(k):
        _kernel("_write_kv_cache_kernel", k.device)[(t,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_cache.shape[1],
            num_slots,
            *_th_strides(k, v),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            HEAD_DIM=d,
            BLOCK_H=triton.next_power_of_2(hkv),
            BLOCK_D=triton.next_power_of_2(d),
            N_HEADS=hkv,
        )


@signature_of(reference.attention_bwd)
def attention_bwd(
    *args: Any,
    bwd_configs: tuple[BwdKernelConfig, BwdKernelConfig] | None = None,
    kernels: tuple[str, ...] = ("delta", "dkdv", "dq"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic backward (Triton): delta, dK/dV (loop over row blocks), dQ (loop over tiles).

    ``bwd_configs`` (dK/dV, dQ) overrides the checked-in table and ``kernels`` runs a subset
    (both for ``benchmarks/sweep_attention_bwd.py``; a subset leaves the other outputs unset)."""
    dout, q, k, v, out, lse, cu_seqlens, scale, causal = args
    _check_query(q)
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dout, q, k, v, out = (_last_contig(x) for x in (dout, q, k, v, out))
    lse, cu_seqlens = lse.contiguous(), cu_seqlens.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    num_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or num_seqs == 0:
        return dq, dk, dv
    bd = _block_d(d)
    cfg_kv, cfg_q = bwd_configs if bwd_configs is not None else _BWD_CONFIGS[bd]
    delta = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    block_r = 32
    strides = _th_strides(q, k, v, dout)
    common = dict(G=g, HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal)
    with _guard(q):
        if "delta" in kernels:
            _kernel("_attention_bwd_delta_kernel", q.device)[(_triton.cdiv(t * hq, block_r),)](
                out,
                dout,
                delta,
                t * hq,
                hq,
                *_th_strides(out, dout),
                HEAD_DIM=d,
                BLOCK_D=bd,
                BLOCK_R=block_r,
            )
        # dK/dV: a program per KV tile; dQ: a program per row tile. Same operands, then the
        # kernel's outputs and their (token, head) strides.
        for name, n_tiles, cfg, outs in (
            ("dkdv", t // cfg_kv.block_n, cfg_kv, (dk, dv)),
            ("dq", t * g // cfg_q.block_m, cfg_q, (dq,)),
        ):
            if name not in kernels:
                continue
            _kernel(f"_attention_bwd_{name}_kernel", q.device)[(n_tiles + num_seqs, hkv)](
                q,
                k,
                v,
                dout,
                lse,
                delta,
                *outs,
                cu_seqlens,
                num_seqs,
                _n_search(num_seqs),
                *strides,
                *_th_strides(*outs),
                hq,
                scale,
                scale * LOG2E,
                **common,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
    return dq, dk, dv


PROVIDER = _triton.triton_provider(
    numerics="attention/triton",
    fn=attention,
    version="2",
    extras={
        "attention_bwd": attention_bwd,
        "paged_attention": paged_attention,
        "paged_attention_out": paged_attention_out,
        "write_kv_cache": write_kv_cache,
    },
)


def _split_variant(public: Any, impl: Any) -> Any:
    """``public`` of the split family: the same signature (the registry checks it), calling
    ``impl(..., split=True)``."""

    @functools.wraps(public)
    def variant(*args: Any, **kwargs: Any) -> Any:
        return impl(*args, **kwargs, split=True)

    variant.__name__ = variant.__qualname__ = public.__name__ + "_split"
    variant.__doc__ = f":func:`{public.__name__}` of the split family (module docstring)."
    return variant


attention_split = _split_variant(attention, _attention)
paged_attention_split = _split_variant(paged_attention, _paged)
paged_attention_out_split = _split_variant(paged_attention_out, _paged)

# The split family: the same kernels with KV splits fixed in positions; decode gets more
# programs in flight (split-KV) at the same bits as its own prefill. Chosen by a pin
# (RL_ENGINE_BACKEND_ATTENTION=triton_split) on both sides; the default stays ``triton``.
SPLIT_PROVIDER = dataclasses.replace(
    PROVIDER,
    name="triton_split",
    numerics=f"attention/triton-s{SPLIT_POSITIONS}",
    fn=attention_split,
    extras={
        **PROVIDER.extras,
        "paged_attention": paged_attention_split,
        "paged_attention_out": paged_attention_out_split,
    },
)
