"""GPT layer / block specs built from rl_engine modules (megatron-core local spec, no TE/apex)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
from rl_engine.adapters.megatron.moe import RLMoELayer

__all__ = ["get_gpt_block_rl_spec", "get_gpt_layer_rl_spec"]


def get_gpt_layer_rl_spec(
    qk_layernorm: bool = False,
    rope: RopeSettings | None = None,
    moe: dict[str, Any] | None = None,
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
        moe: a mixture-of-experts layer: the MLP is
            :class:`~rl_engine.adapters.megatron.moe.RLMoELayer` built with these keyword
            arguments (``scoring``, ``renormalize``; ``{}``: from the Megatron config).
    """
    if moe is not None:
        mlp: ModuleSpec = ModuleSpec(module=RLMoELayer, params=dict(moe))
    else:
        mlp = ModuleSpec(
            module=RLMLP,
            submodules=MLPSubmodules(
                linear_fc1=RLColumnParallelLinear, linear_fc2=RLRowParallelLinear
            ),
        )
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
            mlp=mlp,
            mlp_bda=rl_bias_dropout_add,
        ),
    )


def get_gpt_block_rl_spec(
    num_layers: int,
    qk_layernorm: bool = False,
    rope: RopeSettings | None = None,
    moe: dict[str, Any] | None = None,
    moe_layers: Sequence[bool] | None = None,
) -> TransformerBlockSubmodules:
    """``num_layers`` rl_engine layers plus an rl_engine final RMSNorm (pass to ``GPTModel``).

    ``moe``: the :class:`~rl_engine.adapters.megatron.moe.RLMoELayer` arguments of the MoE
    layers; ``moe_layers``: which layers are MoE (default: all of them when ``moe`` is given).
    """
    if moe_layers is None:
        moe_layers = [moe is not None] * num_layers
    if len(moe_layers) != num_layers:
        raise ValueError(f"moe_layers has {len(moe_layers)} entries for {num_layers} layers")
    if any(moe_layers) and moe is None:
        moe = {}
    dense = get_gpt_layer_rl_spec(qk_layernorm=qk_layernorm, rope=rope)
    sparse = get_gpt_layer_rl_spec(qk_layernorm=qk_layernorm, rope=rope, moe=moe)
    layers = [sparse if is_moe else dense for is_moe in moe_layers]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RLRMSNorm)
