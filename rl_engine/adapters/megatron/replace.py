"""In-place replacement of an existing megatron-core ``GPTModel``'s numerics by rl_engine ops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine.adapters.megatron.logprobs import VOCAB_ATTR, true_vocab_size, unwrap_gpt
from rl_engine.adapters.megatron.modules import (
    RLMLP,
    RLColumnParallelLinear,
    RLCoreAttention,
    RLRMSNorm,
    RLRowParallelLinear,
    RLSelfAttention,
    RopeSettings,
    UnsupportedNumericsError,
    rl_bias_dropout_add,
)

__all__ = ["ReplaceReport", "replace_modules"]

MARK = "_rl_engine_patched"


@dataclass
class ReplaceReport:
    """What :func:`replace_modules` did.

    Attributes:
        replaced: qualified names of modules swapped to rl_engine numerics.
        already: names that were already rl_engine modules (idempotence).
        not_replaced: ``(name, reason)`` of numerically relevant modules (or settings) left
            as they were; never empty when anything that holds parameters, or the model's RoPE,
            was skipped.
        left_alone: names deliberately untouched (exact ops: embedding lookup, identity ops).

    Names are relative to the ``GPTModel`` (inside any DDP / ``Float16Module`` wrapper).
    """

    replaced: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    not_replaced: list[tuple[str, str]] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)


def _infer_rope(model: Any) -> RopeSettings | None:
    """RoPE settings recovered (and verified bitwise) from the model's ``RotaryEmbedding``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rot = getattr(model, "rotary_pos_emb", None)
    if rot is None:
        return None
    if type(rot) is not RotaryEmbedding:
        raise UnsupportedNumericsError(
            f"replace_modules: rotary embedding {type(rot).__name__} is not supported "
            "(default RoPE only); pass rope= explicitly"
        )
    if rot.seq_len_interpolation_factor is not None:
        raise UnsupportedNumericsError(
            "replace_modules: seq_len_interpolation_factor cannot be inferred; pass rope="
        )
    inv = rot.inv_freq.detach().float().cpu()
    dim = 2 * inv.numel()
    if inv.numel() < 2:
        raise UnsupportedNumericsError("replace_modules: cannot infer the RoPE base; pass rope=")
    base = round(float(inv[1].double() ** (-dim / 2.0)))
    check = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not torch.equal(check, inv):
        raise UnsupportedNumericsError(
            "replace_modules: the model's RoPE frequencies are not plain RoPE with an integer "
            "base (rope scaling?); pass rope=RopeSettings(...) explicitly"
        )
    head_dim = model.config.kv_channels
    return RopeSettings(
        theta=float(base),
        rotary_dim=None if dim == head_dim else dim,
        is_neox=not rot.rotary_interleaved,
    )


def _swap_class(module: torch.nn.Module, cls: type) -> None:
    module.__class__ = cls


_ROPE_TYPES = ("rope", "mrope", "yarn")  # Megatron position_embedding_type values applying RoPE


def _check_rope(gpt: Any, rope: RopeSettings | None, report: ReplaceReport) -> None:
    """A model that applies RoPE must get rl_engine's RoPE: never drop it silently."""
    kind = getattr(gpt, "position_embedding_type", None)
    if rope is None and (kind in _ROPE_TYPES or getattr(gpt, "rotary_pos_emb", None) is not None):
        report.not_replaced.append(
            (
                "rotary_pos_emb",
                f"the model applies RoPE (position_embedding_type={kind!r}) but no RoPE settings "
                "were given or found; pass rope=RopeSettings(...)",
            )
        )


def _norm_eps(child: torch.nn.Module, cfg: Any) -> tuple[float | None, str]:
    """The epsilon of an RMSNorm replacement: the model config's ``layernorm_epsilon`` (what the
    rollout engine reads as ``rms_norm_eps``); ``(None, reason)`` when it cannot be settled."""
    cfg_eps = getattr(cfg, "layernorm_epsilon", None)
    eps = getattr(child, "eps", None)
    if cfg_eps is None:
        if eps is None:
            return None, "RMSNorm with eps=None and no config.layernorm_epsilon"
        return float(eps), ""
    if eps is not None and float(eps) != float(cfg_eps):
        return None, (
            f"RMSNorm eps {eps} differs from config.layernorm_epsilon {cfg_eps} (which one "
            "does the rollout engine use?)"
        )
    return float(cfg_eps), ""


def replace_modules(
    model: torch.nn.Module,
    *,
    rope: RopeSettings | None | str = "infer",
    strict: bool = True,
    vocab_size: int | None = None,
) -> ReplaceReport:
    """Swap a megatron-core ``GPTModel``'s layers for rl_engine ones, in place.

    Parameters and buffers are kept (the same ``Parameter`` objects: optimizer state and DDP
    buffers stay valid). Linear layers change class (``ColumnParallelLinear`` ->
    :class:`RLColumnParallelLinear`, ``RowParallelLinear`` -> :class:`RLRowParallelLinear`,
    including the output layer), ``SelfAttention`` -> :class:`RLSelfAttention`, ``MLP`` ->
    :class:`RLMLP`; RMSNorm modules and ``DotProductAttention`` are replaced by new rl_engine
    modules holding the same weight ``Parameter``; the bias-dropout-add functions become
    :func:`rl_bias_dropout_add`. Calling it again changes nothing (idempotent).

    Deliberately left alone: the embedding lookup (a row gather, exact), identity ops, and
    Megatron's ``RotaryEmbedding`` module (still computed by ``GPTModel``, its output is ignored:
    the core attention applies rl_engine's RoPE from ``rope``).

    RMSNorm epsilons come from the model config (``layernorm_epsilon``, the rollout's
    ``rms_norm_eps``); a norm whose own eps is ``None`` gets the config's, one whose eps differs
    from the config's is not replaced. Every module that holds parameters and is neither replaced
    nor an exact op is reported in ``not_replaced``, as is a model that applies RoPE when no
    RoPE settings were given or found.

    Args:
        model: a ``GPTModel`` (local spec; TE / apex modules are not replaceable), or a wrapper
            of one (DDP, ``Float16Module``, anything with a ``.module`` chain): the
            ``GPTModel`` inside is converted.
        rope: :class:`RopeSettings`; ``"infer"`` recovers plain RoPE from the model and checks
            the frequencies bitwise; ``None`` for a model without RoPE.
        strict: raise :class:`UnsupportedNumericsError` listing every numerically relevant
            module that could not be replaced (otherwise they are only reported).
        vocab_size: the true (unpadded) vocabulary size (the checkpoint's ``vocab_size``),
            recorded on the model for :func:`~rl_engine.adapters.megatron.token_logprobs`, which
            then excludes Megatron's padded vocabulary rows. ``GPTModel.vocab_size`` may include
            padding, so it is never assumed.

    Returns:
        A :class:`ReplaceReport`.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    model = unwrap_gpt(model)
    if vocab_size is not None:
        setattr(model, VOCAB_ATTR, true_vocab_size(model, vocab_size))
    report = ReplaceReport()
    if rope == "infer":
        existing = [m.rope for m in model.modules() if isinstance(m, RLCoreAttention)]
        rope = existing[0] if existing else _infer_rope(model)
    if not isinstance(rope, RopeSettings | None):
        raise TypeError(
            f"replace_modules: rope must be RopeSettings, None or 'infer', not {rope!r}"
        )
    if any(type(m) is DotProductAttention for m in model.modules()):
        _check_rope(model, rope, report)
    cfg = model.config
    if getattr(cfg, "fp32_residual_connection", False):
        report.not_replaced.append(("config", "fp32_residual_connection"))
    if getattr(cfg, "sequence_parallel", False):
        report.not_replaced.append(("config", "sequence_parallel"))
    if getattr(cfg, "gated_linear_unit", False) is False:
        report.not_replaced.append(("config", "non-gated MLP (silu_and_mul needs gate/up)"))
    elif cfg.activation_func is not torch.nn.functional.silu:
        report.not_replaced.append(("config", f"activation {cfg.activation_func}"))

    norm_types = (torch.nn.RMSNorm,)
    named = list(model.named_modules())
    # mixture of experts: megatron's MoELayer (router, dispatcher, experts) is not converted in
    # place (build the model with from_pretrained / the rl_engine spec: RLMoELayer); its
    # submodules are left as they are, so that a half-converted MoE layer cannot arise
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    from rl_engine.adapters.megatron.moe import RLMoELayer

    moe = [n for n, m in named if isinstance(m, BaseMoELayer | RLMoELayer)]
    for n, m in named:
        if isinstance(m, RLMoELayer):
            report.already.append(n)
        elif n in moe:
            report.not_replaced.append(
                (n, f"{type(m).__name__}: megatron's MoE layer is not replaced in place; build "
                    "the model with from_pretrained or the rl_engine spec (RLMoELayer)")
            )  # fmt: skip
    named = [(n, m) for n, m in named if not any(n == p or n.startswith(p + ".") for p in moe)]
    for name, mod in named:
        if getattr(mod, MARK, False) or isinstance(
            mod, (RLRMSNorm, RLCoreAttention, RLColumnParallelLinear, RLRowParallelLinear)
        ):
            if isinstance(mod, (RLRMSNorm, RLCoreAttention)) or type(mod) in (
                RLColumnParallelLinear,
                RLRowParallelLinear,
                RLSelfAttention,
                RLMLP,
            ):
                report.already.append(name)
            continue
        if type(mod) is ColumnParallelLinear:
            _swap_class(mod, RLColumnParallelLinear)
            report.replaced.append(name)
        elif type(mod) is RowParallelLinear:
            _swap_class(mod, RLRowParallelLinear)
            report.replaced.append(name)
        elif type(mod) is SelfAttention:
            _swap_class(mod, RLSelfAttention)
            report.replaced.append(name)
        elif type(mod) is RLSelfAttention:
            report.already.append(name)
        elif type(mod) is MLP:
            _swap_class(mod, RLMLP)
            report.replaced.append(name)
        elif type(mod) is RLMLP:
            report.already.append(name)
        elif isinstance(mod, TransformerLayer):
            for attr in ("self_attn_bda", "mlp_bda"):
                fn = getattr(mod, attr, None)
                if fn is not None and fn is not rl_bias_dropout_add:
                    setattr(mod, attr, rl_bias_dropout_add)
                    report.replaced.append(f"{name}.{attr}")
        elif isinstance(mod, IdentityOp) or type(mod).__name__ in (
            "VocabParallelEmbedding",
            "LanguageModelEmbedding",
            "Embedding",
            "RotaryEmbedding",
            "Dropout",
        ):
            report.left_alone.append(name)

    # Child replacements (new module objects holding the same parameters).
    for name, mod in named:
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) in norm_types:
                if child.weight is None:
                    report.not_replaced.append((full, "RMSNorm without weight"))
                    continue
                eps, why = _norm_eps(child, cfg)
                if eps is None:
                    report.not_replaced.append((full, why))
                    continue
                setattr(mod, child_name, RLRMSNorm.wrapping(cfg, child.weight, eps))
                report.replaced.append(full)
            elif type(child) is DotProductAttention:
                new = RLCoreAttention(
                    config=cfg,
                    layer_number=child.layer_number,
                    attn_mask_type=child.attn_mask_type,
                    attention_type=child.attention_type,
                    softmax_scale=_dpa_scale(child),
                    rope=rope,
                )
                setattr(mod, child_name, new)
                report.replaced.append(full)
            elif (
                isinstance(child, torch.nn.LayerNorm)
                or "Norm" in type(child).__name__
                and not (isinstance(child, RLRMSNorm))
            ):
                report.not_replaced.append((full, f"{type(child).__name__} (not RMSNorm)"))
            elif type(child).__module__.startswith(("transformer_engine", "apex")) or (
                type(child).__name__.startswith("TE")
            ):
                report.not_replaced.append((full, f"{type(child).__name__} (TE / apex module)"))
    # Anything else that holds parameters was skipped: say so.
    covered = set(report.replaced) | set(report.already) | set(report.left_alone)
    flagged = {n for n, _ in report.not_replaced}
    for name, mod in named:
        if name in covered or name in flagged or isinstance(mod, RLRMSNorm | RLCoreAttention):
            continue
        if any(True for _ in mod.parameters(recurse=False)):
            report.not_replaced.append(
                (name, f"{type(mod).__name__} holds parameters that rl_engine does not route")
            )
    if strict and report.not_replaced:
        lines = "; ".join(f"{n}: {r}" for n, r in report.not_replaced)
        raise UnsupportedNumericsError(f"replace_modules(strict=True): cannot replace {lines}")
    return report


def _dpa_scale(dpa: Any) -> float:
    """The softmax scale for an rl_engine core attention replacing ``dpa``.

    Megatron's default is ``1 / math.sqrt(head_dim)``; the rollout engine (and Hugging Face) use
    ``head_dim ** -0.5``, which differs in the last bit for some head dims (32, 96, 128). The
    default therefore maps to ``head_dim ** -0.5``; an explicitly configured scale is kept.
    """
    cfg = dpa.config
    if getattr(cfg, "apply_query_key_layer_scaling", False):
        raise UnsupportedNumericsError("apply_query_key_layer_scaling is not supported")
    head_dim = dpa.hidden_size_per_attention_head
    scale = float(dpa.softmax_scale)
    if scale == 1.0 / math.sqrt(head_dim):
        return head_dim**-0.5
    return scale
