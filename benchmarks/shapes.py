"""The one shared list of benchmark shapes (real model dimensions), used by every bench script.

Token counts ``M_VALUES`` span decode (1..64 rows) to prefill / training (4096+ rows).
"""

from __future__ import annotations

from typing import NamedTuple


class GemmShape(NamedTuple):
    """A linear layer ``[M, K] x [K, N]`` (weight stored as ``nn.Linear`` [N, K])."""

    name: str
    k: int
    n: int


# Rows (tokens) per launch.
M_VALUES: tuple[int, ...] = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# Every real projection the grids below draw from, once: (name, K, N).
_PROJECTIONS: dict[str, GemmShape] = {
    s.name: s
    for s in (
        GemmShape("llama3-8b.o_proj", 4096, 4096),
        GemmShape("llama3-8b.qkv_proj", 4096, 6144),
        GemmShape("llama3-8b.up_proj", 4096, 14336),
        GemmShape("llama3-8b.gate_up_proj", 4096, 28672),
        GemmShape("llama3-8b.down_proj", 14336, 4096),
        GemmShape("llama3-8b.lm_head", 4096, 128256),
        GemmShape("qwen3-1.7b.lm_head", 2048, 151936),
        GemmShape("qwen3-8b.gate_up_proj", 4096, 24576),
        GemmShape("qwen3-8b.lm_head", 4096, 151936),
        GemmShape("qwen3-32b.q_proj", 5120, 8192),
        GemmShape("qwen3-30b-a3b.expert_down", 768, 2048),  # one expert's down projection
    )
}


def _grid(*names: str) -> tuple[GemmShape, ...]:
    return tuple(_PROJECTIONS[n] for n in names)


# The det_gemm acceptance grid: Llama-3-8B o_proj / up(gate) / down and a Qwen3-1.7B LM head.
GEMM_SHAPES = _grid(
    "llama3-8b.o_proj", "llama3-8b.up_proj", "llama3-8b.down_proj", "qwen3-1.7b.lm_head"
)

# The CUDA C++ det_gemm's grid (issue 47): the Llama-3-8B projections as vLLM fuses them (N, K:
# o 4096x4096, qkv 6144x4096, gate_up 28672x4096, down 4096x14336) and a 151,936-vocab LM head.
CSRC_GEMM_SHAPES = _grid(
    "llama3-8b.o_proj",
    "llama3-8b.qkv_proj",
    "llama3-8b.gate_up_proj",
    "llama3-8b.down_proj",
    "qwen3-8b.lm_head",
)

# Row-parallel layers (K sharded under TP): Llama-3-8B o_proj / down_proj and a Qwen3-30B-A3B
# expert's down projection (benchmarks/tp_node_dtype.py).
TP_ROW_PARALLEL_SHAPES = _grid(
    "llama3-8b.o_proj", "llama3-8b.down_proj", "qwen3-30b-a3b.expert_down"
)

# Further real projections (not in the acceptance grid; for wider sweeps).
EXTRA_GEMM_SHAPES = _grid(
    "llama3-8b.qkv_proj", "qwen3-8b.gate_up_proj", "qwen3-32b.q_proj", "llama3-8b.lm_head"
)

# The ~1B Qwen2-shaped model of benchmarks/bench_rollout.py and bench_trainer.py (each adds its
# vocabulary, RoPE base and sequence length).
QWEN2_1B = dict(layers=16, hidden=2048, heads=16, kv_heads=8, ffn=5632)
# Llama-3-8B widths at 16 layers (bench_rollout.py --model llama8b_width: the TP benchmark model)
LLAMA3_8B_WIDTH = dict(layers=16, hidden=4096, heads=32, kv_heads=8, ffn=14336)

# The projections of benchmarks/bench_rollout.py's ~1B Qwen2-shaped model (hidden 2048, 16 / 8
# heads of 128, FFN 5632): what a decode step multiplies (fused QKV and gate-up as vLLM runs them).
ROLLOUT_GEMM_SHAPES: tuple[GemmShape, ...] = (
    GemmShape("qwen2-1b.qkv_proj", 2048, 4096),
    GemmShape("qwen2-1b.o_proj", 2048, 2048),
    GemmShape("qwen2-1b.gate_up_proj", 2048, 11264),
    GemmShape("qwen2-1b.down_proj", 5632, 2048),
)

# Hidden sizes (norms, activations, attention heads x dim) and vocabularies of the same models.
HIDDEN_SIZES: tuple[int, ...] = (2048, 4096, 5120)
INTERMEDIATE_SIZES: tuple[int, ...] = (12288, 14336, 25600)
VOCAB_SIZES: tuple[int, ...] = (128256, 151936)
# Attention: (num_q_heads, num_kv_heads, head_dim) of Llama-3-8B / Qwen3-8B / Qwen3-32B.
ATTENTION_HEADS: tuple[tuple[int, int, int], ...] = ((32, 8, 128), (32, 8, 128), (64, 8, 128))

# Mixture-of-experts layers: (hidden, routed experts, top-k, expert FFN) of Qwen3-30B-A3B
# (benchmarks/bench_moe.py).
QWEN3_30B_A3B_MOE = dict(hidden=2048, experts=128, top_k=8, ffn=768)
