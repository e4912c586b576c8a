"""``triton`` provider of ``moe_experts``: the routed experts as two grouped GEMMs (fused_moe style).

Numerics (family ``moe_experts/triton-kc4096``, built from ``det_gemm/triton-kc4096`` and
``silu_and_mul/triton-f32``). For every slot ``(t, s)`` with local expert ``e``::

    h   = det_gemm(x[t], w13[e].T)        # [2I], x.dtype, K = H
    a   = silu_and_mul(h)                 # [I],  x.dtype
    y   = det_gemm(a, w2[e].T)            # [H],  x.dtype, K = I

each product through the same reduction as the ``triton`` provider of ``det_gemm``: K in chunks of
``K_CHUNK`` columns, each chunk accumulated sequentially (``tl.dot`` chained over ``BLOCK_K``
steps) into a fresh fp32 partial, partials added in chunk order (one chunk: the partial itself),
one rounding to ``x.dtype``; the activation by the instruction sequence of the ``silu_and_mul``
Triton kernel on the rounded gate / up values. So a slot's output row is **bitwise** the row
those two providers give for that token alone, whatever the number of tokens routed to the
expert, their order or the tile shapes (the tile table below is picked by the average number of
rows per expert: a launch choice only; GPU tests prove every shipped config equal). Slots of
experts that are not local (``expert_map[id] == -1``) get +0 rows.

The plan (vLLM's fused_moe idea, own code, every step of static shape on the device: no host
sync, CUDA-graph capturable):

1. alignment (torch ops): slots sorted by local expert (stable: slot order within an expert),
   each expert's run padded to a multiple of ``BLOCK_M``; ``slots[p]`` the slot at padded
   position ``p`` (or ``S``: padding), ``block_expert[b]`` the expert of block ``b`` (``E``: the
   non-local slots' block, ``E + 1``: past the end). The grid is the static maximum number of
   blocks, ``cdiv(S, BLOCK_M) + min(E + 1, S)``.
2. kernel 1: gathered token rows @ ``w13[e].T``, gate and up columns of one tile in one program,
   each rounded to ``x.dtype``, then ``silu(gate) * up`` -> ``act`` [padded rows, I].
3. kernel 2: ``act`` rows @ ``w2[e].T`` -> ``y`` rows scattered to their slots ([T * k, H]).

Expert tensor parallelism (extra ``subtree``, :func:`moe_experts_subtree`): kernel 2 with a
``GROUPS`` constexpr computes the down projection as this rank's fp32 subtree of the TP-invariant
reduction (:mod:`rl_engine.ops.det_gemm.tp`): the ``I`` columns in ``GROUPS`` equal groups, each
group's product in det_gemm's weight-gradient order, the adjacent-pair tree over them (det_gemm's
TP subtree kernel's tile code, ``_tp_subtree_tile``), fp32 rows, not rounded.

Backward (recomputes ``h`` with kernel 1): ``dact = dy[slot] @ w2[e]`` (kernel 2's GEMM with the
weight transposed: det_gemm's ``da = det_gemm(grad, b.t())``), ``dh = silu_and_mul_backward``,
``dx_slot = dh @ w13[e]``, ``dx[t] = sum over slots s in order (fp32, one rounding)``. Weight
gradients per expert: ``dw2[e] = (act_e.T @ dy_e).T``, ``dw13[e] = (x_e.T @ dh_e).T`` through
the weight-gradient reduction of ``det_gemm``'s Triton provider over the expert's rows in slot
order (chunks of ``WGRAD_CHUNK`` rows, each into a fresh fp32 partial, partials in order), one
rounding to the weight dtype: deterministic, and bitwise ``det_gemm_wgrad`` of the expert's rows.

Not promised: identity with the ``native`` family, across GPU models or Triton versions. On the
CPU the kernels run in the Triton interpreter (fp32 / fp16; ``BLOCK_K`` 16, 16-bit tiles widened
to fp32 as ``det_gemm`` does there), a test vehicle whose bits are not the GPU's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.det_gemm.config import INTERPRETER_BLOCK_K, K_CHUNK, WGRAD_CHUNK
from rl_engine.ops.moe_experts import reference
from rl_engine.ops.moe_experts.reference import _check, sum_slots

__all__ = [
    "PROVIDER",
    "MoeGemmConfig",
    "align",
    "get_config",
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_subtree",
]


@dataclass(frozen=True)
class MoeGemmConfig:
    """Launch configuration of the grouped GEMMs (performance only: the bits never depend on it).

    ``block_m`` rows of one expert per program (the alignment unit, shared by both kernels),
    ``block_n`` output columns (kernel 1: ``block_n`` gate and ``block_n`` up columns),
    ``block_k`` the K step (divides ``K_CHUNK``). ``down``: kernel 2's own ``(block_n, block_k,
    num_warps, num_stages)`` (N = hidden, K = the expert FFN: another shape than kernel 1's);
    ``None``: kernel 1's.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    down: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        blocks = {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k}
        if self.down is not None:
            blocks.update(down_block_n=self.down[0], down_block_k=self.down[1])
        for name, v in blocks.items():
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 16")
        for name in ("block_k", "down_block_k"):
            if name in blocks and K_CHUNK % blocks[name]:
                raise ValueError(f"{name}={blocks[name]} must divide K_CHUNK={K_CHUNK}")

    def for_down(self) -> MoeGemmConfig:
        """Kernel 2's config (the same ``block_m``)."""
        if self.down is None:
            return self
        n, k, warps, stages = self.down
        return MoeGemmConfig(self.block_m, n, k, warps, stages)

    def for_subtree(self, groups: int) -> MoeGemmConfig:
        """Kernel 2's config for the grouped (TP subtree) down projection: :meth:`for_down`
        with ``block_n`` halved until the tile fits the register budget of its pair tree
        (``log2(groups)`` waiting levels + the running product: 64 fp32 a thread per tile for
        up to 2 groups, 32 beyond). A launch choice only (PROVISIONAL: the budget rule of
        ``det_gemm``'s TP table, not tuned on a GPU)."""
        down = self.for_down()
        cap = (64 if groups <= 2 else 32) * 32 * down.num_warps
        block_n = down.block_n
        while down.block_m * block_n > cap and block_n > 16:
            block_n //= 2
        return dataclasses.replace(down, block_n=block_n)

    def for_interpreter(self) -> MoeGemmConfig:
        return dataclasses.replace(self, block_k=INTERPRETER_BLOCK_K)


_C = MoeGemmConfig
# (max average rows per expert, config); the first row that fits wins. 16-bit inputs. Kernel 1
# computes block_n gate and block_n up columns: a block_n here is 2 * block_n of a kernel over
# the fused [2I] gate/up output. Decode rows (few rows per expert): narrow tiles for more
# programs; prefill: 128-row tiles, 8 warps. The first row (one or two tokens at 64-128
# experts): kernel 1's block_n 64, the best of `benchmarks/sweep_moe_experts.py --ts 1` on an
# H100 (38.7 us against 41.4 us with 32; 2026-11-28, results/h100/session16_gpu/).
_TABLE_16BIT: tuple[tuple[float, MoeGemmConfig], ...] = (
    (0.125, _C(16, 64, 64, num_warps=4, num_stages=5, down=(64, 64, 4, 5))),
    (2, _C(16, 32, 128, num_warps=4, num_stages=3, down=(64, 128, 4, 3))),
    (8, _C(16, 64, 128, num_warps=4, num_stages=3, down=(128, 128, 4, 3))),
    (16, _C(32, 128, 128, num_warps=4, num_stages=2, down=(256, 128, 4, 2))),
    (32, _C(64, 64, 64, num_warps=4, num_stages=3, down=(128, 64, 4, 3))),
    (float("inf"), _C(128, 128, 64, num_warps=8, num_stages=4, down=(256, 64, 8, 4))),
)
_TABLE_FP32: tuple[tuple[float, MoeGemmConfig], ...] = (
    (16, _C(16, 32, 32, num_warps=4, num_stages=3)),
    (float("inf"), _C(32, 64, 32, num_warps=4, num_stages=3)),
)
# weight gradient: (block_o, block_n, block_t) tiles of the [O, N] gradient, token step block_t
_WGRAD_16BIT = (64, 64, 64, 4, 3)
_WGRAD_FP32 = (32, 32, 32, 4, 3)


def get_config(rows: int, n_experts: int, dtype: torch.dtype) -> MoeGemmConfig:
    """The config for ``rows`` slots over ``n_experts`` local experts (a launch choice only)."""
    avg = rows / max(1, n_experts)
    table = _TABLE_FP32 if dtype == torch.float32 else _TABLE_16BIT
    for limit, cfg in table:
        if avg <= limit:
            return cfg
    return table[-1][1]


def all_configs(dtype: torch.dtype) -> list[MoeGemmConfig]:
    """Every config the table can return for ``dtype`` (for the tests)."""
    table = _TABLE_FP32 if dtype == torch.float32 else _TABLE_16BIT
    return [cfg for _, cfg in table]


if triton is not None:
    # ``acc + a @ b``, the TP subtree tile and the weight-gradient steps exactly as det_gemm's
    # kernels compute them: their own functions
    from rl_engine.ops.det_gemm.triton import (
        _dot_acc,
        _tp_subtree_tile,
        _wgrad_step,
        _wgrad_tile,
    )

    @triton.jit
    def _chunk(
        acc, acc2, a_rows, b_cols, off2, rk, kt_lo, kt_hi, K, stride_ak, stride_bk,
        TWO: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """``acc`` (+ ``acc2`` with ``TWO``: the columns ``off2`` further on in ``b``) + the K
        steps ``kt_lo .. kt_hi - 1`` in order; ``a_rows`` [BM, 1] and ``b_cols`` [1, BN] are the
        row / column base pointers. Each accumulator's order is the one-product order."""
        for kt in range(kt_lo, kt_hi):
            kk = kt * BLOCK_K + rk
            a_ptrs = a_rows + kk[None, :] * stride_ak
            b_ptrs = b_cols + kk[:, None] * stride_bk
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                if TWO:
                    b2 = tl.load(b_ptrs + off2)
            else:
                a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
                b = tl.load(b_ptrs, mask=kk[:, None] < K, other=0.0)
                if TWO:
                    b2 = tl.load(b_ptrs + off2, mask=kk[:, None] < K, other=0.0)
            acc = _dot_acc(a, b, acc, UPCAST, IEEE)
            if TWO:
                acc2 = _dot_acc(a, b2, acc2, UPCAST, IEEE)
        return acc, acc2

    @triton.jit
    def _product(
        a_rows, b_cols, off2, rk, K, stride_ak, stride_bk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        KC_TILES: tl.constexpr, MULTI_CHUNK: tl.constexpr, TWO: tl.constexpr,
        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """fp32 [BM, BN] tile of a @ b in det_gemm's order: K chunks of ``KC_TILES`` steps,
        each into a fresh partial, partials added in chunk order (one chunk: itself); with
        ``TWO`` also the tile ``off2`` further on in b (the same A loads)."""
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_tiles = tl.cdiv(K, BLOCK_K)
        if MULTI_CHUNK:
            acc = zero
            acc2 = zero
            for c0 in range(0, k_tiles, KC_TILES):
                part, part2 = _chunk(
                    zero, zero, a_rows, b_cols, off2, rk, c0, tl.minimum(c0 + KC_TILES, k_tiles),
                    K, stride_ak, stride_bk, TWO, BLOCK_K, EVEN_K, UPCAST, IEEE,
                )  # fmt: skip
                acc = acc + part
                acc2 = acc2 + part2
        else:
            acc, acc2 = _chunk(
                zero, zero, a_rows, b_cols, off2, rk, 0, k_tiles, K, stride_ak, stride_bk,
                TWO, BLOCK_K, EVEN_K, UPCAST, IEEE,
            )  # fmt: skip
        return acc, acc2

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, h_ptr, slots_ptr, block_expert_ptr,
        N, K, S, E, a_div, GL,
        stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
        stride_hm, stride_hn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        KC_TILES: tl.constexpr, MULTI_CHUNK: tl.constexpr, A_GATHER: tl.constexpr,
        C_SCATTER: tl.constexpr, SWIGLU: tl.constexpr, STORE_H: tl.constexpr,
        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        GROUPS: tl.constexpr,
    ):  # fmt: skip
        # One program: block ``pid_m`` (BLOCK_M padded positions of one expert) x BLOCK_N
        # output columns. A rows: A_GATHER -> row slots[p] // a_div (padding: row 0), else
        # the padded position p. C rows: C_SCATTER -> slot slots[p] (padding: not stored),
        # else p. SWIGLU: columns n (gate) and N + n (up) of b, each rounded to c's dtype,
        # c = silu(gate) * up (STORE_H: the rounded gate / up also to h [p, 2N]).
        # GROUPS > 0 (the TP subtree; fp32 c): K is GROUPS groups of GL columns, each group's
        # fp32 product in det_gemm's weight-gradient order (chunks of KC_TILES * BLOCK_K
        # positions: the launcher makes that WGRAD_CHUNK), the products added by the
        # adjacent-pair tree: det_gemm's TP subtree kernel's tile (_tp_subtree_tile).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_m)
        if e > E:  # past the last block
            return
        rp = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + rp)
        valid = slot < S
        if C_SCATTER:
            c_rows = slot.to(tl.int64)
        else:
            c_rows = rp
        if e == E:  # the non-local experts' slots: +0 rows (C_SCATTER only)
            if C_SCATTER:
                zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
                c_ptrs = c_ptr + c_rows[:, None] * stride_cm + rn[None, :] * stride_cn
                tl.store(c_ptrs, zero, mask=valid[:, None] & (rn[None, :] < N))
            return
        if A_GATHER:
            a_row = tl.where(valid, slot // a_div, 0).to(tl.int64)
        else:
            a_row = rp
        rk = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + a_row[:, None] * stride_am
        b_base = b_ptr + e.to(tl.int64) * stride_be
        rbn = rn % N  # out-of-range columns wrap to valid ones (not stored)
        if GROUPS > 0:
            acc = _tp_subtree_tile(
                a_ptr, b_base, a_row, rbn, rk, GL, 0, stride_am, stride_ak, stride_bk,
                stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS, KC_TILES * BLOCK_K, False,
                UPCAST, IEEE,
            )  # fmt: skip
        else:
            acc, up = _product(
                a_rows, b_base + rbn[None, :] * stride_bn, N * stride_bn, rk, K, stride_ak,
                stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, KC_TILES, MULTI_CHUNK, SWIGLU, EVEN_K,
                UPCAST, IEEE,
            )  # fmt: skip
        if SWIGLU:
            g16 = acc.to(c_ptr.dtype.element_ty)
            u16 = up.to(c_ptr.dtype.element_ty)
            if STORE_H:
                h_ptrs = h_ptr + rp[:, None] * stride_hm + rn[None, :] * stride_hn
                hmask = rn[None, :] < N
                tl.store(h_ptrs, g16, mask=hmask)
                tl.store(h_ptrs + N * stride_hn, u16, mask=hmask)
            # silu_and_mul's Triton kernel, on the rounded gate / up
            g = g16.to(tl.float32)
            u = u16.to(tl.float32)
            silu = g / (1.0 + tl.exp(-g))
            out = silu * u
        else:
            out = acc
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + rn[None, :] * stride_cn
        cmask = rn[None, :] < N
        if C_SCATTER:
            cmask = cmask & valid[:, None]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _moe_wgrad_kernel(
        a_ptr, g_ptr, out_ptr, slots_ptr, row_start_ptr, counts_ptr,
        KO, N, a_div,
        stride_am, stride_ak, stride_gm, stride_gn, stride_oe, stride_ok, stride_on,
        CHUNK: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr, A_GATHER: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        # out[e, o, n] = sum over expert e's rows r (padded positions row_start[e] + i,
        # i < counts[e], in order; CHUNK rows a fresh fp32 partial, partials in order) of
        # a[row(r), o] * g[r, n]; row(r) = slots[r] // a_div (A_GATHER) or r. det_gemm's
        # _det_gemm_wgrad_kernel over the expert's rows.
        e = tl.program_id(1)
        pid = tl.program_id(0)
        ro, rn, rt = _wgrad_tile(pid, N, BLOCK_O, BLOCK_N, BLOCK_T)
        ro_c = ro % KO
        rn_c = rn % N
        start = tl.load(row_start_ptr + e).to(tl.int64)
        count = tl.load(counts_ptr + e)
        total = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, count, CHUNK):
            part = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
            for t0 in range(c0, tl.minimum(c0 + CHUNK, count), BLOCK_T):
                t = t0 + rt
                tmask = t < count
                r = start + t
                if A_GATHER:
                    slot = tl.load(slots_ptr + r, mask=tmask, other=0)
                    a_row = (slot // a_div).to(tl.int64)
                else:
                    a_row = r
                part = _wgrad_step(
                    part, a_ptr, g_ptr, a_row, r, tmask, ro_c, rn_c,
                    stride_am, stride_ak, stride_gm, stride_gn, UPCAST, IEEE,
                )  # fmt: skip
            total = total + part
        o_ptrs = (
            out_ptr + e.to(tl.int64) * stride_oe + ro[:, None] * stride_ok + rn[None, :] * stride_on
        )
        tl.store(
            o_ptrs, total.to(out_ptr.dtype.element_ty), mask=(ro[:, None] < KO) & (rn[None, :] < N)
        )

    @triton.jit
    def _bucket(ids_ptr, map_ptr, sl, m, E, BLOCK_E: tl.constexpr, HAS_MAP: tl.constexpr):
        """The bucket of slots ``sl`` (local expert, ``E`` non-local, ``BLOCK_E`` masked)."""
        e = tl.load(ids_ptr + sl, mask=m, other=0).to(tl.int32)
        if HAS_MAP:
            e = tl.load(map_ptr + e, mask=m, other=0).to(tl.int32)
            e = tl.where(e < 0, E, e)
        return tl.where(m, e, BLOCK_E)  # matches no bin

    @triton.jit
    def _moe_align_hist_kernel(
        ids_ptr, map_ptr, hist_ptr, S, E,
        BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, HAS_MAP: tl.constexpr,
    ):  # fmt: skip
        # Phase 1 (multi-chunk layouts): hist[c, b] = slots of chunk c in bucket b.
        c = tl.program_id(0)
        bins = tl.arange(0, BLOCK_E)
        sl = c * BLOCK_S + tl.arange(0, BLOCK_S)
        e = _bucket(ids_ptr, map_ptr, sl, sl < S, E, BLOCK_E, HAS_MAP)
        counts = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), 0)
        tl.store(hist_ptr + c * BLOCK_E + bins, counts)

    @triton.jit
    def _moe_align_kernel(
        ids_ptr, map_ptr, hist_ptr, slots_ptr, block_expert_ptr, row_start_ptr, counts_ptr,
        S, E, NB,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
        N_CHUNKS: tl.constexpr, HAS_MAP: tl.constexpr,
    ):  # fmt: skip
        # The layout of :func:`align_torch`, one program per chunk of BLOCK_S slots. slots
        # must hold S everywhere on entry. Buckets 0..E-1 local experts, E the non-local
        # slots. N_CHUNKS == 1: the program counts its own chunk (one launch); else phase 1's
        # per-chunk histograms give the totals and this chunk's offset in every bucket.
        c = tl.program_id(0)
        bins = tl.arange(0, BLOCK_E)
        sl = c * BLOCK_S + tl.arange(0, BLOCK_S)
        e = _bucket(ids_ptr, map_ptr, sl, sl < S, E, BLOCK_E, HAS_MAP)
        onehot = (e[:, None] == bins[None, :]).to(tl.int32)
        if N_CHUNKS == 1:
            counts = tl.sum(onehot, 0)
            before_chunk = tl.zeros((BLOCK_E,), dtype=tl.int32)
        else:
            rc = tl.arange(0, N_CHUNKS)
            hist = tl.load(hist_ptr + rc[:, None] * BLOCK_E + bins[None, :])
            counts = tl.sum(hist, 0)
            before_chunk = tl.sum(tl.where(rc[:, None] < c, hist, 0), 0)
        nblk = (counts + (BLOCK_M - 1)) // BLOCK_M
        blk_end = tl.cumsum(nblk, 0)
        row_start = (blk_end - nblk) * BLOCK_M
        before = tl.cumsum(onehot, 0) - onehot  # same-bucket slots earlier in the chunk
        pos = tl.sum(onehot * (before + (row_start + before_chunk)[None, :]), 1)
        tl.store(slots_ptr + pos, sl, mask=sl < S)
        if c == 0:
            tl.store(row_start_ptr + bins, row_start, mask=bins <= E)
            tl.store(counts_ptr + bins, counts, mask=bins <= E)
            # block b belongs to the first bucket whose block range ends after b (E + 1: none)
            rs = tl.arange(0, BLOCK_S)
            for b0 in range(0, NB, BLOCK_S):
                b = b0 + rs
                owner = tl.sum((blk_end[None, :] <= b[:, None]) & (bins[None, :] <= E), 1)
                tl.store(block_expert_ptr + b, owner.to(tl.int32), mask=b < NB)


def _kernel(name: str, device: torch.device) -> Any:
    return _triton.launcher(globals()[name], device)


_guard = _triton.device_guard


def _check_device(*tensors: torch.Tensor) -> None:
    _triton.check_device("moe_experts", *tensors)


def max_blocks(n_slots: int, n_experts: int, block_m: int) -> int:
    """Static bound on the number of BLOCK_M blocks of the aligned layout (non-local bucket
    included): ``sum_e cdiv(c_e, BM) <= cdiv(S, BM) + (number of non-empty buckets)``."""
    return _triton.cdiv(n_slots, block_m) + min(n_experts + 1, n_slots)


# Up to this many slots the alignment is Triton (one program per chunk of slots: one launch
# for a single chunk, two beyond); past it torch ops (prefill: their cost is small next to the
# GEMMs, and the per-chunk histograms each program reads grow with the slots). The same layout
# either way (a launch choice; tested).
_ALIGN_KERNEL_MAX_SLOTS = 16384


def _align_tiles(n_slots: int, n_experts: int) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_S, chunks)`` of the Triton alignment: BLOCK_E > E + 1 buckets, chunks
    of ~8k one-hot elements, at most 128 chunks."""
    block_e = max(16, 1 << (n_experts + 1).bit_length())
    block_s = max(16, min(256, 8192 // block_e))
    while _triton.cdiv(n_slots, block_s) > 128:
        block_s *= 2
    chunks = _triton.cdiv(n_slots, block_s)
    return block_e, block_s, 1 << max(0, chunks - 1).bit_length()


def align(
    ids: torch.Tensor, n_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The aligned layout of the slots (see :func:`align_torch`): Triton for up to
    ``_ALIGN_KERNEL_MAX_SLOTS`` slots, else torch ops."""
    if ids.numel() > _ALIGN_KERNEL_MAX_SLOTS or ids.numel() == 0:
        return align_torch(ids, n_experts, block_m, expert_map)
    return align_triton(ids, n_experts, block_m, expert_map)


def align_triton(
    ids: torch.Tensor, n_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_torch`'s layout from Triton: one program per chunk of slots (phase 1, the
    per-chunk bucket histograms, only with more than one chunk)."""
    s = ids.numel()
    dev = ids.device
    nb = max_blocks(s, n_experts, block_m)
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    slots = torch.full((nb * block_m,), s, dtype=torch.int32, device=dev)
    block_expert = torch.empty((nb,), dtype=torch.int32, device=dev)
    row_start = torch.empty((n_experts + 1,), dtype=torch.int32, device=dev)
    counts = torch.empty((n_experts + 1,), dtype=torch.int32, device=dev)
    emap = expert_map if expert_map is not None else flat
    block_e, block_s, n_chunks = _align_tiles(s, n_experts)
    grid = (_triton.cdiv(s, block_s),)
    # phase 1's histograms, N_CHUNKS rows (a power of two: the rows past the last chunk are
    # written as zeros by their own programs, no memset launch)
    hist = (
        torch.empty((n_chunks, block_e), dtype=torch.int32, device=dev) if grid[0] > 1 else counts
    )
    with _guard(ids):
        if grid[0] > 1:
            _kernel("_moe_align_hist_kernel", dev)[(n_chunks,)](
                flat, emap, hist, s, n_experts,
                BLOCK_S=block_s, BLOCK_E=block_e, HAS_MAP=expert_map is not None, num_warps=4,
            )  # fmt: skip
        _kernel("_moe_align_kernel", dev)[grid](
            flat, emap, hist, slots, block_expert, row_start, counts, s, n_experts, nb,
            BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_E=block_e,
            N_CHUNKS=n_chunks if grid[0] > 1 else 1, HAS_MAP=expert_map is not None,
            num_warps=8,
        )  # fmt: skip
    return slots, block_expert, row_start, counts


def align_torch(
    ids: torch.Tensor, n_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The aligned layout of the slots (device ops of static shape; no host sync).

    Args:
        ids: [T, k] global expert ids.
        n_experts: local experts E.
        block_m: the alignment unit.
        expert_map: optional [E_global] global -> local id (-1: not local).

    Returns:
        ``slots`` int32 [max_blocks * block_m]: the slot ``t * k + s`` at each padded position
        (``S = T * k``: padding), slots sorted by local expert, slot order within one;
        ``block_expert`` int32 [max_blocks]: the local expert of each block (``E``: the block
        holds non-local slots, ``E + 1``: past the end); ``row_start`` int32 [E + 1]: each
        expert's first padded position; ``counts`` int32 [E + 1]: its number of slots.
    """
    s = ids.numel()
    dev = ids.device
    e = ids.reshape(-1).to(torch.int64)
    if expert_map is not None:
        e = expert_map.to(torch.int64)[e]
        e = torch.where(e < 0, n_experts, e)
    nb = max_blocks(s, n_experts, block_m)
    sorted_e, order = torch.sort(e, stable=True)
    bucket = torch.arange(n_experts + 2, device=dev, dtype=torch.int64)
    bounds = torch.searchsorted(sorted_e, bucket)  # [E + 2]: first sorted index of each bucket
    counts = bounds[1:] - bounds[:-1]  # [E + 1]
    nblk = (counts + (block_m - 1)) // block_m
    blk_end = torch.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    row_start = blk_start * block_m
    rank = torch.arange(s, device=dev, dtype=torch.int64) - bounds[:-1][sorted_e]
    pos = row_start[sorted_e] + rank
    slots = torch.full((nb * block_m,), s, dtype=torch.int32, device=dev)
    slots.scatter_(0, pos, order.to(torch.int32))
    blocks = torch.arange(nb, device=dev, dtype=torch.int64)
    block_expert = torch.searchsorted(blk_end, blocks, right=True).to(torch.int32)
    return slots, block_expert, row_start.to(torch.int32), counts.to(torch.int32)


def _gemm(
    a, b, c, h, slots, block_expert, *, n, k, s, n_experts, a_div, b_strides, cfg,
    a_gather, c_scatter, swiglu, store_h, groups=0,
) -> None:  # fmt: skip
    """Launch the grouped GEMM; ``b_strides`` = (expert, k, n) strides of the weight;
    ``groups`` > 0: the TP subtree of that many K groups (fp32 ``c``)."""
    on_cpu = a.device.type == "cpu"
    if on_cpu:
        cfg = cfg.for_interpreter()
    chunk = WGRAD_CHUNK if groups else K_CHUNK  # the group products' chunk: det_gemm_wgrad's
    if chunk % cfg.block_k:
        raise ValueError(f"moe_experts[triton]: block_k={cfg.block_k} must divide {chunk}")
    nb = block_expert.shape[0]
    hh = h if h is not None else c
    grid = (nb, _triton.cdiv(n, cfg.block_n))
    with _guard(a):
        _kernel("_moe_gemm_kernel", a.device)[grid](
            a, b, c, hh, slots, block_expert,
            n, k, s, n_experts, a_div, k // max(groups, 1),
            a.stride(0), a.stride(1), *b_strides, c.stride(0), c.stride(1),
            hh.stride(0), hh.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            KC_TILES=chunk // cfg.block_k, MULTI_CHUNK=k > K_CHUNK, A_GATHER=a_gather,
            C_SCATTER=c_scatter, SWIGLU=swiglu, STORE_H=store_h,
            EVEN_K=k % cfg.block_k == 0, UPCAST=on_cpu and a.dtype != torch.float32,
            IEEE=a.dtype == torch.float32 or on_cpu, GROUPS=groups,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


def _forward(x, ids, w13, w2, expert_map, cfg, *, keep: bool, groups: int = 0):
    t, hdim = x.shape
    top_k = ids.shape[1]
    n_exp, i2, _ = w13.shape
    inter = i2 // 2
    s = t * top_k
    slots, block_expert, row_start, counts = align(ids, n_exp, cfg.block_m, expert_map)
    p = slots.shape[0]
    # keep (backward: kernel 1 only, y is not computed): zero-filled, so that the rows no block writes (non-local slots, blocks
    # past the end) hold zeros, not garbage, through silu_and_mul_backward
    alloc = torch.zeros if keep else torch.empty
    act = alloc((p, inter), dtype=x.dtype, device=x.device)
    h = alloc((p, i2), dtype=x.dtype, device=x.device) if keep else None
    # groups > 0: the down projection is the TP subtree, fp32 rows (not rounded)
    y = torch.empty((s, hdim), dtype=torch.float32 if groups else x.dtype, device=x.device)
    common = dict(s=s, n_experts=n_exp, cfg=cfg)
    down = dict(s=s, n_experts=n_exp, cfg=cfg.for_subtree(groups) if groups else cfg.for_down())
    _gemm(
        x, w13, act, h, slots, block_expert, n=inter, k=hdim, a_div=top_k,
        b_strides=(w13.stride(0), w13.stride(2), w13.stride(1)),
        a_gather=True, c_scatter=False, swiglu=True, store_h=keep, **common,
    )  # fmt: skip
    if not keep:  # the backward needs act and h only
        _gemm(
            act, w2, y, None, slots, block_expert, n=hdim, k=inter, a_div=1,
            b_strides=(w2.stride(0), w2.stride(2), w2.stride(1)),
            a_gather=False, c_scatter=True, swiglu=False, store_h=False, groups=groups, **down,
        )  # fmt: skip
    layout = (slots, block_expert, row_start, counts)
    return y.view(t, top_k, hdim), act, h, layout


def moe_experts_with_config(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None,
    cfg: MoeGemmConfig | None,
    *,
    groups: int = 0,
) -> torch.Tensor:
    """:func:`moe_experts` with an explicit launch config (tests; same bits); ``groups`` > 0:
    :func:`moe_experts_subtree`'s fp32 rows."""
    _check(x, ids, w13, w2, expert_map, values=False)
    _check_device(x)
    t, hdim = x.shape
    top_k = ids.shape[1]
    if t == 0 or top_k == 0 or hdim == 0:
        return x.new_zeros((t, top_k, hdim), dtype=torch.float32 if groups else x.dtype)
    cfg = cfg or get_config(t * top_k, w13.shape[0], x.dtype)
    return _forward(x, ids, w13, w2, expert_map, cfg, keep=False, groups=groups)[0]


@signature_of(reference.moe_experts)
def moe_experts(*args: Any) -> torch.Tensor:
    """Routed experts, each slot's row bitwise ``det_gemm`` / ``silu_and_mul`` (Triton) alone.

    Args (the reference's, ``(x, ids, w13, w2, expert_map=None)``):
        x: [T, H] float32 / bfloat16 / float16.
        ids: [T, k] global expert ids (int64).
        w13: [E, 2I, H] gate rows then up rows; w2: [E, H, I]; same dtype as ``x``.
        expert_map: optional [E_global] int64, global -> local id, -1 if not local.

    Returns:
        y [T, k, H] in ``x.dtype`` (+0 rows for non-local experts).
    """
    return moe_experts_with_config(*args, None)


# Groups of the subtree's pair tree (det_gemm's TP subtree tile: one register tile per level).
_SUBTREE_MAX_GROUPS = 32


@signature_of(reference.moe_experts_subtree)
def moe_experts_subtree(*args: Any) -> torch.Tensor:
    """The experts' down projection as this rank's fp32 subtree of the TP-invariant reduction
    (expert tensor parallelism: each rank holds ``I / t`` of every expert's FFN).

    For every slot ``(t, s)`` with local expert ``e``: ``a`` = the forward's activation row
    (kernel 1: det_gemm gate / up, ``silu_and_mul``, ``x.dtype``) and ``out[t, s] =
    det_gemm.tp.subtree(a, w2[e].T, groups, backend="triton")``: the ``I`` columns cut into
    ``groups`` equal groups, each group's fp32 product in the order of det_gemm's Triton
    weight-gradient kernel, the products added by the adjacent-pair tree; fp32, not rounded.
    Non-local slots: +0 rows. Batch invariant (rows never mix; the tile config, picked by the
    rows per expert as the forward's, never changes the order). The forward's launches, kernel
    2 with ``GROUPS``: no host sync, CUDA-graph capturable.

    Args (the reference's, ``(x, ids, w13, w2, groups, expert_map=None)``):
        x: [T, H] float32 / bfloat16 / float16.
        ids: [T, k] global expert ids.
        w13: [E, 2I, H] this rank's gate rows then up rows; w2: [E, H, I] (any strides).
        groups: this rank's group count (``TP_GROUPS / t``), a power of two dividing ``I``,
            at most 32.
        expert_map: optional [E_global] global -> local id, -1 if not local.

    Returns:
        fp32 [T, k, H].
    """
    x, ids, w13, w2, groups, expert_map = args
    _check(x, ids, w13, w2, expert_map, groups=groups, values=False)
    if groups > _SUBTREE_MAX_GROUPS:
        raise ValueError(
            f"moe_experts subtree: {groups} groups; the Triton kernel takes at most "
            f"{_SUBTREE_MAX_GROUPS}"
        )
    return moe_experts_with_config(x, ids, w13, w2, expert_map, None, groups=groups)


def _wgrad(a, g, out, slots, row_start, counts, *, ko, n, a_div, a_gather, out_strides):
    """out[e] (strides ``out_strides`` = (e, o, n)) = a_e.T @ g_e over each expert's rows."""
    on_cpu = a.device.type == "cpu"
    bo, bn, bt, warps, stages = _WGRAD_FP32 if a.dtype == torch.float32 else _WGRAD_16BIT
    if on_cpu:
        bt = INTERPRETER_BLOCK_K
    n_exp = out.shape[0]
    grid = (_triton.cdiv(ko, bo) * _triton.cdiv(n, bn), n_exp)
    with _guard(a):
        _kernel("_moe_wgrad_kernel", a.device)[grid](
            a, g, out, slots, row_start, counts,
            ko, n, a_div,
            a.stride(0), a.stride(1), g.stride(0), g.stride(1), *out_strides,
            CHUNK=WGRAD_CHUNK, BLOCK_O=bo, BLOCK_N=bn, BLOCK_T=bt, A_GATHER=a_gather,
            UPCAST=on_cpu and a.dtype != torch.float32, IEEE=a.dtype == torch.float32 or on_cpu,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip


@signature_of(reference.moe_experts_backward)
def moe_experts_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dw13, dw2)`` given ``grad`` [T, k, H] (see the module doc); the
    reference's arguments ``(grad, x, ids, w13, w2, expert_map=None)``. Recomputes the forward's
    gate / up and activation with kernel 1."""
    from rl_engine.ops.silu_and_mul.triton import silu_and_mul_backward

    grad, x, ids, w13, w2, expert_map = args
    _check(x, ids, w13, w2, expert_map, values=False)
    _check_device(x)
    t, hdim = x.shape
    top_k = ids.shape[1]
    n_exp, i2, _ = w13.shape
    inter = i2 // 2
    s = t * top_k
    if s == 0 or hdim == 0:
        return torch.zeros_like(x), torch.zeros_like(w13), torch.zeros_like(w2)
    cfg = get_config(s, n_exp, x.dtype)
    _, act, h, (slots, block_expert, row_start, counts) = _forward(
        x, ids, w13, w2, expert_map, cfg, keep=True
    )
    g = grad.reshape(s, hdim).to(x.dtype)
    if g.stride(-1) != 1:
        g = g.contiguous()
    p = slots.shape[0]
    common = dict(s=s, n_experts=n_exp, cfg=cfg)
    # dw2[e] [H, I] = det_gemm_wgrad(act_e, dy_e).t() (dy gathered into the padded layout)
    dw2 = torch.empty_like(w2)
    dy_p = _gather_rows(g, slots, s)
    _wgrad(
        act, dy_p, dw2, slots, row_start, counts, ko=inter, n=hdim, a_div=1,
        a_gather=False, out_strides=(dw2.stride(0), dw2.stride(2), dw2.stride(1)),
    )  # fmt: skip
    # dact = dy[slot] @ w2[e] (det_gemm's da = det_gemm(grad, b.t()), b = w2[e].T)
    dact = torch.zeros((p, inter), dtype=x.dtype, device=x.device)
    _gemm(
        g, w2, dact, None, slots, block_expert, n=inter, k=hdim, a_div=1,
        b_strides=(w2.stride(0), w2.stride(1), w2.stride(2)),
        a_gather=True, c_scatter=False, swiglu=False, store_h=False, **common,
    )  # fmt: skip
    dh = silu_and_mul_backward(dact, h)  # [P, 2I]
    # dw13[e] [2I, H] = det_gemm_wgrad(x_e, dh_e).t()
    dw13 = torch.empty_like(w13)
    _wgrad(
        x, dh, dw13, slots, row_start, counts, ko=hdim, n=i2, a_div=top_k,
        a_gather=True, out_strides=(dw13.stride(0), dw13.stride(2), dw13.stride(1)),
    )  # fmt: skip
    # dx_slot = dh @ w13[e] scattered to the slots (+0 rows off-rank); dx = slot-order fp32 sum
    dxs = torch.empty((s, hdim), dtype=x.dtype, device=x.device)
    _gemm(
        dh, w13, dxs, None, slots, block_expert, n=hdim, k=i2, a_div=1,
        b_strides=(w13.stride(0), w13.stride(1), w13.stride(2)),
        a_gather=False, c_scatter=True, swiglu=False, store_h=False,
        s=s, n_experts=n_exp, cfg=cfg.for_down(),
    )  # fmt: skip
    dx = sum_slots(dxs.view(t, top_k, hdim))
    return dx, dw13, dw2


def _gather_rows(g: torch.Tensor, slots: torch.Tensor, s: int) -> torch.Tensor:
    """``g`` [S, H] rows in the padded layout ([P, H]; padding rows 0)."""
    valid = slots < s
    idx = torch.where(valid, slots, 0).to(torch.int64)
    out = g.index_select(0, idx)
    return out.masked_fill_(~valid[:, None], 0)


PROVIDER = _triton.triton_provider(
    numerics=f"moe_experts/triton-kc{K_CHUNK}",
    fn=moe_experts,
    version="1",
    extras={"backward": moe_experts_backward, "subtree": moe_experts_subtree},
)
