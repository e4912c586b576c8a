"""``attention``: batch-invariant varlen prefill, paged prefill/decode and KV-cache writes.

One numerics contract, three entry points, all resolved through the registry's ``attention``
op type (so a process uses one provider family for all three):

* :func:`attention` - varlen (packed) causal prefill, with a deterministic backward;
* :func:`paged_attention` - any number of query tokens per sequence against a paged KV cache;
* :func:`write_kv_cache` - exact copy of new keys/values into the cache.

Custom ops: ``rl_engine::attention(q, k, v, cu_seqlens, scale, causal, provider) -> (out, lse)``,
``rl_engine::attention_bwd(dout, q, k, v, out, lse, cu_seqlens, scale, causal, provider)``,
``rl_engine::paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
provider)`` and ``rl_engine::write_kv_cache(k, v, k_cache, v_cache, slot_mapping, provider)``
(mutates the caches). See :mod:`rl_engine.ops.attention.reference` for the math.
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.attention import reference
from rl_engine.registry import resolve_provider

__all__ = ["attention", "paged_attention", "write_kv_cache"]

_OP = "attention"
# the references take scale=None (1 / sqrt(head_dim)); the ops get the value the entry resolved
_RESOLVED_SCALE = {"scale": "float"}


# ----------------------------------------------------------------------------- attention
def _attention_fake(q, k, v, cu_seqlens, scale, causal):
    reference._check_attention(q, k, v, cu_seqlens, scale, causal)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


_attention_op = provider_op(
    _OP, "attention", reference.attention, _attention_fake, arg_types=_RESOLVED_SCALE
)


def _attention_bwd_fake(dout, q, k, v, out, lse, cu_seqlens, scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_attention_bwd_op = provider_op(
    _OP, "attention_bwd", reference.attention_bwd, _attention_bwd_fake, "attention_bwd"
)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, causal, provider = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.scale, ctx.causal, ctx.provider = scale, causal, provider
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(
        dout.to(q.dtype), q, k, v, out, lse, cu_seqlens, ctx.scale, ctx.causal, ctx.provider
    )
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _run(q, k, v, cu_seqlens, scale, causal, provider: str) -> torch.Tensor:
    """The op through ``provider`` on :func:`attention`'s arguments (checked here, once)."""
    reference._check_attention(q, k, v, cu_seqlens, scale, causal)
    scale = reference.default_scale(q.shape[2], scale)
    return _attention_op(q, k, v, cu_seqlens, scale, causal, provider)[0]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Batch-invariant varlen prefill attention (differentiable).

    Args:
        q: [T, Hq, D] query tokens of B packed sequences (fp32 / bf16 / fp16).
        k: [T, Hkv, D] keys (same dtype); Hq % Hkv == 0 (GQA / MQA).
        v: [T, Hkv, D] values.
        cu_seqlens: [B + 1] int32 offsets of the sequences in the packed tokens (int64, as
            many data pipelines build them, is converted: one small copy).
        scale: softmax scale, ``None`` = ``1 / sqrt(D)``.
        causal: causal mask inside each sequence (default).
        backend: provider name to pin for this call.

    Returns:
        [T, Hq, D] in ``q.dtype``; bitwise equal, row by row, to :func:`paged_attention` of the
        same tokens in any chunking / batch (same provider). See
        :func:`rl_engine.ops.attention.reference.attention` for the contract.
    """
    check_tensor("q", q)  # the full check runs once, in _run
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype == torch.int64:
        if cu_seqlens.numel() and q.shape[0] > torch.iinfo(torch.int32).max:
            raise ValueError("attention: more packed tokens than int32 offsets can address")
        cu_seqlens = cu_seqlens.to(torch.int32)
    provider = resolve_provider(_OP, q.device.type, backend)
    return _run(q, k, v, cu_seqlens, scale, causal, provider)


# ----------------------------------------------------------------------------- paged
def _paged_attention_fake(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale):
    reference._check_paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    return q.new_empty(q.shape)


_paged_attention_op = provider_op(
    _OP,
    "paged_attention",
    reference.paged_attention,
    _paged_attention_fake,
    "paged_attention",
    arg_types=_RESOLVED_SCALE,
)


def _paged_backward(ctx, grad):
    raise NotImplementedError(
        "paged_attention has no backward (it serves inference); train through attention()"
    )


def _paged_setup_context(ctx, inputs, output):
    pass


_paged_attention_op.register_autograd(_paged_backward, setup_context=_paged_setup_context)


def _paged_attention_out_fake(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out
):
    return None


_paged_attention_out_op = provider_op(
    _OP,
    "paged_attention_out",
    reference.paged_attention_out,
    _paged_attention_out_fake,
    "paged_attention_out",
    mutates_args=("out",),
    arg_types=_RESOLVED_SCALE,
)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-invariant causal attention against a paged KV cache (prefill chunks and decode).

    Args:
        q: [T, Hq, D] query tokens of B sequences, packed.
        k_cache: [num_blocks, block_size, Hkv, D] (same dtype as ``q``).
        v_cache: [num_blocks, block_size, Hkv, D].
        block_table: [B, max_blocks] int32 block ids of each sequence.
        seq_lens: [B] int32 context lengths including this step's query tokens.
        query_start_loc: [B + 1] int32 offsets of the sequences' query tokens in ``q``; tokens
            after ``query_start_loc[B]`` are padding (CUDA-graph batches): output zero.
        scale: softmax scale, ``None`` = ``1 / sqrt(D)``.
        backend: provider name to pin for this call.
        out: optional [T, Hq, D] destination (``q``'s dtype and device, unit stride on D;
            e.g. a view of an engine's preallocated output): the rows of the sequences'
            tokens are written in place (the same bits as the returned tensor), padding rows
            after ``query_start_loc[B]`` are left as they are; no gradient.

    Returns:
        [T, Hq, D] in ``q.dtype`` (``out`` when given); each token's row is bitwise equal to its
        row in a full :func:`attention` prefill of its sequence (same provider), whatever the
        chunking, the page size and the other sequences of the batch.
    """
    reference._check_paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    provider = resolve_provider(_OP, q.device.type, backend)
    scale = reference.default_scale(q.shape[2], scale)
    if out is not None:
        reference.check_out(q, out)
        _paged_attention_out_op(
            q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out, provider
        )
        return out
    return _paged_attention_op(
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, provider
    )


# ----------------------------------------------------------------------------- cache write
def _write_kv_cache_fake(k, v, k_cache, v_cache, slot_mapping):
    reference._check_write(k, v, k_cache, v_cache, slot_mapping)


_write_kv_cache_op = provider_op(
    _OP,
    "write_kv_cache",
    reference.write_kv_cache,
    _write_kv_cache_fake,
    "write_kv_cache",
    mutates_args=("k_cache", "v_cache"),
)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write ``k`` / ``v`` [T, Hkv, D] into the paged caches at flat slots, in place.

    Args:
        k: [T, Hkv, D] keys. v: [T, Hkv, D] values (same dtype as the caches).
        k_cache: [num_blocks, block_size, Hkv, D], written in place. v_cache: likewise.
        slot_mapping: [T] int32 / int64, ``block * block_size + offset``; ``-1`` skips a token.
        backend: provider name to pin for this call.
    """
    reference._check_write(k, v, k_cache, v_cache, slot_mapping)
    provider = resolve_provider(_OP, k.device.type, backend)
    _write_kv_cache_op(k, v, k_cache, v_cache, slot_mapping, provider)


# ----------------------------------------------------------------------------- registration
register_op(
    _OP,
    entry=registry_entry(attention, _run),
    native=(f"attention/native-t{reference.KV_TILE}", reference),
    extras={
        n: n for n in ("attention_bwd", "paged_attention", "paged_attention_out", "write_kv_cache")
    },
)

# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__, "SPLIT_PROVIDER")
