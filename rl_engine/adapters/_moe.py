"""Mixture-of-experts settings of a Hugging Face ``config.json``, read one way for every engine.

The vLLM plugin, the Hugging Face and Megatron adapters and the audit all need the same facts
about an MoE checkpoint: how many experts, top-k, which routing rule (``moe_topk``'s
``scoring`` / ``renormalize``), whether a shared expert joins, which layers are sparse. Reading
them in one place keeps the engines' routing rules identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> the routing rule of its released checkpoints
MOE_FAMILIES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


# config fields of capacity-based token dropping (no supported family has one; a config that
# sets one asks for numerics that depend on the whole batch); None, 0 and -1 mean "no capacity"
CAPACITY_FIELDS = ("moe_expert_capacity_factor", "capacity_factor", "expert_capacity",
                   "router_capacity_factor", "moe_capacity_factor")  # fmt: skip


def token_dropping_reason(cfg: Any) -> str | None:
    """Why a config cannot be routed invariantly because it drops tokens (the first capacity
    field it sets, in :class:`rl_engine.ops.moe_experts.TokenDroppingError`'s words), or
    ``None``. Every adapter refuses with this reason."""
    from rl_engine.ops.moe_experts import TokenDroppingError, refuse_token_dropping

    for field in CAPACITY_FIELDS:
        value = _get(cfg, field)
        if value in (None, 0, -1):
            continue
        try:
            refuse_token_dropping(field, value)
        except TokenDroppingError as exc:
            return str(exc)
    return None


@dataclass(frozen=True)
class MoESpec:
    """The MoE facts of one checkpoint (see :func:`moe_spec`)."""

    family: str  # model_type
    n_experts: int
    top_k: int
    scoring: str  # moe_topk's scoring
    renormalize: bool
    intermediate: int  # an expert's FFN width (I)
    shared_intermediate: int  # the shared expert's FFN width (0: none)
    sparse_layers: tuple[int, ...]  # the decoder layers with an MoE block

    @property
    def topk_kwargs(self) -> dict[str, Any]:
        """``moe_topk`` keyword arguments of this family's router."""
        return {"scoring": self.scoring, "renormalize": self.renormalize}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def moe_spec(cfg: Any) -> MoESpec | None:
    """The :class:`MoESpec` of a config (a ``config.json`` dict or a transformers config), or
    ``None`` for a dense model. Raises ``ValueError`` for a configuration no engine could route
    invariantly (top-k larger than the expert count, a router with jitter noise)."""
    family = _get(cfg, "model_type")
    if family not in MOE_FAMILIES:
        return None
    n_layers = int(_get(cfg, "num_hidden_layers"))
    if family == "mixtral":
        n_experts = int(_get(cfg, "num_local_experts"))
        scoring, renorm = "topk_softmax", False
        inter, shared = int(_get(cfg, "intermediate_size")), 0
        sparse = tuple(range(n_layers))
        jitter = _get(cfg, "router_jitter_noise", 0.0) or 0.0
        if jitter:
            raise ValueError(
                f"router_jitter_noise={jitter}: random multiplicative noise on the hidden states "
                "before the router (in training mode) makes a token's experts random (set it "
                "to 0)"
            )
    else:
        # released Qwen checkpoints say num_experts; transformers 5 saves num_local_experts
        n_experts = int(_get(cfg, "num_experts") or _get(cfg, "num_local_experts"))
        scoring, renorm = "softmax", bool(_get(cfg, "norm_topk_prob", False))
        inter = int(_get(cfg, "moe_intermediate_size"))
        shared = int(_get(cfg, "shared_expert_intermediate_size", 0) or 0)
        if family != "qwen2_moe":
            shared = 0
        step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(_get(cfg, "mlp_only_layers", None) or [])
        sparse = tuple(
            i for i in range(n_layers) if i not in dense and n_experts > 0 and (i + 1) % step == 0
        )
    top_k = int(_get(cfg, "num_experts_per_tok"))
    if not 1 <= top_k <= n_experts:
        raise ValueError(
            f"num_experts_per_tok={top_k} with {n_experts} experts: top-k must be in "
            f"[1, {n_experts}]"
        )
    return MoESpec(family, n_experts, top_k, scoring, renorm, inter, shared, sparse)
