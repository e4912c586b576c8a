"""``token_logprobs`` for a patched transformers model (the teacher-forced reference path)."""

from __future__ import annotations

from typing import Any

import torch

from rl_engine import ops
from rl_engine.adapters._logprobs import check_input_ids, masked, packed_keep
from rl_engine.adapters.hf.patch import UnsupportedModelError, is_patched

__all__ = ["token_logprobs"]


def _parts(model: Any) -> tuple[Any, torch.Tensor]:
    if not is_patched(model):
        raise UnsupportedModelError(
            "token_logprobs: call rl_engine.adapters.hf.patch_model(model) first"
        )
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError("token_logprobs: the model has no LM head")
    return model.get_decoder(), head.weight


def _check_ids(model: Any, ids: torch.Tensor) -> None:
    """:func:`check_input_ids` against the input embedding's rows."""
    emb = model.get_input_embeddings()
    if emb is not None:
        check_input_ids(ids, int(emb.weight.shape[0]))


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    attention_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``input_ids[:, 1:]`` at ``temperature`` through ``linear_logp``.

    Same contract as :func:`rl_engine.adapters.megatron.token_logprobs`: padded [B, T] with an
    optional ``attention_mask`` (any padding side; position ids are ``cumsum(mask) - 1`` as
    ``generate`` uses) -> [B, T-1], 0 where the target or its predecessor is padding; or packed
    [T] / [1, T] with ``cu_seqlens`` [B+1] -> [T-1] (or [1, T-1]), 0 where the target starts a
    sequence. Differentiable; the [tokens, vocab] logits are never materialised.
    """
    decoder, weight = _parts(model)
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be int64/int32, got {input_ids.dtype}")
    ids = input_ids.long()
    _check_ids(model, ids)
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass either cu_seqlens (packed) or attention_mask (padded), not both")
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be [T] or [1, T], got {tuple(ids.shape)}")
        flat = ids.reshape(-1)
        t = flat.shape[0]
        cu = cu_seqlens.to(device=flat.device, dtype=torch.int32)
        if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                f"cu_seqlens must run from 0 to {t}, non-decreasing; got {cu.tolist()}"
            )
        lens = (cu[1:] - cu[:-1]).long()
        starts = torch.repeat_interleave(cu[:-1].long(), lens, output_size=t)
        pos = (torch.arange(t, device=flat.device) - starts).unsqueeze(0)
        max_len = int(lens.max())
        h = decoder(
            input_ids=flat.unsqueeze(0),
            position_ids=pos,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
        ).last_hidden_state[0]
        res = ops.linear_logp(h[:-1], weight, flat[1:], temperature, return_entropy=return_entropy)
        keep = packed_keep(cu, t, flat.device)
        outs = tuple(masked(r, keep) for r in (res if return_entropy else (res,)))
        if ids.dim() == 2:
            outs = tuple(o.unsqueeze(0) for o in outs)
        return outs if return_entropy else outs[0]
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(ids.shape)}")
    b, t = ids.shape
    if attention_mask is not None:
        if attention_mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(ids.shape)}"
            )
        mask = attention_mask.to(torch.bool)
        pos = (torch.cumsum(mask.long(), 1) - 1).clamp(min=0)
        h = decoder(
            input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False
        ).last_hidden_state
    else:
        mask = None
        h = decoder(input_ids=ids, use_cache=False).last_hidden_state
    h = h[:, :-1].reshape(b * (t - 1), -1)
    res = ops.linear_logp(
        h, weight, ids[:, 1:].reshape(-1), temperature, return_entropy=return_entropy
    )
    outs = [r.view(b, t - 1) for r in (res if return_entropy else (res,))]
    if mask is not None:
        keep = mask[:, 1:] & mask[:, :-1]
        outs = [masked(o, keep) for o in outs]
    return tuple(outs) if return_entropy else outs[0]
