"""PyTorch reference of ``attention`` / ``paged_attention`` / ``write_kv_cache`` (``native``).

This file is the spec of the op family. Numerics (family ``attention/native-t64``), for every
query token at absolute position ``p`` of its sequence and every query head ``h`` (KV head
``h // (Hq // Hkv)``):

* the keys/values are visited in tiles of ``KV_TILE = 64`` positions **aligned to absolute
  position 0** (tile ``j`` = positions ``[64 j, 64 j + 64)``), in increasing ``j``, for
  ``j = 0 .. p // 64`` (causal). The tile size does not depend on the page size, the number of
  query tokens, the chunking of a prefill or the batch;
* per tile, in fp32: ``s = tree_sum(q * k over D) * scale``; masked positions (after ``p``, or
  past the context) get ``s = -inf``; ``m' = max(m, max_t s)``;
  ``alpha = 1 if m' == m else exp(m - m')``; ``P = exp(s - m')`` (exact ``0`` when masked);
  ``l = l * alpha + tree_sum(P over the tile)``;
  ``acc = acc * alpha + tree_sum(P * v over the tile)`` (masked products are exact ``+0``);
* ``out = (acc / l).to(q.dtype)``, ``lse = m + log(l)`` (fp32).

``tree_sum`` is the fixed pairwise sum of :mod:`rl_engine.ops._common`; ``exp`` / ``log`` come from
:mod:`rl_engine.ops._math`. A tile that is fully masked for a row is an exact no-op for that row
(``alpha = 1``, ``P = 0``), so visiting more tiles (a prefill block whose last row sits further
on) cannot change a row. Both entry points run :func:`_attend`, one function, over the same
tiles; only the way a tile's keys and values are fetched differs (a slice of the packed
tensors or a gather through the block table). Hence, bitwise, for every query token: full
prefill == chunked prefill (any chunk size) == decode against a paged cache (any page size) ==
any batch composition.

Backward (``attention`` only), fixed order, no atomics: per sequence, KV tiles in order, and for
each tile the query tokens in chunks of ``Q_TILE = 64`` in order. Per (tile, chunk):
``P = exp(s - lse)``, ``dP = tree_sum(dO * v)``, ``dS = P * (dP - delta)`` with
``delta = tree_sum(dO * O)``; ``dV_tile += tree_sum_tokens(tree_sum_group(P * dO))``,
``dK_tile += tree_sum_tokens(tree_sum_group(dS * q))`` (the ``Hq // Hkv`` query heads of a KV
head pairwise first, then the chunk's tokens pairwise), ``dQ_rows += tree_sum_tile(dS * k)``;
finally ``dQ *= scale``, ``dK *= scale``. dQ of a row depends on that row and its sequence's keys
and values only (row invariant); dK / dV are deterministic (bitwise run to run).
"""

from __future__ import annotations

import math

import torch

from rl_engine.ops import _math
from rl_engine.ops._common import (
    check_float,
    check_same_device,
    check_same_dtype,
    check_tensor,
    check_tensors,
    tree_sum,
)

KV_TILE = 64  # keys/values per tile, aligned to absolute position 0 (part of the numerics)
Q_TILE = 64  # query tokens per backward chunk (part of the dK / dV reduction order)
_Q_ROWS = 64  # query tokens per forward work chunk (memory only: rows never interact)
MAX_HEAD_DIM = 512  # native limit (memory of the per-tile products)
_INDEX_DTYPES = (torch.int32,)
_SLOT_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- validation
def _check_index(name: str, t: object, dims: int, dtypes=_INDEX_DTYPES) -> None:
    check_tensor(name, t, dims=dims)
    if t.dtype not in dtypes:  # type: ignore[union-attr]
        raise TypeError(
            f"{name}: dtype {t.dtype} is not supported; expected one of {list(dtypes)}"  # type: ignore[union-attr]
        )


def _check_heads(q: torch.Tensor, hkv: int, d: int, what: str) -> None:
    hq, dq = q.shape[1], q.shape[2]
    if dq != d:
        raise ValueError(f"{what}: q has head_dim {dq}, keys/values have head_dim {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{what}: {hq} query heads are not a multiple of {hkv} key/value heads (GQA/MQA "
            "needs Hq % Hkv == 0)"
        )
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{what}: head_dim {d} is not supported (1..{MAX_HEAD_DIM})")


def _check_scale(scale: float | None) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale}")


def _check_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    causal: bool,
) -> None:
    """Shape / dtype / device checks of ``attention`` (no data-dependent checks: no sync)."""
    check_tensors(3, q=q, k=k, v=v)
    check_float("q", q)
    check_same_dtype(q=q, k=k, v=v)
    _check_index("cu_seqlens", cu_seqlens, 1)
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"attention: q has {q.shape[0]} tokens, k/v have {k.shape[0]}; the varlen prefill "
            "packs the same tokens (use paged_attention for a query against a longer context)"
        )
    _check_heads(q, k.shape[1], k.shape[2], "attention")
    if cu_seqlens.shape[0] < 1:
        raise ValueError("attention: cu_seqlens must hold at least one offset ([B + 1])")
    _check_scale(scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


def _check_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
) -> None:
    """Shape / dtype / device checks of ``paged_attention`` (no data-dependent checks)."""
    check_tensor("q", q, dims=3)
    check_tensors(4, k_cache=k_cache, v_cache=v_cache)
    check_float("q", q)
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    _check_index("block_table", block_table, 2)
    _check_index("seq_lens", seq_lens, 1)
    _check_index("query_start_loc", query_start_loc, 1)
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} differ in shape"
        )
    _check_heads(q, k_cache.shape[2], k_cache.shape[3], "paged_attention")
    b = seq_lens.shape[0]
    if block_table.shape[0] != b or query_start_loc.shape[0] != b + 1:
        raise ValueError(
            f"paged_attention: {b} sequences in seq_lens, but block_table has "
            f"{block_table.shape[0]} rows and query_start_loc {query_start_loc.shape[0]} "
            "offsets (expected B and B + 1)"
        )
    if k_cache.shape[1] < 1:
        raise ValueError("paged_attention: block_size must be at least 1")
    _check_scale(scale)


def check_out(q: torch.Tensor, out: torch.Tensor) -> None:
    """``paged_attention``'s ``out``: q's shape, dtype and device, a unit stride on head_dim."""
    check_tensor("out", out, dims=3)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"paged_attention: out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}); got "
            f"{tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("paged_attention: out needs a unit stride on head_dim")


def _check_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_tensors(3, k=k, v=v)
    check_tensors(4, k_cache=k_cache, v_cache=v_cache)
    check_float("k", k)
    check_same_dtype(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    _check_index("slot_mapping", slot_mapping, 1, _SLOT_DTYPES)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k.shape != v.shape or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"write_kv_cache: k {tuple(k.shape)} / v {tuple(v.shape)} or k_cache "
            f"{tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"write_kv_cache: k has [heads, head_dim] {list(k.shape[1:])}, the cache "
            f"{list(k_cache.shape[2:])}"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"write_kv_cache: slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens"
        )


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale`` or, when ``None``, ``1 / sqrt(head_dim)``."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def _offsets(name: str, t: torch.Tensor, total: int, *, padded: bool = False) -> list[int]:
    """Host copy of a [B + 1] offsets tensor, checked to be 0 .. total and non-decreasing
    (``padded``: may end before ``total``; the tokens after it are padding)."""
    off = t.tolist()
    end_ok = off[-1] <= total if padded else off[-1] == total
    if off[0] != 0 or not end_ok or any(b < a for a, b in zip(off, off[1:])):
        end = f"at most {total}" if padded else f"at the number of tokens ({total})"
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end {end}; got "
            f"{off if len(off) <= 8 else off[:4] + ['...'] + off[-2:]}"
        )
    return off


# ----------------------------------------------------------------------------- the core
def _head_map(hq: int, hkv: int, device: torch.device) -> torch.Tensor:
    return torch.arange(hq, device=device) // (hq // hkv)


def _scores(q32: torch.Tensor, k_t: torch.Tensor, head_map: torch.Tensor, scale: float):
    """fp32 ``s[n, h, t] = tree_sum_d(q[n, h, d] * k[t, h // G, d]) * scale``."""
    kh = k_t.index_select(1, head_map).permute(1, 0, 2)  # [Hq, T, D]
    return tree_sum(q32[:, :, None, :] * kh[None], dim=-1) * scale


def _tile_mask(q_pos: torch.Tensor, j: int, kv_len: int, causal: bool) -> torch.Tensor:
    """[n, 1, T] bool: key position visible to each query row."""
    kv_pos = j * KV_TILE + torch.arange(KV_TILE, device=q_pos.device)
    mask = (kv_pos < kv_len)[None, :].expand(q_pos.shape[0], KV_TILE)
    if causal:
        mask = mask & (kv_pos[None, :] <= q_pos[:, None])
    return mask[:, None, :]


def _attend(q32, q_pos, kv_len, load_tile, head_map, scale, causal):
    """Online-softmax attention of query rows over KV tiles ``0 .. n_tiles - 1``.

    Args:
        q32: [n, Hq, D] fp32 query rows of one sequence.
        q_pos: [n] int64 absolute positions of the rows.
        kv_len: number of keys/values of the sequence (positions ``0 .. kv_len - 1``).
        load_tile: ``j -> (k, v)``, fp32 [KV_TILE, Hkv, D] of positions ``64 j ..``, zero past
            ``kv_len``.
        head_map: [Hq] int64 KV head of each query head.
        scale: softmax scale.
        causal: mask keys after the row's position.

    Returns:
        ``(out, lse)``: fp32 [n, Hq, D] and [n, Hq].
    """
    n, hq, d = q32.shape
    last = int(q_pos.max().item()) if causal else kv_len - 1
    n_tiles = min(last, kv_len - 1) // KV_TILE + 1
    m = torch.full((n, hq), -math.inf, dtype=torch.float32, device=q32.device)
    l_sum = torch.zeros((n, hq), dtype=torch.float32, device=q32.device)
    acc = torch.zeros((n, hq, d), dtype=torch.float32, device=q32.device)
    for j in range(n_tiles):
        k_t, v_t = load_tile(j)
        mask = _tile_mask(q_pos, j, kv_len, causal)  # [n, 1, T]
        s = torch.where(mask, _scores(q32, k_t, head_map, scale), -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.where(m_new == m, 1.0, _math.exp(m - m_new))
        p = torch.where(mask, _math.exp(s - m_new[..., None]), 0.0)  # [n, Hq, T]
        l_sum = l_sum * alpha + tree_sum(p, dim=-1)
        vh = v_t.index_select(1, head_map).permute(1, 0, 2)  # [Hq, T, D]
        pv = torch.where(mask[..., None], p[..., None] * vh[None], 0.0)  # [n, Hq, T, D]
        acc = acc * alpha[..., None] + tree_sum(pv, dim=2)
        m = m_new
    out = acc / l_sum[..., None]
    lse = m + _math.log(l_sum)
    return out, lse


def _attend_chunked(q32, q_pos, kv_len, load_tile, head_map, scale, causal, out, lse, rows0):
    """:func:`_attend` over work chunks of ``_Q_ROWS`` rows (memory only; rows never mix)."""
    n = q32.shape[0]
    for r0 in range(0, n, _Q_ROWS):
        r1 = min(n, r0 + _Q_ROWS)
        o, s = _attend(q32[r0:r1], q_pos[r0:r1], kv_len, load_tile, head_map, scale, causal)
        out[rows0 + r0 : rows0 + r1] = o.to(out.dtype)
        lse[rows0 + r0 : rows0 + r1] = s


def _contiguous_tiles(k: torch.Tensor, v: torch.Tensor, start: int, kv_len: int):
    """``load_tile`` over packed k/v rows ``start .. start + kv_len - 1``."""

    def load(j: int):
        a = j * KV_TILE
        b = min(kv_len, a + KV_TILE)
        k_t = k[start + a : start + b].float()
        v_t = v[start + a : start + b].float()
        if b - a < KV_TILE:
            pad = k_t.new_zeros((KV_TILE - (b - a),) + tuple(k_t.shape[1:]))
            k_t = torch.cat([k_t, pad])
            v_t = torch.cat([v_t, pad])
        return k_t, v_t

    return load


def _paged_tiles(k_cache, v_cache, blocks: torch.Tensor, kv_len: int):
    """``load_tile`` through one sequence's block table row (positions ``>= kv_len`` -> 0)."""
    bs = k_cache.shape[1]

    def load(j: int):
        pos = j * KV_TILE + torch.arange(KV_TILE, device=blocks.device)
        valid = pos < kv_len
        page = torch.where(valid, pos // bs, 0)
        blk = torch.where(valid, blocks[page].long(), 0)
        off = torch.where(valid, pos % bs, 0)
        keep = valid[:, None, None]
        k_t = torch.where(keep, k_cache[blk, off].float(), 0.0)
        v_t = torch.where(keep, v_cache[blk, off].float(), 0.0)
        return k_t, v_t

    return load


# ----------------------------------------------------------------------------- entry points
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen (packed) prefill attention; returns the output and the log-sum-exp.

    Equivalent to, for each sequence ``b`` (tokens ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``),
    ``softmax(q_b @ k_b.T * scale + causal_mask) @ v_b`` per query head (KV heads repeated
    ``Hq // Hkv`` times, GQA/MQA), computed in fp32 in the tile order of the module docstring.

    Args:
        q: [T, Hq, D] float32 / bfloat16 / float16 query tokens of B packed sequences.
        k: [T, Hkv, D] keys, same dtype; Hq % Hkv == 0.
        v: [T, Hkv, D] values.
        cu_seqlens: [B + 1] int32 offsets (0, ..., T).
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        causal: mask keys after each query token (``False``: bidirectional in a sequence).

    Returns:
        ``(out, lse)``: [T, Hq, D] in ``q.dtype`` and fp32 [T, Hq] (natural-log sum-exp of the
        scaled scores).
    """
    _check_attention(q, k, v, cu_seqlens, scale, causal)
    t, hq, d = q.shape
    scale = default_scale(d, scale)
    off = _offsets("cu_seqlens", cu_seqlens, t)
    out = torch.empty_like(q)
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    head_map = _head_map(hq, k.shape[1], q.device)
    for s0, s1 in zip(off, off[1:]):
        n = s1 - s0
        if n == 0:
            continue
        q_pos = torch.arange(n, device=q.device)
        load = _contiguous_tiles(k, v, s0, n)
        _attend_chunked(q[s0:s1].float(), q_pos, n, load, head_map, scale, causal, out, lse, s0)
    return out, lse


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed query tokens against a paged KV cache.

    Equivalent to :func:`attention` rows: the query tokens of sequence ``b`` are its last
    ``q_len = query_start_loc[b + 1] - query_start_loc[b]`` positions of a context of
    ``seq_lens[b]`` tokens (prefill chunk, decode step or both in one batch), and each attends
    to the context positions up to its own, fetched as
    ``k_cache[block_table[b, pos // block_size], pos % block_size]``. Bitwise equal to the
    ``attention`` output of the same tokens (same tiles, same order).

    Args:
        q: [T, Hq, D] query tokens of B sequences, packed.
        k_cache: [num_blocks, block_size, Hkv, D], same dtype as ``q``.
        v_cache: [num_blocks, block_size, Hkv, D].
        block_table: [B, max_blocks] int32.
        seq_lens: [B] int32 context lengths including this step's query tokens.
        query_start_loc: [B + 1] int32 offsets of each sequence's query tokens in ``q``;
            tokens after ``query_start_loc[B]`` are padding (output zero).
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.

    Returns:
        [T, Hq, D] in ``q.dtype``.
    """
    _check_paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    t, hq, d = q.shape
    scale = default_scale(d, scale)
    off = _offsets("query_start_loc", query_start_loc, t, padded=True)
    lens = seq_lens.tolist()
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    out = torch.zeros_like(q)  # padding tokens after query_start_loc[-1] stay zero
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    head_map = _head_map(hq, k_cache.shape[2], q.device)
    for b, (s0, s1) in enumerate(zip(off, off[1:])):
        n, kv_len = s1 - s0, lens[b]
        if n == 0:
            continue
        if kv_len < n:
            raise ValueError(
                f"paged_attention: sequence {b} has {n} query tokens but seq_lens {kv_len} "
                "(the context includes this step's tokens)"
            )
        pages = -(-kv_len // bs)
        if pages > block_table.shape[1]:
            raise ValueError(
                f"paged_attention: sequence {b} needs {pages} blocks of {bs}, block_table has "
                f"{block_table.shape[1]} columns"
            )
        blocks = block_table[b, :pages]
        if pages and (int(blocks.min()) < 0 or int(blocks.max()) >= nb):
            raise ValueError(
                f"paged_attention: sequence {b} uses block ids outside 0..{nb - 1}: "
                f"{blocks.tolist()}"
            )
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
        load = _paged_tiles(k_cache, v_cache, blocks, kv_len)
        _attend_chunked(q[s0:s1].float(), q_pos, kv_len, load, head_map, scale, True, out, lse, s0)
    return out


def check_slots(slot_mapping: torch.Tensor, num_slots: int, *, on_device: bool) -> None:
    """Every slot -1 (skip) or in ``[0, num_slots)``. CPU tensors: checked at once
    (``ValueError``). Accelerator tensors: a device-side assert when ``on_device`` or
    ``RL_ENGINE_DEVICE_CHECKS=1`` (a host check would synchronise the stream), else nothing."""
    from rl_engine import config

    if slot_mapping.numel() == 0:
        return
    ok = (slot_mapping >= -1) & (slot_mapping < num_slots)
    msg = f"write_kv_cache: slots must be -1 (skip) or in 0..{num_slots - 1}"
    if slot_mapping.device.type == "cpu":
        if not bool(ok.all()):
            raise ValueError(
                f"{msg}; got min {int(slot_mapping.min())}, max {int(slot_mapping.max())}"
            )
    elif on_device or config.settings().device_checks:
        torch._assert_async(ok.all(), msg)


def paged_attention_out(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    out: torch.Tensor,
) -> None:
    """:func:`paged_attention` written into ``out``: the rows of the sequences' tokens (padding
    rows after ``query_start_loc[B]`` untouched; the offsets are read on the host)."""
    res = paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    n = int(query_start_loc[-1])
    out[:n].copy_(res[:n])


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy ``k`` / ``v`` [T, Hkv, D] into the caches at flat slots, in place.

    Slot ``s`` is ``block * block_size + offset``; ``-1`` skips the token (padding). The copy is
    exact (same dtype, no conversion).

    Args:
        k: [T, Hkv, D] keys. v: [T, Hkv, D] values (same dtype as the caches).
        k_cache: [num_blocks, block_size, Hkv, D], written in place. v_cache: likewise.
        slot_mapping: [T] int32 / int64 flat slots, ``-1`` = skip.
    """
    _check_write(k, v, k_cache, v_cache, slot_mapping)
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    check_slots(slot_mapping, nb * bs, on_device=True)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    k_cache[slots // bs, slots % bs] = k[keep]
    v_cache[slots // bs, slots % bs] = v[keep]


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention` (deterministic, order in the docstring).

    Args:
        dout: [T, Hq, D] gradient of the output. q, k, v, cu_seqlens, scale, causal: as in the
            forward. out: [T, Hq, D] forward output. lse: [T, Hq] fp32 forward log-sum-exp.

    Returns:
        ``(dq, dk, dv)`` in the dtypes / shapes of ``q``, ``k``, ``v``.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    off = _offsets("cu_seqlens", cu_seqlens, t)
    head_map = _head_map(hq, hkv, q.device)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)

    def group_token_sum(x: torch.Tensor) -> torch.Tensor:  # [n, Hq, T, D] -> [T, Hkv, D]
        n = x.shape[0]
        x = tree_sum(x.reshape(n, hkv, g, KV_TILE, d), dim=2)  # heads of a group first
        return tree_sum(x, dim=0).permute(1, 0, 2)  # then the chunk's tokens

    for s0, s1 in zip(off, off[1:]):
        n = s1 - s0
        if n == 0:
            continue
        q32 = q[s0:s1].float()
        do32 = dout[s0:s1].float()
        lse_s = lse[s0:s1].float()
        delta = tree_sum(do32 * out[s0:s1].float(), dim=-1)  # [n, Hq]
        q_pos = torch.arange(n, device=q.device)
        dq_acc = torch.zeros((n, hq, d), dtype=torch.float32, device=q.device)
        load = _contiguous_tiles(k, v, s0, n)
        for j in range((n - 1) // KV_TILE + 1):
            k_t, v_t = load(j)
            kh = k_t.index_select(1, head_map).permute(1, 0, 2)  # [Hq, T, D]
            vh = v_t.index_select(1, head_map).permute(1, 0, 2)
            dk_t = torch.zeros((KV_TILE, hkv, d), dtype=torch.float32, device=q.device)
            dv_t = torch.zeros_like(dk_t)
            first = (j * KV_TILE) // Q_TILE * Q_TILE if causal else 0
            for r0 in range(first, n, Q_TILE):
                r1 = min(n, r0 + Q_TILE)
                mask = _tile_mask(q_pos[r0:r1], j, n, causal)  # [c, 1, T]
                s = torch.where(mask, _scores(q32[r0:r1], k_t, head_map, scale), -math.inf)
                p = torch.where(mask, _math.exp(s - lse_s[r0:r1, :, None]), 0.0)  # [c, Hq, T]
                dov = do32[r0:r1, :, None, :]
                dv_t = dv_t + group_token_sum(p[..., None] * dov)
                dp = tree_sum(dov * vh[None], dim=-1)  # [c, Hq, T]
                ds = torch.where(mask, p * (dp - delta[r0:r1, :, None]), 0.0)
                dk_t = dk_t + group_token_sum(ds[..., None] * q32[r0:r1, :, None, :])
                dq_acc[r0:r1] = dq_acc[r0:r1] + tree_sum(ds[..., None] * kh[None], dim=2)
            a = j * KV_TILE
            b = min(n, a + KV_TILE)
            dk[s0 + a : s0 + b] = (dk_t[: b - a] * scale).to(k.dtype)
            dv[s0 + a : s0 + b] = dv_t[: b - a].to(v.dtype)
        dq[s0:s1] = (dq_acc * scale).to(q.dtype)
    return dq, dk, dv
