"""The rules of the trainers' ``token_logprobs`` that do not depend on the trainer (shared by
:mod:`rl_engine.adapters.hf` and :mod:`rl_engine.adapters.megatron`)."""

from __future__ import annotations

import torch


def masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` where ``keep``, else 0 (in ``x.dtype``)."""
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def packed_keep(cu: torch.Tensor, t: int, device: torch.device) -> torch.Tensor:
    """Of a packed layout's ``t - 1`` log-probs (entry ``j``: token ``j + 1``), the bool [t - 1]
    of those whose target does not start a sequence (``cu``: the [B+1] boundaries)."""
    starts = cu[1:-1].long()
    starts = starts[(starts > 0) & (starts < t)]
    keep = torch.ones(t - 1, dtype=torch.bool, device=device)
    keep[starts - 1] = False
    return keep


def check_input_ids(ids: torch.Tensor, vocab: int) -> None:
    """Every id (padding included: the embedding looks each one up) in ``[0, vocab)`` of the
    model's true vocabulary: a clear error instead of an ``IndexError`` inside the embedding (on
    a GPU a device-side assert), a silent zero row under a vocab-parallel embedding at TP > 1
    (ids outside every rank's shard), or a padded row's embedding (Megatron's vocabulary
    padding)."""
    from rl_engine.ops.logp.reference import check_token_range

    if not ids.numel():
        return
    try:
        check_token_range(ids.reshape(-1), vocab)
    except ValueError as exc:
        raise ValueError(f"token_logprobs: input_ids: {exc} (the model's vocabulary)") from None
