"""Arguments of ``ratio_kl``: option schema, normalisation and validation.

One home for what the public entry, the reference and the Triton provider must agree on: the
sequence modes, the order of the op's scalar options (:class:`Options`), the checks every
provider runs on its arguments (:func:`check`) and the public entry's normalisation (``None``
caps and masked-IS ranges to neutral values, the bool mask; :func:`normalize`).
"""

from __future__ import annotations

import math
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

__all__ = ["SEQ_MODES", "Options", "check", "normalize", "options"]

SEQ_MODES = ("sum", "mean")


class Options(NamedTuple):
    """The op's scalar options, in schema order: caps ``inf`` and masked-IS ranges ``[0, inf]``
    when off; ``geometric``: the sequence log-ratio is the mean (``seq_mode="mean"``)."""

    log_ratio_clamp: float
    token_cap: float
    seq_cap: float
    token_mis_lo: float
    token_mis_hi: float
    seq_mis_lo: float
    seq_mis_hi: float
    geometric: bool


def check(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None, limits: Sequence[float]
) -> None:
    """Validate the op's arguments as every provider takes them (``mask``: bool or None).

    ``limits``: the :class:`Options` fields but ``geometric``, ``(log_ratio_clamp, token_cap,
    seq_cap, token_mis_lo, token_mis_hi, seq_mis_lo, seq_mis_hi)``."""
    log_ratio_clamp, token_cap, seq_cap, token_mis_lo, token_mis_hi, seq_mis_lo, seq_mis_hi = limits
    check_tensor("logp", logp, dims=2)
    check_tensor("old_logp", old_logp, dims=2)
    check_float("logp", logp, FLOAT_DTYPES)
    check_float("old_logp", old_logp, FLOAT_DTYPES)
    check_same_device(logp=logp, old_logp=old_logp, mask=mask)
    if old_logp.shape != logp.shape:
        raise ValueError(
            f"ratio_kl: old_logp has shape {tuple(old_logp.shape)}, logp {tuple(logp.shape)}"
        )
    if mask is not None:
        check_tensor("mask", mask, dims=2)
        if mask.dtype != torch.bool:
            raise TypeError(f"ratio_kl: the op takes a bool mask, got {mask.dtype}")
        if mask.shape != logp.shape:
            raise ValueError(
                f"ratio_kl: mask has shape {tuple(mask.shape)}, logp {tuple(logp.shape)}"
            )
    if not (0.0 < log_ratio_clamp < float("inf")):
        raise ValueError(f"ratio_kl: log_ratio_clamp must be finite and > 0, got {log_ratio_clamp}")
    for name, cap in (("token_is_cap", token_cap), ("seq_is_cap", seq_cap)):
        if not cap > 0.0:  # also refuses NaN
            raise ValueError(f"ratio_kl: {name} must be > 0 (or None), got {cap}")
    for name, lo, hi in (
        ("token_mis", token_mis_lo, token_mis_hi),
        ("seq_mis", seq_mis_lo, seq_mis_hi),
    ):
        if not (0.0 <= lo < hi):
            raise ValueError(
                f"ratio_kl: {name} must be (low, high) with 0 <= low < high, got ({lo}, {hi})"
            )


def options(
    log_ratio_clamp: float,
    token_is_cap: float | None,
    seq_is_cap: float | None,
    token_mis: tuple[float, float] | None,
    seq_mis: tuple[float, float] | None,
    seq_mode: str,
) -> Options:
    """The public options as the op takes them (``None`` = the neutral value)."""
    if seq_mode not in SEQ_MODES:
        raise ValueError(f"ratio_kl: seq_mode must be one of {list(SEQ_MODES)}, got {seq_mode!r}")
    for name, rng in (("token_mis", token_mis), ("seq_mis", seq_mis)):
        if rng is not None and (not isinstance(rng, (tuple, list)) or len(rng) != 2):
            raise ValueError(f"ratio_kl: {name} must be None or a (low, high) pair, got {rng!r}")
    tlo, thi = (0.0, math.inf) if token_mis is None else (float(token_mis[0]), float(token_mis[1]))
    slo, shi = (0.0, math.inf) if seq_mis is None else (float(seq_mis[0]), float(seq_mis[1]))
    return Options(
        float(log_ratio_clamp),
        math.inf if token_is_cap is None else float(token_is_cap),
        math.inf if seq_is_cap is None else float(seq_is_cap),
        tlo,
        thi,
        slo,
        shi,
        seq_mode == "mean",
    )


def normalize(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: Any, public: Sequence[Any]
) -> tuple[torch.Tensor | None, Options]:
    """The public entry's mask (numeric: nonzero = real token) and options ``public``
    (``(log_ratio_clamp, token_is_cap, seq_is_cap, token_mis, seq_mis, seq_mode)``) as the op
    takes them, validated: ``(bool mask or None, options)``."""
    opts = options(*public)
    if mask is not None:
        check_tensor("mask", mask)
        mask = as_bool_mask("ratio_kl", mask)
    check(logp, old_logp, mask, opts[:7])
    return mask, opts
