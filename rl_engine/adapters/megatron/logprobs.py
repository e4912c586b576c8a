"""``token_logprobs``: teacher-forced token log-probs of a megatron-core GPTModel via linear_logp."""

from __future__ import annotations

from typing import Any

import torch

from rl_engine import ops
from rl_engine.adapters._logprobs import check_input_ids, masked, packed_keep
from rl_engine.adapters.megatron.modules import UnsupportedNumericsError

__all__ = ["token_logprobs", "true_vocab_size", "unwrap_gpt"]


def unwrap_gpt(model: Any) -> Any:
    """The ``GPTModel`` inside DDP / ``Float16Module`` style wrappers (``.module`` chains)."""
    from megatron.core.models.gpt import GPTModel

    m = model
    for _ in range(8):
        if isinstance(m, GPTModel):
            return m
        m = getattr(m, "module", None)
        if m is None:
            break
    raise TypeError(f"expected a megatron-core GPTModel (or a wrapper of one), got {type(model)}")


VOCAB_ATTR = "rl_engine_vocab_size"  # the true (unpadded) vocabulary size recorded on a GPTModel


def true_vocab_size(gpt: Any, vocab_size: int | None = None) -> int:
    """The true (unpadded) vocabulary size of ``gpt``: ``vocab_size`` when given, else the size
    recorded on the model (``model.rl_engine_vocab_size``, set by
    :func:`~rl_engine.adapters.megatron.from_pretrained` and by
    :func:`~rl_engine.adapters.megatron.replace_modules` with ``vocab_size=``).

    ``GPTModel.vocab_size`` is not used on its own: Megatron pads the vocabulary (e.g.
    ``make_vocab_size_divisible_by`` x TP) and the model does not know by how much, while the
    rollout engine truncates its logits to the checkpoint's ``vocab_size``.

    Raises:
        ValueError: the size is unknown, or outside ``[1, GPTModel.vocab_size]``.
    """
    v = vocab_size if vocab_size is not None else getattr(gpt, VOCAB_ATTR, None)
    if v is None:
        raise ValueError(
            "token_logprobs: the true vocabulary size of this GPTModel is unknown "
            f"(GPTModel.vocab_size={gpt.vocab_size} may include Megatron's vocabulary padding, "
            "whose columns must not take probability mass): pass vocab_size=<the checkpoint's "
            "vocab_size>, or declare it once with replace_modules(model, vocab_size=...)"
        )
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= gpt.vocab_size:
        raise ValueError(
            f"token_logprobs: vocab_size must be an int in [1, {gpt.vocab_size}] (the model's "
            f"padded vocabulary), got {v!r}"
        )
    return v


def _output_weight(gpt: Any, vocab_size: int | None = None) -> torch.Tensor:
    """The LM-head weight rows of the true vocabulary (padded rows sliced off: a view)."""
    if not (gpt.pre_process and gpt.post_process):
        raise UnsupportedNumericsError("token_logprobs: pipeline parallelism is not supported")
    if gpt.share_embeddings_and_output_weights:
        w = gpt.shared_embedding_or_output_weight()
    else:
        w = gpt.output_layer.weight
    if w.shape[0] != gpt.vocab_size:
        w = _gather_vocab_rows(w, gpt.vocab_size)
    v = true_vocab_size(gpt, vocab_size)
    return w if v == w.shape[0] else w[:v]


class _GatherReplicated(torch.autograd.Function):
    """All-gather along dim 0 over the TP group (rank order) of a tensor whose consumers then
    run identically on every rank (the vocab-parallel LM head's rows, the sequence-parallel
    final hidden states); backward: this rank's block of the replicated gradient. Exact copies
    both ways (Megatron's own gathers would reduce-scatter the gradient: a sum of the ranks'
    identical copies)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        world = torch.distributed.get_world_size(group)
        ctx.rank, ctx.rows = torch.distributed.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def _gather_sequence(h: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return h
    return _GatherReplicated.apply(h, parallel_state.get_tensor_model_parallel_group())


def _gather_vocab_rows(w: torch.Tensor, vocab: int) -> torch.Tensor:
    """The whole LM head from its TP shards: every rank then computes the log-probs over the
    whole vocabulary in the single-device order (the same bits at every TP degree; costs the
    head's weight once more per rank)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if w.shape[0] * tp != vocab:
        raise UnsupportedNumericsError(
            f"token_logprobs: the LM head holds {w.shape[0]} of {vocab} vocabulary rows, which "
            f"is not a TP = {tp} shard"
        )
    return _GatherReplicated.apply(w, parallel_state.get_tensor_model_parallel_group())


def _hidden(gpt: Any, ids: torch.Tensor, packed_seq_params: Any = None) -> torch.Tensor:
    """Final hidden states [s, b, H] (after the final RMSNorm) for ids [b, s]."""
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    emb = gpt.embedding(input_ids=ids, position_ids=pos)
    h = gpt.decoder(hidden_states=emb, attention_mask=None, packed_seq_params=packed_seq_params)
    if getattr(gpt.config, "sequence_parallel", False):
        h = _gather_sequence(h)
    return h


def _packed_params(cu: torch.Tensor) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    max_len = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def _check_cu(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [B + 1]")
    cu = cu_seqlens.to(torch.int32)
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at {total}; got {cu.tolist()}"
        )
    return cu


def _logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    return_entropy: bool,
):
    return ops.linear_logp(hidden, weight, targets, temperature, return_entropy=return_entropy)


def _packed_logprobs(gpt, ids, cu, weight, temperature, return_entropy):
    """ids [T], cu [B+1] -> logp [T-1] (entries whose target starts a sequence are 0)."""
    t = ids.shape[0]
    h = _hidden(gpt, ids.unsqueeze(0), _packed_params(cu))  # [T, 1, H]
    h = h.reshape(t, -1)
    res = _logp(h[:-1], weight, ids[1:], temperature, return_entropy)
    keep = packed_keep(cu, t, ids.device)
    if return_entropy:
        return tuple(masked(r, keep) for r in res)
    return masked(res, keep)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_entropy: bool = False,
    vocab_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``input_ids[:, 1:]`` under the model at ``temperature``, via ``linear_logp``.

    Vocabulary padding: the log-softmax runs over the true vocabulary only (the LM-head rows
    ``[:vocab_size]``), as the rollout engine's truncated logits do; Megatron's padded rows never
    take probability mass, and a target id in the padding raises.

    The [tokens, vocab] logits are never materialised. Differentiable (backward through
    ``linear_logp`` and the rl_engine layers). The model must be built with the rl_engine spec
    (:func:`~rl_engine.adapters.megatron.from_pretrained`, :func:`get_gpt_block_rl_spec`) or
    converted with :func:`~rl_engine.adapters.megatron.replace_modules`.

    Layouts:

    * padded batch: ``input_ids`` [B, T], optional ``attention_mask`` [B, T] (1 = token). Right
      padding runs as one [T, B] batch (causal attention keeps padding out of real tokens);
      any other padding (e.g. left) is unpadded into packed sequences first. Returns [B, T-1];
      entries whose target is padding are 0.
    * packed: ``input_ids`` [T] or [1, T] and ``cu_seqlens`` [B+1] (int); returns [T-1]
      (or [1, T-1]); entry j is the log-prob of token j+1 given the tokens of its own sequence
      before it, and is 0 where token j+1 starts a new sequence.

    Args:
        model: a ``GPTModel`` (or a DDP / Float16Module wrapper), PP = CP = 1; at TP > 1 the
            vocab-parallel LM head is all-gathered and every rank returns the same log-probs.
        input_ids: int64 token ids.
        temperature: the rollout's sampling temperature (logits are divided by it).
        attention_mask: padding mask of the padded layout.
        cu_seqlens: sequence boundaries of the packed layout.
        return_entropy: also return the entropy at each position (same shape).
        vocab_size: the true (unpadded) vocabulary size (the checkpoint's ``vocab_size``);
            default: the size recorded on the model (see :func:`true_vocab_size`); it is an
            error when neither is known.

    Returns:
        fp32 log-probs (and entropies).
    """
    gpt = unwrap_gpt(model)
    weight = _output_weight(gpt, vocab_size)
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be int64/int32, got {input_ids.dtype}")
    input_ids = input_ids.long()
    check_input_ids(input_ids, weight.shape[0])
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass either cu_seqlens (packed) or attention_mask (padded), not both")
        flat = input_ids.reshape(-1)
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(
                f"packed input_ids must be [T] or [1, T], got {tuple(input_ids.shape)}"
            )
        cu = _check_cu(cu_seqlens.to(flat.device), flat.shape[0])
        res = _packed_logprobs(gpt, flat, cu, weight, temperature, return_entropy)
        if input_ids.dim() == 2:
            res = tuple(r.unsqueeze(0) for r in res) if return_entropy else res.unsqueeze(0)
        return res
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T] (or pass cu_seqlens), got {input_ids.shape}")
    b, t = input_ids.shape
    if t < 2:
        raise ValueError("input_ids needs at least 2 tokens per row")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        mask = attention_mask.to(torch.bool)
        lens = mask.sum(1)
        right = torch.arange(t, device=mask.device)[None, :] < lens[:, None]
        if not torch.equal(mask, right):
            return _unpadded_logprobs(gpt, input_ids, mask, weight, temperature, return_entropy)
    h = _hidden(gpt, input_ids)  # [T, B, H]
    h = h.transpose(0, 1)[:, :-1].reshape(b * (t - 1), -1)
    res = _logp(h, weight, input_ids[:, 1:].reshape(-1), temperature, return_entropy)
    res = tuple(r.view(b, t - 1) for r in res) if return_entropy else res.view(b, t - 1)
    if attention_mask is not None:
        keep = attention_mask[:, 1:].to(torch.bool)
        res = tuple(masked(r, keep) for r in res) if return_entropy else masked(res, keep)
    return res


def _unpadded_logprobs(gpt, input_ids, mask, weight, temperature, return_entropy):
    """Any padding: pack the real tokens, run packed, scatter back to [B, T-1]."""
    b, t = input_ids.shape
    lens = mask.sum(1)
    cu = torch.zeros(b + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    flat = input_ids[mask]
    res = _packed_logprobs(gpt, flat, cu, weight, temperature, return_entropy)
    outs = res if return_entropy else (res,)
    # target (b, j) with j >= 1 real and its predecessor real <-> packed entry (flat index - 1)
    flat_index = torch.cumsum(mask.reshape(-1).long(), 0).view(b, t) - 1
    tgt_ok = mask[:, 1:] & mask[:, :-1]
    src = (flat_index[:, 1:] - 1).clamp(min=0)
    scattered = []
    for r in outs:
        full = torch.cat([r, r.new_zeros(1)])
        vals = full[src.reshape(-1)].view(b, t - 1)
        scattered.append(masked(vals, tgt_ok))
    return tuple(scattered) if return_entropy else scattered[0]
