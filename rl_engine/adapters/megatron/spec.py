"""GPT layer / block specs built from rl_engine modules (megatron-core local spec, no TE/apex)."""

from __future__ import annotations

from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from rl_engine.adapters.megatron.modules import (
    RLMLP,
    RLColumnParallelLinear,
    RLCoreAttention,
    RLRMSNorm,
    RLRowParallelLinear,
    RLSelfAttention,
    RopeSettings,
    rl_bias_dropout_add,
)

__all__ = ["get_gpt_block_rl_spec", "get_gpt_layer_rl_spec"]


def get_gpt_layer_rl_spec(
    qk_layernorm: bool = False, rope: RopeSettings | None = None
) -> ModuleSpec:
    """A ``TransformerLayer`` spec whose numerics run on rl_engine ops.

    input RMSNorm -> QKV (column parallel, ``det_gemm``, optional bias) -> optional per-head q/k
    RMSNorm -> rl_engine RoPE -> rl_engine attention -> O projection (row parallel) ->
    ``x + residual`` -> pre-MLP RMSNorm -> FC1 ``[gate; up]`` -> ``silu_and_mul`` -> FC2 ->
    ``x + residual``.

    Build the model with ``position_embedding_type="none"``: RoPE is applied by the core
    attention from ``rope`` (Megatron's own rotary tables are not used).

    Args:
        qk_layernorm: per-head RMSNorm of q and k (Qwen3).
        rope: RoPE parameters; ``None`` for a model without rotary embeddings.
    """
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RLRMSNorm,
            self_attention=ModuleSpec(
                module=RLSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=RLColumnParallelLinear,
                    core_attention=ModuleSpec(module=RLCoreAttention, params={"rope": rope}),
                    linear_proj=RLRowParallelLinear,
                    q_layernorm=RLRMSNorm if qk_layernorm else IdentityOp,
                    k_layernorm=RLRMSNorm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=rl_bias_dropout_add,
            pre_mlp_layernorm=RLRMSNorm,
            mlp=ModuleSpec(
                module=RLMLP,
                submodules=MLPSubmodules(
                    linear_fc1=RLColumnParallelLinear, linear_fc2=RLRowParallelLinear
                ),
            ),
            mlp_bda=rl_bias_dropout_add,
        ),
    )


def get_gpt_block_rl_spec(
    num_layers: int, qk_layernorm: bool = False, rope: RopeSettings | None = None
) -> TransformerBlockSubmodules:
    """``num_layers`` rl_engine layers plus an rl_engine final RMSNorm (pass to ``GPTModel``)."""
    layer = get_gpt_layer_rl_spec(qk_layernorm=qk_layernorm, rope=rope)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RLRMSNorm)
