"""Tile configurations of the Triton ``det_gemm`` provider: a checked-in table, no autotuning.

What may vary here and what may not:

* Tile shapes (``block_m``, ``block_n``, ``block_k``), the launch order (``group_m``), warps and
  pipeline stages change *how* the work is spread over the GPU, never the reduction order: every
  program accumulates K sequentially into one fp32 accumulator, and the tensor-core instruction
  (k16 for bf16/fp16) or the IEEE FMA chain (fp32) fixes the order inside a tile. So the table may
  pick a config by the number of rows M; ``tests/ops/test_det_gemm_triton.py`` proves that every
  config shipped here gives bitwise-equal outputs on the same inputs.
* ``WGRAD_CHUNK`` *is* numerics: the weight gradient reduces tokens in chunks of this many rows,
  a fresh fp32 accumulator per chunk, chunk partials added in token order. It is a fixed number
  (never the number of SMs or anything derived from the batch).

The table was tuned on an H100 (see ``docs/operators/det_gemm.md``); it is a performance
choice only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = [
    "WGRAD_CHUNK",
    "DetGemmConfig",
    "WgradConfig",
    "all_configs",
    "get_config",
    "get_wgrad_config",
]

# Weight-gradient token chunk (part of the numerics of the ``triton`` family; see module doc).
WGRAD_CHUNK = 256

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

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps}: expected 1, 2, 4, 8 or 16")

    def for_interpreter(self) -> DetGemmConfig:
        return dataclasses.replace(self, block_k=INTERPRETER_BLOCK_K, tma=False)


@dataclass(frozen=True)
class WgradConfig:
    """Launch configuration of the weight-gradient kernel: out tile [block_o, block_n], token
    step ``block_t`` (must divide ``WGRAD_CHUNK``)."""

    block_o: int
    block_n: int
    block_t: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if WGRAD_CHUNK % self.block_t:
            raise ValueError(f"block_t={self.block_t} must divide WGRAD_CHUNK={WGRAD_CHUNK}")

    def for_interpreter(self) -> WgradConfig:
        return dataclasses.replace(self, block_t=INTERPRETER_BLOCK_K)


_C = DetGemmConfig

# 16-bit inputs (bf16 / fp16): (m_max, n_min, config); the first row with M <= m_max and
# N >= n_min wins. Tuned on an H100 (benchmarks/bench_det_gemm.py --sweep): decode sizes use
# narrow pointer-load tiles so that enough programs stream the weight; wide layers (N >= 8192)
# switch to the persistent TMA kernel earlier; from M > 512 on, persistent TMA 128x256x64.
_TABLE_16BIT: tuple[tuple[int, int, DetGemmConfig], ...] = (
    (1, 0, _C(16, 32, 128, group_m=1, num_warps=2, num_stages=6)),
    (16, 0, _C(16, 64, 128, group_m=1, num_warps=4, num_stages=6)),
    (64, 0, _C(64, 32, 128, group_m=1, num_warps=4, num_stages=4)),
    (128, 8192, _C(128, 128, 64, group_m=8, num_warps=4, num_stages=4, tma=True)),
    (128, 0, _C(64, 64, 128, group_m=8, num_warps=4, num_stages=4)),
    (512, 8192, _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)),
    (256, 0, _C(64, 128, 64, group_m=8, num_warps=4, num_stages=4)),
    (512, 0, _C(128, 128, 64, group_m=8, num_warps=4, num_stages=4)),
    (1 << 62, 0, _C(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)),
)

# fp32 inputs: IEEE FMA dots (no TF32), smaller tiles.
_TABLE_FP32: tuple[tuple[int, int, DetGemmConfig], ...] = (
    (16, 0, _C(16, 64, 32, group_m=1, num_warps=4, num_stages=3)),
    (64, 0, _C(32, 64, 32, group_m=8, num_warps=4, num_stages=3)),
    (1 << 62, 0, _C(64, 64, 32, group_m=8, num_warps=4, num_stages=3)),
)

_WGRAD_16BIT = WgradConfig(block_o=128, block_n=128, block_t=64, num_warps=8, num_stages=3)
_WGRAD_FP32 = WgradConfig(block_o=64, block_n=64, block_t=32, num_warps=4, num_stages=3)


def _table(dtype: torch.dtype) -> tuple[tuple[int, int, DetGemmConfig], ...]:
    return _TABLE_FP32 if dtype == torch.float32 else _TABLE_16BIT


def get_config(m: int, n: int, k: int, dtype: torch.dtype) -> DetGemmConfig:
    """The forward config for an [m, k] x [k, n] product (shape-dependent, numerics-free)."""
    for m_max, n_min, cfg in _table(dtype):
        if m <= m_max and n >= n_min:
            return cfg
    return _table(dtype)[-1][2]


def get_wgrad_config(dtype: torch.dtype) -> WgradConfig:
    return _WGRAD_FP32 if dtype == torch.float32 else _WGRAD_16BIT


def all_configs(dtype: torch.dtype) -> list[DetGemmConfig]:
    """Every distinct forward config the table can return for ``dtype`` (for the tests)."""
    seen: list[DetGemmConfig] = []
    for _, _, cfg in _table(dtype):
        if cfg not in seen:
            seen.append(cfg)
    return seen
