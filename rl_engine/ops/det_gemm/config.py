"""Tile configurations of the Triton ``det_gemm`` provider: a checked-in table, no autotuning.

What may vary here and what may not:

* ``K_CHUNK`` **is** numerics: K is cut into chunks of ``K_CHUNK`` columns from column 0 (the last
  one may be shorter); each chunk is accumulated sequentially (``BLOCK_K`` steps, ``tl.dot``
  chained) into a fresh fp32 partial, and the partials are added in chunk order
  (``((0 + p0) + p1) + ...``; a single chunk is used as is). It is a fixed number, never derived
  from M, N or the device.
* Everything in :class:`DetGemmConfig` is launch shape only and never changes the bits: the tile
  shape (``block_m``, ``block_n``, ``block_k``; ``block_k`` divides ``K_CHUNK``), the launch
  order (``group_m``), warps and pipeline stages, the kernel (pointer loads or persistent TMA)
  and the plan: ``split_k`` runs one program per (output tile, K chunk) writing fp32 partials
  that a second kernel adds in chunk order, which is how few rows get enough programs to stream
  the weight; otherwise one program walks all chunks of its tile and adds them in registers.
  So the table may pick a config by M (and N, K); ``tests/ops/test_det_gemm_triton.py`` proves
  that every config shipped here gives bitwise-equal outputs on the same inputs.
* ``WGRAD_CHUNK`` is the same rule for the weight gradient (tokens reduced in chunks of this many
  rows): the weight gradient is this GEMM with K = tokens.

The table was tuned on an H200 with ``benchmarks/sweep_det_gemm.py`` (see
``docs/operators/det_gemm.md``); it is a performance choice only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "K_CHUNK",
    "LM_HEAD",
    "WGRAD_CHUNK",
    "DetGemmConfig",
    "WgradConfig",
    "all_configs",
    "CUDA_CLUSTER_M",
    "CUDA_CONFIGS",
    "CUDA_SPLIT_K",
    "CUDA_SPLIT_K_MAX_WORKSPACE",
    "CUDA_STAGE_K",
    "CUDA_TILES",
    "CUDA_TILE_EFFICIENCY",
    "cuda_config_fits",
    "cuda_split_k_slices",
    "cuda_wave_cost",
    "get_cuda_config",
    "get_cuda_split_k",
    "all_tp_subtree_configs",
    "get_config",
    "get_tp_subtree_config",
    "get_wgrad_config",
]

# Forward K chunk (part of the numerics of the ``triton`` family; see module doc).
K_CHUNK = 4096
# Weight-gradient token chunk (part of the numerics of the ``triton`` family; see module doc).
# The forward's chunk: the weight gradient is this GEMM with K = tokens. (256 until version 3:
# a 4-step inner loop per chunk drained the wgmma pipeline every 256 tokens, ~half speed.)
WGRAD_CHUNK = K_CHUNK

# In the Triton interpreter ``tl.dot`` is one numpy matmul of the whole tile (partial sum of
# BLOCK_K products, then added to the accumulator), so there BLOCK_K *would* change the order.
# The launcher therefore runs every config with this K step in the interpreter: the unit a GPU
# tensor core also reduces in (k16), which keeps configs bitwise equal there too.
INTERPRETER_BLOCK_K = 16


@dataclass(frozen=True)
class DetGemmConfig:
    """Launch configuration of the forward kernel (performance only; see module doc)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Persistent kernel with TMA tile loads (CUDA, 16-bit, aligned layouts; otherwise the
    # pointer kernel runs). Same per-tile reduction order, so the same bits.
    tma: bool = False
    # One program (pointer kernel) or work item (persistent TMA kernel, with ``tma``) per
    # (tile, K chunk), fp32 partials, + the ordered combination kernel.
    split_k: bool = False
    # Pointer kernel, several chunks per program: one K loop that adds and resets the partial
    # after a chunk's last step (streams better at small tiles) instead of a loop per chunk.
    flat_k: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 16")
        if K_CHUNK % self.block_k:
            raise ValueError(f"block_k={self.block_k} must divide K_CHUNK={K_CHUNK}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps}: expected 1, 2, 4, 8 or 16")

    def for_interpreter(self) -> DetGemmConfig:
        return dataclasses.replace(self, block_k=INTERPRETER_BLOCK_K, tma=False)


@dataclass(frozen=True)
class WgradConfig:
    """Launch configuration of the weight-gradient kernels: out tile [block_o, block_n], token
    step ``block_t`` (must divide ``WGRAD_CHUNK``); ``tma``: the persistent TMA GEMM kernel where
    the layouts allow it (16-bit, CUDA)."""

    block_o: int
    block_n: int
    block_t: int
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False

    def __post_init__(self) -> None:
        if WGRAD_CHUNK % self.block_t:
            raise ValueError(f"block_t={self.block_t} must divide WGRAD_CHUNK={WGRAD_CHUNK}")

    def for_interpreter(self) -> WgradConfig:
        return dataclasses.replace(self, block_t=INTERPRETER_BLOCK_K, tma=False)


_C = DetGemmConfig

# 16-bit inputs (bf16 / fp16): (m_max, k_min, n_min, w_max, config); the first row with M <= m_max,
# K >= k_min, N >= n_min and K * N <= w_max wins. Tuned on H100 / H200 from CUDA-graph timings over
# cold operands (benchmarks/bench_det_gemm.py --sweep; ``--sweep-shapes rollout`` for the small
# weights). Small weights (K * N <= 12 Mi elements: the projections of a ~1B model) have few
# output tiles, so up to 256 rows they take narrow tiles (16 or 32 columns: a program per 32
# columns streams the weight) and from 65 rows the persistent TMA kernel; the K chunks of a deep
# K stay in one program there (``flat_k``). Larger weights: decode sizes use narrow pointer-load
# tiles (deep K: split over the K chunks) so that enough programs stream the weight; wide
# products (N >= 8192) take the persistent TMA kernel from 65 rows on; deep K with 129-256 rows
# the persistent TMA kernel over (chunk, tile) items; from 257 rows on the TMA kernel
# everywhere. Where two configs tie on GPU time the pointer kernel wins: its Python launch path
# is shorter. ``LM_HEAD`` is the config of wide products with a few hundred rows (the fused LM
# head's token chunks; tuned for it, performance only).
_DEEP = K_CHUNK + 1  # more than one K chunk
_WIDE = 8192
_SMALL_W = 12 << 20  # K * N of a "small" weight
_ANY_W = 1 << 62
_TABLE_16BIT: tuple[tuple[int, int, int, int, DetGemmConfig], ...] = (
    (16, 0, 0, _SMALL_W, _C(16, 32, 256, group_m=1, num_warps=4, num_stages=4, split_k=True)),
    (64, 0, 0, _SMALL_W, _C(64, 32, 128, group_m=8, num_warps=4, num_stages=4, flat_k=True)),
    (128, 0, 0, _SMALL_W, _C(64, 64, 128, group_m=8, num_warps=4, num_stages=4, tma=True)),
    (256, 0, 0, _SMALL_W, _C(64, 64, 128, group_m=8, num_warps=4, num_stages=4, tma=True)),
    (16, _DEEP, 0, _ANY_W, _C(16, 128, 128, group_m=1, num_warps=4, num_stages=4, split_k=True)),
    (16, 0, 0, _ANY_W, _C(16, 64, 128, group_m=1, num_warps=4, num_stages=6, flat_k=True)),
    (64, _DEEP, 0, _ANY_W, _C(64, 64, 64, group_m=1, num_warps=4, num_stages=5, split_k=True)),
    (64, 0, 0, _ANY_W, _C(64, 64, 64, group_m=1, num_warps=4, num_stages=5, split_k=True)),
    (128, _DEEP, 0, _ANY_W, _C(64, 128, 64, group_m=8, num_warps=4, num_stages=4, split_k=True)),
    (128, 0, _WIDE, _ANY_W, _C(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True)),
    (128, 0, 0, _ANY_W, _C(64, 64, 128, group_m=8, num_warps=4, num_stages=4, split_k=True)),
    (
        256,
        _DEEP,
        0,
        _ANY_W,
        _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, split_k=True),
    ),
    (256, 0, _WIDE, _ANY_W, _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)),
    (256, 0, 0, _ANY_W, _C(64, 128, 64, group_m=8, num_warps=4, num_stages=4, split_k=True)),
    (512, 0, _WIDE, _ANY_W, _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)),
    (512, 0, 0, _ANY_W, _C(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True)),
    (1 << 62, _DEEP, 0, _ANY_W, _C(128, 256, 64, group_m=8, num_warps=8, num_stages=4, tma=True)),
    (1 << 62, 0, 0, _ANY_W, _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)),
)

LM_HEAD = _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)

# fp32 inputs: IEEE FMA dots (no TF32), smaller tiles.
_TABLE_FP32: tuple[tuple[int, int, int, int, DetGemmConfig], ...] = (
    (16, _DEEP, 0, _ANY_W, _C(16, 64, 32, group_m=1, num_warps=4, num_stages=3, split_k=True)),
    (16, 0, 0, _ANY_W, _C(16, 64, 32, group_m=1, num_warps=4, num_stages=3)),
    (64, 0, 0, _ANY_W, _C(32, 64, 32, group_m=8, num_warps=4, num_stages=3)),
    (1 << 62, 0, 0, _ANY_W, _C(64, 64, 32, group_m=8, num_warps=4, num_stages=3)),
)

_WGRAD_16BIT = WgradConfig(
    block_o=128, block_n=128, block_t=64, num_warps=8, num_stages=4, tma=True
)
_WGRAD_FP32 = WgradConfig(block_o=64, block_n=64, block_t=32, num_warps=4, num_stages=3)


def _table(dtype: torch.dtype) -> tuple[tuple[int, int, int, int, DetGemmConfig], ...]:
    return _TABLE_FP32 if dtype == torch.float32 else _TABLE_16BIT


def get_config(m: int, n: int, k: int, dtype: torch.dtype) -> DetGemmConfig:
    """The forward config for an [m, k] x [k, n] product (shape-dependent, numerics-free)."""
    for m_max, k_min, n_min, w_max, cfg in _table(dtype):
        if m <= m_max and k >= k_min and n >= n_min and k * n <= w_max:
            return cfg
    return _table(dtype)[-1][-1]


# The one-launch TP subtree kernel (``det_gemm_tp_subtree``): (m_max, groups_max, config), the
# first row with M <= m_max and the rank's group count <= groups_max wins. Its adjacent-pair
# tree keeps one fp32 tile per tree level live in registers (log2(groups) + 1 tiles), so wide
# tiles are for few groups. Launch shape only (the test proves the configs bitwise equal);
# PROVISIONAL: picked by the register budget, not yet tuned on a GPU
# (benchmarks/bench_tp_exchange.py's layer rows are where to tune it).
_TP_TABLE_16BIT: tuple[tuple[int, int, DetGemmConfig], ...] = (
    (16, 1 << 30, _C(16, 32, 128, group_m=1, num_warps=4, num_stages=4)),
    (64, 1 << 30, _C(64, 64, 64, group_m=1, num_warps=4, num_stages=4)),
    (1 << 62, 2, _C(128, 128, 64, group_m=8, num_warps=8, num_stages=3)),
    (1 << 62, 1 << 30, _C(64, 128, 64, group_m=8, num_warps=8, num_stages=3)),
)
_TP_TABLE_FP32: tuple[tuple[int, int, DetGemmConfig], ...] = (
    (16, 1 << 30, _C(16, 64, 32, group_m=1, num_warps=4, num_stages=3)),
    (64, 1 << 30, _C(32, 64, 32, group_m=8, num_warps=4, num_stages=3)),
    (1 << 62, 1 << 30, _C(64, 64, 32, group_m=8, num_warps=4, num_stages=3)),
)


def get_tp_subtree_config(m: int, n: int, groups: int, dtype: torch.dtype) -> DetGemmConfig:
    """The launch config of the one-launch TP subtree kernel (numerics-free)."""
    table = _TP_TABLE_FP32 if dtype == torch.float32 else _TP_TABLE_16BIT
    for m_max, g_max, cfg in table:
        if m <= m_max and groups <= g_max:
            return cfg
    return table[-1][-1]


def all_tp_subtree_configs(dtype: torch.dtype) -> list[DetGemmConfig]:
    """Every distinct config ``get_tp_subtree_config`` can return for ``dtype`` (tests)."""
    table = _TP_TABLE_FP32 if dtype == torch.float32 else _TP_TABLE_16BIT
    return list(dict.fromkeys(cfg for *_, cfg in table))


def get_wgrad_config(dtype: torch.dtype) -> WgradConfig:
    return _WGRAD_FP32 if dtype == torch.float32 else _WGRAD_16BIT


def all_configs(dtype: torch.dtype) -> list[DetGemmConfig]:
    """Every distinct forward config the table can return for ``dtype`` (for the tests)."""
    seen: list[DetGemmConfig] = []
    for *_, cfg in _table(dtype):
        if cfg not in seen:
            seen.append(cfg)
    return seen


# --- the ``cuda`` provider (family ``det_gemm/cuda-sm90``) ---------------------------------------
# Its numerics are fixed in csrc/det_gemm/det_gemm_sm90.cuh (K in blocks of 64 walked in order into
# one fp32 accumulator, no K chunks); its tile configurations are launch shape only (the GPU
# tests prove them bitwise equal). Indices are the library's ``RLE_CFG_*``: name -> index.
CUDA_CONFIGS = {
    "large": 0,
    "mid": 1,
    "small": 2,
    "square": 3,
    "narrow": 4,
    "mid_k128": 5,
    "small_k128": 6,
    "large192": 7,
    "mid192": 8,
    "large_c2": 9,
}
# Output tile (rows, columns) of each: 128x256 cooperative, 64x128 / 64x64 / 64x32 ping-pong,
# 128x128 cooperative (two consumer warp groups on one tile). `narrow` (twice `small`'s CTAs over
# a narrow N at decode sizes) is built and tested but never chosen by get_cuda_config: timed
# slower than `small` and `mid` at every decode row (H200, 2026-11-28; docs/operators/det_gemm.md).
# `large192` (128x192 cooperative) and `mid192` (64x192 ping-pong) fill the SMs where 128- and
# 256-column grids leave a wave part idle (N 6,144: 32 tiles of 192 columns); `large_c2` is
# `large` in clusters of two CTAs along M that share the weight tile by TMA multicast. Bitwise
# equal to the others (ABI 5, GPU tests), timed on the H200 (2026-11-29) and in get_cuda_config's
# wave model since.
CUDA_TILES = {
    "large": (128, 256),
    "mid": (64, 128),
    "small": (64, 64),
    "square": (128, 128),
    "narrow": (64, 32),
    "mid_k128": (64, 128),
    "small_k128": (64, 64),
    "large192": (128, 192),
    "mid192": (64, 192),
    "large_c2": (128, 256),
}
# K columns a pipeline stage holds: 64 (one k-block), or 128 for the `*_k128` stagings of `mid` /
# `small` (two k-blocks a stage, their k16 steps in the same order: the same bits). A 128 staging
# runs only where K (after the provider's padding to a multiple of 8) is a multiple of 128, so
# that both stagings walk the same 64-blocks (cuda_config_fits). Built, tested bitwise equal and
# never chosen: timed no faster at any decode row (H200, 2026-11-28, down_proj M 1 under graph
# replay: `mid` 58.4 us, `mid_k128` 60.7 us; benchmarks/results/h200/session22_gpu): the rows
# the provider loses are bound by the K walk's chain of dependent wgmma steps, not by staging.
CUDA_STAGE_K = {c: 128 if c.endswith("_k128") else 64 for c in CUDA_CONFIGS}
# Decode and short prefill (M <= _CUDA_SHORT_M rows): `mid` up to _CUDA_DECODE_M rows; above, `small`
# where its tiles fit one wave, else the wave model over _CUDA_SHORT_CANDIDATES. Above
# _CUDA_SHORT_M: the wave model over _CUDA_LONG_CANDIDATES.
_CUDA_DECODE_M = 16
_CUDA_SHORT_M = 256
_CUDA_SHORT_CANDIDATES = ("mid", "mid192", "large")
_CUDA_LONG_CANDIDATES = ("large", "large192", "square")
# Output elements a tile computes per unit time relative to a `large` one (a smaller tile reloads
# more operand bytes per FLOP): the wave model's efficiencies, fitted from the per-config times of
# `bench_det_gemm_cuda.py --configs` by `benchmarks/fit_cuda_configs.py` (H200, 2026-11-29,
# benchmarks/results/h200/session23_gpu: the choice is flat over mid 0.70-0.85, mid192 0.9,
# large192 0.85-0.95, square 0.80-0.85; `square` 0.85 was the prior of the run before).
CUDA_TILE_EFFICIENCY = {
    "large": 1.0,
    "large_c2": 1.0,
    "large192": 0.95,
    "square": 0.85,
    "mid192": 0.9,
    "mid": 0.8,
}
# From this many rows the model's `large` runs as `large_c2` (the same tiles in clusters of two
# along M sharing the weight tile): +1-4% at M 4096 / 8192 on most products of the run above,
# -6% at M 1024 (down_proj), so not below 4096.
CUDA_CLUSTER_M = 4096
# H100 / H200 SXM; the provider passes the device's own count.
DEFAULT_SM_COUNT = 132
CUDA_WGRAD_CONFIG = "large"


def cuda_config_fits(cfg: str, k: int) -> bool:
    """Whether the tile configuration ``cfg`` runs a product whose K (per split-K slice) is
    ``k``: the 64-column ones run any K (the k-block's tail zero-filled), the 128-column
    stagings need ``k % 128 == 0`` (:data:`CUDA_STAGE_K`)."""
    stage = CUDA_STAGE_K[cfg]
    return stage == 64 or k % stage == 0


def cuda_wave_cost(
    cfg: str,
    m: int,
    n: int,
    sms: int,
    efficiency: Mapping[str, float] | None = None,
    splits: int = 1,
) -> float:
    """The wave model's time of ``cfg`` on an [m, n] output, in units of one ``large`` tile's
    time: the persistent grid runs ``ceil(tiles / sms)`` waves of one tile per SM, each tile
    costing its area over its efficiency (:data:`CUDA_TILE_EFFICIENCY`, entries of
    ``efficiency`` replacing its own). A grid that leaves SMs idle in its last wave pays for the
    whole wave: 64 ``large`` tiles (M 512 over N 4096) on 132 SMs take as long as 132.
    ``splits``: a split-K launch runs the tiles of every K slice (``splits`` times as many, each
    over K / splits: the same unit cost is a prior, not measured)."""
    effs = {**CUDA_TILE_EFFICIENCY, **(efficiency or {})}
    if cfg not in effs:
        raise ValueError(f"det_gemm[cuda]: the wave model has no efficiency for {cfg!r}")
    bm, bn = CUDA_TILES[cfg]
    tiles = -(-m // bm) * -(-n // bn) * splits
    waves = -(-tiles // sms)
    return waves * (bm * bn) / (128 * 256) / effs[cfg]


def get_cuda_config(
    m: int,
    n: int,
    k: int,
    sms: int = DEFAULT_SM_COUNT,
    efficiency: Mapping[str, float] | None = None,
    splits: int = 1,
    cluster_m: int = CUDA_CLUSTER_M,
) -> str:
    """The ``cuda`` provider's tile configuration for an [m, k] x [k, n] product (numerics-free:
    every configuration gives the same bits).

    Args:
        m: Rows of the product (tokens).
        n: Output columns.
        k: The reduction length (no influence today: every configuration walks K alike).
        sms: The device's streaming multiprocessors (the grid is persistent: one CTA per SM).
        efficiency: Tile efficiencies replacing :data:`CUDA_TILE_EFFICIENCY`'s (the fitting
            script passes others).
        splits: The split-K count the product runs with (:func:`get_cuda_split_k`): its launch
            has ``splits`` times the tiles (counted in every rule below). 1: today's choice.
        cluster_m: Rows from which the model's ``large`` runs as ``large_c2``
            (:data:`CUDA_CLUSTER_M`).

    Returns:
        A name of :data:`CUDA_CONFIGS`. Up to 16 rows ``mid``; up to 256 rows ``small`` where its
        tiles (times ``splits``) fit one wave of the SMs, else the cheapest of ``mid``,
        ``mid192`` and ``large`` in the wave model (:func:`cuda_wave_cost`); above, the cheapest
        of ``large``, ``large192`` and ``square`` (``large_c2`` for ``large`` from ``cluster_m``
        rows). Ties go to the earlier name.
    """
    # H200, graph replay, every config timed in one run (benchmarks/results/h200/session21_gpu,
    # bench_det_gemm_cuda.py --configs): at M 1 / 16 `mid` beat `small` on every N-4096 / 6144
    # product (down_proj 0.575 / 0.701 -> 0.606 / 0.731x cuBLAS, o_proj 0.640 / 0.751 -> 0.699 /
    # 0.815x) and on wide N by more (gate_up, the 151,936 LM head: 0.67 / 0.59 -> 0.85 / 0.91x at
    # M 1); from 17 rows `small` wins where its grid is one wave (o_proj / down_proj at M 128:
    # 1.049 / 1.034x vs `mid` 0.945 / 0.905x). The 192-column tiles (session23_gpu) take the
    # N-6144 rows whose 128- / 256-column grids leave a wave part idle (qkv_proj at M 256: `mid`
    # 0.77x -> `mid192` 0.93x; M 512: `large` 0.84x -> `large192` 1.02x)
    if m <= _CUDA_DECODE_M:
        return "mid"
    if m <= _CUDA_SHORT_M:
        tm, tn = CUDA_TILES["small"]
        if -(-m // tm) * -(-n // tn) * splits <= sms:
            return "small"
        candidates = _CUDA_SHORT_CANDIDATES
    else:
        candidates = _CUDA_LONG_CANDIDATES
    costs = [cuda_wave_cost(c, m, n, sms, efficiency, splits) for c in candidates]
    best = candidates[costs.index(min(costs))]
    return "large_c2" if best == "large" and m >= cluster_m else best


# --- split-K of the ``cuda`` provider (machinery landed switched off) -----------------------------
# S > 1 cuts K into S contiguous slices of K / S columns (a multiple of the 64-column k-block),
# each accumulated as today from its own first column into an fp32 partial [S, M, N]; one
# reduction adds the partials in slice order s = 0, 1, ..., S-1 in fp32, adds the bias, rounds
# once (csrc/det_gemm/det_gemm_sm90.cuh). S changes the bits, so it is numerics: it is a function
# of the product's (N, K) only, never of M (a row's bits stay independent of the batch), and a
# table entry > 1 is a new version of the det_gemm/cuda-sm90 family. (N, K) -> S; a missing
# entry is 1 (today's kernel, unchanged). Empty: no product splits yet (docs/operators/det_gemm.md,
# "CUDA C++ provider", says what a GPU run must show before an entry goes in).
CUDA_SPLIT_K: dict[tuple[int, int], int] = {}
# The K granularity of a slice: the kernels' k-block (numerics: a slice starts at a block start).
CUDA_SPLIT_K_BLOCK = 64
# Largest fp32 partials buffer of one launch (S * rows * N * 4 bytes): above it the rows run in
# chunks (rows are independent: the same bits); a single row over it is refused.
CUDA_SPLIT_K_MAX_WORKSPACE = 256 << 20


def get_cuda_split_k(n: int, k: int) -> int:
    """The split-K count of the ``cuda`` provider's [M, k] x [k, n] product: a function of
    (n, k) only (:data:`CUDA_SPLIT_K`; 1 where it has no entry, which is everywhere today)."""
    return CUDA_SPLIT_K.get((n, k), 1)


def cuda_split_k_slices(k: int, splits: int) -> list[tuple[int, int]]:
    """The K slices ``[(start, stop), ...]`` of a split-K product: ``splits`` contiguous slices
    of ``k / splits`` columns from column 0, in the order their partials are added
    (``splits == 1``: ``[(0, k)]``, the unsplit product, any ``k``).

    Raises:
        TypeError: ``splits`` is not an int.
        ValueError: ``splits < 1``, or ``k`` is not cut into slices of a multiple of
            :data:`CUDA_SPLIT_K_BLOCK` columns (``k`` must be a multiple of ``64 * splits``).
    """
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise TypeError(f"split_k={splits!r}: must be an int")
    if splits < 1:
        raise ValueError(f"split_k={splits}: must be >= 1")
    if splits == 1:
        return [(0, k)]
    step = CUDA_SPLIT_K_BLOCK * splits
    if k % step:
        raise ValueError(
            f"split_k={splits}: K={k} does not cut into {splits} slices of a multiple of "
            f"{CUDA_SPLIT_K_BLOCK} columns (K must be a multiple of {step})"
        )
    ks = k // splits
    return [(s * ks, (s + 1) * ks) for s in range(splits)]
