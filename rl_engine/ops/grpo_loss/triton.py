"""``triton`` provider of ``grpo_loss``: forward (loss + metrics) and backward in Triton.

Numerics (family ``grpo_loss/triton``), three levels, each in a fixed order:

1. **Per token** (fp32, one pass over a ``BLOCK_T`` tile in :func:`_grpo_token_kernel`, the
   forward's and the backward's, so both see the same bits): clamped log-ratio, ratio (``exp``
   of :mod:`rl_engine.ops.ratio_kl.triton`), clipped / dual-clipped surrogate, IS weight, k3 KL.
   Masked tokens read every input as 0 (NaN padding is harmless).
2. **Per sequence**: each tile reduces every per-token statistic with a fixed pairwise tree over
   its ``BLOCK_T`` lanes (:func:`~rl_engine.ops.ratio_kl.triton._tree_sum`; independent of the
   register layout the compiler picks) and writes the partials to memory; a sequence's value is
   the sum of its tile partials in tile order. For GSPO (``ratio_type="sequence"``) a pre-pass
   computes the sequence mean log-ratio the same way before the token pass.
3. **Global** (loss, metrics, the default denominator): one program walks the sequences in
   blocks of ``BLOCK_B`` (lane = sequence), reduces each block with the same pairwise tree and
   adds the block results sequentially in sequence order.

``BLOCK_T`` and ``BLOCK_B`` are constants, so every sum depends on token / sequence positions
only: appending masked tokens or fully-masked sequences adds exact zeros (loss, metrics and
gradients unchanged), the gradient of row b depends on row b alone once the denominator is fixed
(``loss_norm``), and nothing is atomic, so results are bitwise reproducible run to run.
``loss = pg_loss + kl_beta * kl_loss`` is formed from the metric scalars exactly as the
reference does. Not promised: bitwise identity with the ``native`` family, across GPU models or
Triton versions; on the CPU the kernels run in the Triton interpreter (a test vehicle).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops.grpo_loss import reference
from rl_engine.ops.grpo_loss.args import AGG_MODES, METRIC_NAMES, Options, check, per_seq_mean
from rl_engine.ops.ratio_kl import triton as _rk

triton = _rk.triton
tl = _rk.tl

__all__ = ["BLOCK_B", "BLOCK_T", "PROVIDER", "grpo_loss", "grpo_loss_backward"]

BLOCK_T = _rk.BLOCK_T
_LOG_BLOCK_T = BLOCK_T.bit_length() - 1
# Sequences per block of the global reduction (lanes of its pairwise tree): part of the family.
BLOCK_B = 128
_LOG_BLOCK_B = BLOCK_B.bit_length() - 1
_NUM_WARPS = 4
# Per-tile statistics written by the forward token pass (columns of the partials buffer).
_STATS = 16  # 13 used, padded to a power of two
_AGG_ID = {name: i for i, name in enumerate(AGG_MODES)}
_SEQ_MEAN = _AGG_ID["seq-mean-token-mean"]


if triton is not None:
    from rl_engine.ops.ratio_kl.triton import (  # the jit helpers both ops' kernels share
        _exp,
        _expm1,
        _k3,
        _load_tile,
        _log_ratio_tile,
        _seq_partials,
        _tree_sum,
        _tree_sum_rows,
    )

    @triton.jit
    def _grpo_token_kernel(
        grad_ptr,
        denom_ptr,
        lp_ptr,
        old_ptr,
        adv_ptr,
        m_ptr,
        ref_ptr,
        w_ptr,
        pre_ptr,
        out_ptr,
        B,
        T,
        NT,
        s_lb,
        s_lt,
        s_ob,
        s_ot,
        s_ab,
        s_at,
        s_mb,
        s_mt,
        s_rb,
        s_rt,
        s_wb,
        s_wt,
        clamp,
        r_lo,
        r_hi,
        dual_c,
        kl_beta,
        denom_const,
        SEQ_RATIO: tl.constexpr,
        HAS_DUAL: tl.constexpr,
        HAS_REF: tl.constexpr,
        HAS_W: tl.constexpr,
        BWD: tl.constexpr,
        KL_TERM: tl.constexpr,
        PER_SEQ_MEAN: tl.constexpr,
        DENOM_FROM_PTR: tl.constexpr,
        STATS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
    ):
        """The token pass, one (ROWS sequences, tile j) per program, on the same per-token terms
        both ways. Forward (``BWD`` off): each row's tile partials of the ``STATS`` statistics
        into ``out`` [B * NT, STATS]. Backward: ``d logp`` into ``out`` [B, T] from the upstream
        ``grad`` and the denominator (``denom`` or ``denom_const``); ``KL_TERM``,
        ``PER_SEQ_MEAN`` and ``DENOM_FROM_PTR`` apply to it only."""
        b, j, rows, inb, bb, tt, lp, m, raw = _log_ratio_tile(
            lp_ptr, old_ptr, m_ptr, B, T, s_lb, s_lt, s_ob, s_ot, s_mb, s_mt, True, ROWS, BLOCK
        )
        tok_lr = tl.clamp(raw, -clamp, clamp)
        adv = _load_tile(adv_ptr, bb, tt, s_ab, s_at, inb)
        ref = lp
        w = lp
        if HAS_REF:
            ref = _load_tile(ref_ptr, bb, tt, s_rb, s_rt, inb)
        if HAS_W:
            w = _load_tile(w_ptr, bb, tt, s_wb, s_wt, inb)
        seq_s = 0.0
        seq_n = 0.0
        if SEQ_RATIO or PER_SEQ_MEAN:
            # [ROWS, 1] x 2: the raw log-ratio sum and real-token count of the rows (pre-pass)
            seq_s, seq_n = _seq_partials(pre_ptr, b, rows, NT, ROWS)
            seq_s = seq_s[:, None]
            seq_n = seq_n[:, None]
        # the per-token terms, the same for the forward and the backward
        if SEQ_RATIO:  # GSPO-token: the sequence's value, d lr / d logp_t = 1
            s = seq_s / tl.maximum(seq_n, 1.0) + tl.zeros_like(raw)  # broadcast over the tile
            lr = tl.clamp(s, -clamp, clamp)
            inr = (s >= -clamp) & (s <= clamp)
        else:
            lr = tok_lr
            inr = (raw >= -clamp) & (raw <= clamp)
        r = _exp(lr)
        a = tl.where(m, adv, 0.0)
        pg1 = -a * r
        pg2 = -a * tl.clamp(r, r_lo, r_hi)
        clipped = pg2 > pg1
        pg = tl.where(clipped, pg2, pg1)
        if HAS_DUAL:
            pg3 = -a * dual_c
            dual = (a < 0) & (pg > pg3)
            pg = tl.where(dual, pg3, pg)
        else:
            dual = clipped & (a != a)  # all False
        dpg = tl.where(clipped | dual, 0.0, pg1)
        dpg = tl.where(inr, dpg, 0.0)
        if HAS_W:
            wz = tl.where(m, w, 0.0)
            pg = pg * wz
            dpg = dpg * wz
        if HAS_REF:
            d_raw = tl.where(m, ref, 0.0) - tl.where(m, lp, 0.0)
            d = tl.clamp(d_raw, -clamp, clamp)
            e = _exp(d)
            kl = _k3(d, e)
            dkl = tl.where((d_raw >= -clamp) & (d_raw <= clamp), -_expm1(d, e), 0.0)
        else:
            kl = tl.zeros_like(raw)
            dkl = tl.zeros_like(raw)
        if BWD:
            dterm = dpg
            if KL_TERM:
                dterm = dterm + kl_beta * dkl
            if DENOM_FROM_PTR:
                denom = tl.load(denom_ptr)
            else:
                denom = denom_const
            c = tl.where(m, 1.0, 0.0)
            if PER_SEQ_MEAN:
                c = c / tl.maximum(seq_n, 1.0)
            c = c / denom
            g = tl.load(grad_ptr)
            out = g * (c * dterm)
            tl.store(out_ptr + bb * T + tt, out.to(out_ptr.dtype.element_ty), mask=inb)
        else:
            if SEQ_RATIO:
                tok_e = _exp(tok_lr)
            else:
                tok_e = r
            one = tl.full((ROWS, BLOCK), 1.0, tl.float32)
            zero = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
            p = out_ptr + (b * NT + j) * STATS
            low = m & clipped & (r < 1.0)
            high = m & clipped & (r > 1.0)
            k3 = _k3(tok_lr, tok_e)
            k2 = tok_lr * tok_lr * 0.5
            tl.store(p + 0, _tree_sum_rows(tl.where(m, pg, 0.0), ROWS, BLOCK, LOG_BLOCK), mask=rows)
            tl.store(p + 1, _tree_sum_rows(tl.where(m, kl, 0.0), ROWS, BLOCK, LOG_BLOCK), mask=rows)
            clip_n = _tree_sum_rows(tl.where(m & clipped, one, zero), ROWS, BLOCK, LOG_BLOCK)
            tl.store(p + 2, clip_n, mask=rows)
            low_n = _tree_sum_rows(tl.where(low, one, zero), ROWS, BLOCK, LOG_BLOCK)
            tl.store(p + 3, low_n, mask=rows)
            high_n = _tree_sum_rows(tl.where(high, one, zero), ROWS, BLOCK, LOG_BLOCK)
            tl.store(p + 4, high_n, mask=rows)
            dual_n = _tree_sum_rows(tl.where(m & dual, one, zero), ROWS, BLOCK, LOG_BLOCK)
            tl.store(p + 5, dual_n, mask=rows)
            ppo_kl = _tree_sum_rows(tl.where(m, -tok_lr, 0.0), ROWS, BLOCK, LOG_BLOCK)
            tl.store(p + 6, ppo_kl, mask=rows)
            tl.store(p + 7, _tree_sum_rows(tl.where(m, k3, 0.0), ROWS, BLOCK, LOG_BLOCK), mask=rows)
            tl.store(p + 8, _tree_sum_rows(tl.where(m, k2, 0.0), ROWS, BLOCK, LOG_BLOCK), mask=rows)
            tl.store(p + 9, _tree_sum_rows(tl.where(m, r, 0.0), ROWS, BLOCK, LOG_BLOCK), mask=rows)
            n_tok = _tree_sum_rows(tl.where(m, one, zero), ROWS, BLOCK, LOG_BLOCK)
            tl.store(p + 10, n_tok, mask=rows)
            tl.store(p + 11, tl.min(tl.where(m, r, float("inf")), axis=1), mask=rows)
            tl.store(p + 12, tl.max(tl.where(m, r, -float("inf")), axis=1), mask=rows)

    @triton.jit
    def _grpo_reduce_kernel(
        part_ptr,
        out_ptr,
        B,
        NT,
        T_f,
        loss_norm,
        AGG: tl.constexpr,
        HAS_NORM: tl.constexpr,
        COUNTS_ONLY: tl.constexpr,
        STATS: tl.constexpr,
        BLOCK_B: tl.constexpr,
        LOG_BLOCK_B: tl.constexpr,
    ):
        # One program. Lane = sequence: its tile partials added in tile order; blocks of BLOCK_B
        # sequences reduced with the pairwise tree; block results added in sequence order.
        # COUNTS_ONLY: the partials are the pre-pass's (raw sum, count) pairs and only the
        # denominator D is written (backward).
        lanes = tl.arange(0, BLOCK_B).to(tl.int64)
        cols = tl.arange(0, STATS)
        acc = tl.zeros((STATS,), dtype=tl.float32)
        nseq = tl.zeros((), dtype=tl.float32)
        rmin = tl.full((), float("inf"), tl.float32)
        rmax = tl.full((), -float("inf"), tl.float32)
        for b0 in range(0, B, BLOCK_B):
            b = b0 + lanes
            inb = b < B
            s = tl.zeros((BLOCK_B, STATS), dtype=tl.float32)
            smin = tl.full((BLOCK_B, STATS), float("inf"), tl.float32)
            smax = tl.full((BLOCK_B, STATS), -float("inf"), tl.float32)
            ld = inb[:, None] & (cols[None, :] < STATS)
            for j in range(0, NT):
                ptrs = part_ptr + (b[:, None] * NT + j) * STATS + cols[None, :]
                x = tl.load(ptrs, mask=ld, other=0.0)
                s = s + x
                smin = tl.minimum(smin, tl.where(ld, x, float("inf")))
                smax = tl.maximum(smax, tl.where(ld, x, -float("inf")))
            if COUNTS_ONLY:
                n = tl.sum(tl.where(cols[None, :] == 1, s, 0.0), axis=1)  # exact: one term
            else:
                n = tl.sum(tl.where(cols[None, :] == 10, s, 0.0), axis=1)
                if AGG == 1:  # seq-mean-token-mean: per-sequence token means of pg and kl
                    div = tl.where(cols[None, :] < 2, tl.maximum(n, 1.0)[:, None], 1.0)
                    s = s / div
                rmin = tl.minimum(rmin, tl.min(tl.where(cols[None, :] == 11, smin, float("inf"))))
                rmax = tl.maximum(rmax, tl.max(tl.where(cols[None, :] == 12, smax, -float("inf"))))
            nseq = nseq + _tree_sum(tl.where(n > 0, 1.0, 0.0), BLOCK_B, LOG_BLOCK_B)
            for i in tl.static_range(LOG_BLOCK_B):
                s = tl.sum(tl.reshape(s, (2, BLOCK_B >> (i + 1), STATS)), axis=0)
            acc = acc + tl.sum(s, axis=0)
        if COUNTS_ONLY:
            ntok = tl.sum(tl.where(cols == 1, acc, 0.0), axis=0)
        else:
            ntok = tl.sum(tl.where(cols == 10, acc, 0.0), axis=0)
        if HAS_NORM:
            denom = loss_norm + tl.zeros((), dtype=tl.float32)
        elif AGG == 0:
            denom = tl.maximum(ntok, 1.0)
        elif AGG == 3:
            denom = T_f + tl.zeros((), dtype=tl.float32)
        else:
            denom = tl.maximum(nseq, 1.0)
        if COUNTS_ONLY:
            tl.store(out_ptr, denom)
        else:
            # metrics: pg, kl (/ D); token means (/ max(N, 1)); min / max; N; B'
            nt1 = tl.maximum(ntok, 1.0)
            scale = tl.where(cols < 2, denom, nt1)
            vals = acc / scale
            tl.store(out_ptr + cols, vals, mask=cols < 10)
            has = ntok > 0
            tl.store(out_ptr + 10, tl.where(has, rmin, 0.0))
            tl.store(out_ptr + 11, tl.where(has, rmax, 0.0))
            tl.store(out_ptr + 12, ntok)
            tl.store(out_ptr + 13, nseq)


def _kernel(name: str, device: torch.device) -> Any:
    return _rk._kernel(name, device, globals())


def _strides(x: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if x is None else (x.stride(0), x.stride(1))


def _prepass(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per (sequence, tile): sum of the masked raw log-ratios and the real-token count (the tile
    pass of :mod:`rl_engine.ops.ratio_kl.triton`, no token outputs)."""
    return _rk._partials(logp, old_logp, mask, 1.0, None, (0.0, 0.0, 0.0), raw_sums=True)


def _launch_reduce(part, out, b, nt, t, loss_agg, loss_norm, counts_only, stats) -> None:
    with _rk._guard(part):
        _kernel("_grpo_reduce_kernel", part.device)[(1,)](
            part,
            out,
            b,
            nt,
            float(t),
            float(loss_norm),
            AGG=_AGG_ID[loss_agg],
            HAS_NORM=loss_norm != 0.0,
            COUNTS_ONLY=counts_only,
            STATS=stats,
            BLOCK_B=BLOCK_B,
            LOG_BLOCK_B=_LOG_BLOCK_B,
            num_warps=_NUM_WARPS,
        )


def _launch_tokens(
    tensors: tuple[torch.Tensor | None, ...],
    m8: torch.Tensor,
    pre: torch.Tensor | None,
    out: torch.Tensor,
    o: Options,
    bwd: tuple[torch.Tensor, torch.Tensor, float, bool, bool] | None = None,
) -> None:
    """Launch the token kernel on a (row blocks, T tiles) grid: the forward's tile statistics
    into ``out`` (``bwd`` None), or the backward's ``d logp`` into ``out`` with ``bwd`` =
    ``(grad [1], denom [1], denom_const, per_seq_mean, denom_from_ptr)`` (fp32 tensors).
    ``pre``: the pre-pass partials, where the kernel reads them."""
    logp, old_logp, advantages, _, ref_logp, is_weights = tensors
    b, t = logp.shape
    dev = logp.device
    nt = _triton.cdiv(t, BLOCK_T)
    grad, denom, denom_const, seq_mean, denom_from_ptr = bwd or (out, out, 0.0, False, False)
    with _rk._guard(logp):
        rows = _rk.rows_per_program(dev)
        _kernel("_grpo_token_kernel", dev)[(_triton.cdiv(b, rows), nt)](
            grad,
            denom,
            logp,
            old_logp,
            advantages,
            m8,
            ref_logp if ref_logp is not None else logp,
            is_weights if is_weights is not None else logp,
            pre if pre is not None else out,
            out,
            b,
            t,
            nt,
            *_strides(logp),
            *_strides(old_logp),
            *_strides(advantages),
            *_strides(m8),
            *_strides(ref_logp),
            *_strides(is_weights),
            float(o.log_ratio_clamp),
            1.0 - float(o.clip_low),
            1.0 + float(o.clip_high),
            float(o.dual_clip),
            float(o.kl_beta),
            denom_const,
            SEQ_RATIO=o.ratio_type == "sequence",
            HAS_DUAL=o.dual_clip != 0.0,
            HAS_REF=ref_logp is not None,
            HAS_W=is_weights is not None,
            BWD=bwd is not None,
            KL_TERM=bwd is not None and o.kl_beta != 0.0 and ref_logp is not None,
            PER_SEQ_MEAN=seq_mean,
            DENOM_FROM_PTR=denom_from_ptr,
            STATS=_STATS,
            ROWS=rows,
            BLOCK=BLOCK_T,
            LOG_BLOCK=_LOG_BLOCK_T,
            num_warps=_NUM_WARPS,
        )


@signature_of(reference.grpo_loss)
def grpo_loss(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped policy-gradient loss and metrics (Triton; the reference's semantics).

    Takes the arguments of :func:`rl_engine.ops.grpo_loss.reference.grpo_loss`; ``logp``,
    ``old_logp`` and ``advantages`` in any strides (a [B] advantage expanded over T has stride 0
    and is read as such).

    Returns:
        ``(loss, metrics)``: fp32 scalar and fp32 [len(METRIC_NAMES)].
    """
    tensors = args[:6]
    o = check(tensors, args[6:])
    logp, old_logp, _, mask, _, _ = tensors
    _rk._check_device(logp, "grpo_loss")
    b, t = logp.shape
    dev = logp.device
    nt = _triton.cdiv(t, BLOCK_T)
    m8 = mask.view(torch.uint8)
    pre = _prepass(logp, old_logp, mask) if o.ratio_type == "sequence" else None
    part = torch.zeros((max(b * nt, 1), _STATS), dtype=torch.float32, device=dev)
    if b > 0 and nt > 0:
        _launch_tokens(tensors, m8, pre, part, o)
    metrics = torch.empty((len(METRIC_NAMES),), dtype=torch.float32, device=dev)
    _launch_reduce(part, metrics, b, nt, t, o.loss_agg, o.loss_norm, False, _STATS)
    # the reference's expression, on the metric scalars
    kl_beta = o.kl_beta
    loss = metrics[0] + kl_beta * metrics[1] if kl_beta != 0.0 else metrics[0].clone()
    return loss, metrics


@signature_of(reference.grpo_loss_backward)
def grpo_loss_backward(grad: torch.Tensor, *args: Any) -> torch.Tensor:
    """``d loss / d logp`` [B, T] in ``logp.dtype`` for the upstream scalar gradient ``grad``.

    Per token ``grad * (c_bt * (dpg_bt + kl_beta * dkl_bt))`` in fp32, one rounding; ``c_bt`` and
    the sequence ratio (GSPO) come from the same fixed-order partials as the forward.
    """
    tensors, o = args[:6], Options(*args[6:])
    logp, old_logp, _, mask, _, _ = tensors
    _rk._check_device(logp, "grpo_loss")
    b, t = logp.shape
    dev = logp.device
    d_logp = torch.zeros((b, t), dtype=logp.dtype, device=dev)
    if b == 0 or t == 0:
        return d_logp
    nt = _triton.cdiv(t, BLOCK_T)
    m8 = mask.view(torch.uint8)
    seq_ratio = o.ratio_type == "sequence"
    seq_mean = per_seq_mean(o.loss_agg)
    loss_norm = o.loss_norm
    denom_from_ptr = loss_norm == 0.0 and o.loss_agg != "seq-mean-token-sum-norm"
    need_pre = seq_ratio or seq_mean or denom_from_ptr
    pre = _prepass(logp, old_logp, mask) if need_pre else None
    denom = torch.ones((1,), dtype=torch.float32, device=dev)
    if denom_from_ptr:
        _launch_reduce(pre, denom, b, nt, t, o.loss_agg, 0.0, True, 2)
    denom_const = float(loss_norm) if loss_norm != 0.0 else float(t)
    g = grad.to(torch.float32).reshape(1)
    _launch_tokens(tensors, m8, pre, d_logp, o, (g, denom, denom_const, seq_mean, denom_from_ptr))
    return d_logp


PROVIDER = _triton.triton_provider(
    numerics="grpo_loss/triton", fn=grpo_loss, version="1", extras={"backward": grpo_loss_backward}
)
