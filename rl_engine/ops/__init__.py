"""Functional API of the ops. Each resolves its provider through :class:`KernelRegistry`.

``rl_engine.ops.det_gemm(a, b)`` etc.; every function takes an optional keyword ``backend=`` that
pins a provider for that call (it raises when the provider cannot run). The op packages
(``rl_engine.ops.<op>``) stay importable by full name; the package attributes are the functions.
"""

from __future__ import annotations

from rl_engine.ops.attention import attention, paged_attention, write_kv_cache
from rl_engine.ops.det_gemm import det_gemm, det_gemm_cat
from rl_engine.ops.entropy import entropy
from rl_engine.ops.grouped_poly_norm import grouped_poly_norm
from rl_engine.ops.grpo_loss import grpo_loss
from rl_engine.ops.linear_logp import linear_logp
from rl_engine.ops.logp import logp
from rl_engine.ops.moe_combine import moe_combine
from rl_engine.ops.moe_experts import moe_experts
from rl_engine.ops.moe_router import moe_router, moe_topk
from rl_engine.ops.poly_norm import fused_mul_poly_norm, poly_norm
from rl_engine.ops.ratio_kl import ratio_kl
from rl_engine.ops.rms_norm import rms_norm
from rl_engine.ops.rope import rope, rope_qk
from rl_engine.ops.silu_and_mul import silu_and_mul

__all__ = [
    "attention",
    "det_gemm",
    "det_gemm_cat",
    "entropy",
    "fused_mul_poly_norm",
    "grouped_poly_norm",
    "grpo_loss",
    "linear_logp",
    "logp",
    "moe_combine",
    "moe_experts",
    "moe_router",
    "moe_topk",
    "paged_attention",
    "poly_norm",
    "ratio_kl",
    "rms_norm",
    "rope",
    "rope_qk",
    "silu_and_mul",
    "write_kv_cache",
]
