"""Arguments of ``grpo_loss``: modes, option schema, normalisation and validation.

One home for what the public entry, the reference and the Triton provider must agree on: the
aggregation modes and ratio types, the order of the op's scalar options (:class:`Options`), the
checks every provider runs on its arguments (:func:`check`) and the public entry's normalisation
(per-sequence broadcasts, the bool mask, ``None`` options; :func:`normalize`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from rl_engine.ops._common import (
    FLOAT_DTYPES,
    as_bool_mask,
    check_float,
    check_same_device,
    check_tensor,
)

__all__ = [
    "AGG_MODES",
    "METRIC_NAMES",
    "RATIO_TYPES",
    "TENSOR_NAMES",
    "Options",
    "check",
    "normalize",
    "per_seq_mean",
    "per_token",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
RATIO_TYPES = ("token", "sequence")

# Order of the metrics vector the op returns.
METRIC_NAMES = (
    "pg_loss",
    "kl_loss",
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "ppo_kl",
    "approx_kl",
    "approx_kl_k2",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "num_tokens",
    "num_seqs",
)

# The op's tensor arguments, in schema order: logp, old_logp, advantages, mask (bool), ref_logp
# (or None), is_weights (or None; the public ``rollout_is_weights``), [B, T] each.
Tensors = tuple[Any, ...]
# Their public names, in that order.
TENSOR_NAMES = ("logp", "old_logp", "advantages", "mask", "ref_logp", "rollout_is_weights")


class Options(NamedTuple):
    """The op's scalar options, in schema order (``None`` of the public API is ``0.0`` here)."""

    clip_low: float
    clip_high: float
    dual_clip: float
    ratio_type: str
    loss_agg: str
    loss_norm: float
    kl_beta: float
    log_ratio_clamp: float


def per_seq_mean(loss_agg: str) -> bool:
    """Whether ``loss_agg`` divides each sequence's sum by its token count first."""
    return loss_agg == "seq-mean-token-mean"


def _named(old_logp: Any, advantages: Any, ref_logp: Any, is_weights: Any) -> dict[str, Any]:
    """The inputs besides ``logp`` and ``mask`` by their public names (error messages)."""
    return {
        "old_logp": old_logp,
        "advantages": advantages,
        "ref_logp": ref_logp,
        "rollout_is_weights": is_weights,
    }


def check(tensors: Sequence[Any], options: Sequence[Any]) -> Options:
    """Validate the op's arguments (``tensors``: :data:`Tensors`; ``options``: :class:`Options`
    fields) as every provider takes them; returns the options as an :class:`Options`."""
    logp, old_logp, advantages, mask, ref_logp, is_weights = tensors
    o = Options(*options)
    check_tensor("logp", logp, dims=2)
    check_tensor("mask", mask, dims=2)
    named = _named(old_logp, advantages, ref_logp, is_weights)
    for name, t in named.items():
        if t is not None or name in ("old_logp", "advantages"):
            check_tensor(name, t, dims=2)
    check_same_device(**dict(zip(TENSOR_NAMES, tensors)))
    check_float("logp", logp, FLOAT_DTYPES)
    for name, t in named.items():
        if t is None:
            continue
        check_float(name, t, FLOAT_DTYPES)
        if t.shape != logp.shape:
            raise ValueError(
                f"grpo_loss: {name} has shape {tuple(t.shape)}, logp {tuple(logp.shape)}"
            )
    if mask.dtype != torch.bool:
        raise TypeError(f"grpo_loss: the op takes a bool mask, got {mask.dtype}")
    if mask.shape != logp.shape:
        raise ValueError(f"grpo_loss: mask has shape {tuple(mask.shape)}, logp {tuple(logp.shape)}")
    if not (0.0 <= o.clip_low < 1.0):
        raise ValueError(f"grpo_loss: clip_low must be in [0, 1), got {o.clip_low}")
    if not (0.0 <= o.clip_high < float("inf")):
        raise ValueError(f"grpo_loss: clip_high must be finite and >= 0, got {o.clip_high}")
    if o.dual_clip != 0.0 and not (1.0 < o.dual_clip < float("inf")):
        raise ValueError(f"grpo_loss: dual_clip must be None or a finite c > 1, got {o.dual_clip}")
    if o.ratio_type not in RATIO_TYPES:
        raise ValueError(
            f"grpo_loss: ratio_type must be one of {list(RATIO_TYPES)}, got {o.ratio_type!r}"
        )
    if o.loss_agg not in AGG_MODES:
        raise ValueError(
            f"grpo_loss: loss_agg must be one of {list(AGG_MODES)}, got {o.loss_agg!r}"
        )
    if o.loss_norm != 0.0 and not (0.0 < o.loss_norm < float("inf")):
        raise ValueError(f"grpo_loss: loss_norm must be None or finite and > 0, got {o.loss_norm}")
    if not (0.0 <= o.kl_beta < float("inf")):
        raise ValueError(f"grpo_loss: kl_beta must be finite and >= 0, got {o.kl_beta}")
    if o.kl_beta != 0.0 and ref_logp is None:
        raise ValueError("grpo_loss: kl_beta > 0 needs ref_logp")
    if not (0.0 < o.log_ratio_clamp < float("inf")):
        raise ValueError(
            f"grpo_loss: log_ratio_clamp must be finite and > 0, got {o.log_ratio_clamp}"
        )
    return o


def per_token(name: str, x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """[B, T] as is; a per-sequence [B] tensor broadcast over T."""
    if x is None:
        return None
    check_tensor(name, x, dims=(1, 2))
    if x.dim() == 1:
        if x.shape[0] != like.shape[0]:
            raise ValueError(
                f"grpo_loss: {name} has shape {tuple(x.shape)}; expected [B] or [B, T] with "
                f"[B, T] = {tuple(like.shape)}"
            )
        return x[:, None].expand(like.shape)
    return x


def normalize(tensors: Sequence[Any], options: Sequence[Any]) -> tuple[Tensors, Options]:
    """The public entry's arguments as the op takes them, validated.

    Args:
        tensors: ``(logp, old_logp, advantages, mask, ref_logp, rollout_is_weights)`` of the
            public API: per-sequence [B] advantages / IS weights, a numeric or ``None`` mask.
        options: ``(clip_low, clip_high, dual_clip, ratio_type, loss_agg, loss_norm, kl_beta,
            log_ratio_clamp)`` of the public API (``None`` for no dual clip / default norm).

    Returns:
        ``(tensors, options)``: [B, T] tensors with a bool mask, and the :class:`Options`.
    """
    logp, old_logp, advantages, mask, ref_logp, rollout_is_weights = tensors
    clip_low, clip_high, dual_clip, ratio_type, loss_agg, loss_norm, kl_beta, clamp = options
    check_tensor("logp", logp, dims=2)
    advantages = per_token("advantages", advantages, logp)
    rollout_is_weights = per_token("rollout_is_weights", rollout_is_weights, logp)
    if mask is None:
        mask = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)
    else:
        check_tensor("mask", mask, dims=2)
        mask = as_bool_mask("grpo_loss", mask)
    if dual_clip is not None and float(dual_clip) == 0.0:
        raise ValueError("grpo_loss: dual_clip must be None or a finite c > 1, got 0")
    if loss_norm is not None and float(loss_norm) == 0.0:
        raise ValueError("grpo_loss: loss_norm must be None or finite and > 0, got 0")
    if torch.is_grad_enabled():
        named = _named(old_logp, advantages, ref_logp, rollout_is_weights)
        for name, t in named.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f"grpo_loss differentiates wrt logp only; {name} requires grad: pass "
                    f"{name}.detach()"
                )
    opts = (
        float(clip_low),
        float(clip_high),
        0.0 if dual_clip is None else float(dual_clip),
        ratio_type,
        loss_agg,
        0.0 if loss_norm is None else float(loss_norm),
        float(kl_beta),
        float(clamp),
    )
    out = (logp, old_logp, advantages, mask, ref_logp, rollout_is_weights)
    return out, check(out, opts)
