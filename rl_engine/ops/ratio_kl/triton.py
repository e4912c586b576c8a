"""``triton`` provider of ``ratio_kl``: forward and backward in Triton, fixed reduction order.

Numerics (family ``ratio_kl/triton``):

* Per token (fp32, one pass over a ``BLOCK_T`` tile): ``log_ratio``, ``ratio``, ``k1``-``k3``,
  the truncated / masked token IS weight and keep mask, with the reference's semantics (masked
  tokens read every input as 0). ``exp`` is :func:`_exp` (Cody-Waite range reduction, then
  ``exp`` of a small argument and an exact power-of-two scale: a few ulps on the GPU too, where
  ``tl.exp`` alone loses accuracy for large arguments); ``k3 = exp(x) - 1 - x`` uses a Taylor
  polynomial for ``|x| < 1/4`` so small log-ratios keep their relative accuracy.
* Per sequence: the token log-ratios and the mask are summed per tile of ``BLOCK_T`` tokens with a
  fixed pairwise tree (:func:`_tree_sum`: element i of the first half plus element i of the
  second half, repeated; it does not depend on the compiler's register layout, unlike
  ``tl.sum``, whose order follows the layout that pointer-alignment specialisation picks). The
  tile partials are added sequentially in tile order, one lane per sequence. ``BLOCK_T`` is a
  constant, so the order depends on nothing but the token position: every output of sequence b
  depends on row b only (row invariance), and masked tokens appended to the rows add exact zeros
  (right-padding invariance).
* Backward: the same tile partials and sequence values (same kernels, same constants) give the
  per-sequence gradient term; the per-token gradient is elementwise. No atomics anywhere, so
  every result is bitwise reproducible run to run.

Not promised: bitwise identity with the ``native`` family (its sums are ``tree_sum`` over the
whole row and its ``exp`` is evaluated in float64), across GPU models or Triton versions. On the
CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``), a test vehicle.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.ratio_kl import reference
from rl_engine.ops.ratio_kl.args import Options, check

__all__ = ["BLOCK_T", "PROVIDER", "ratio_kl", "ratio_kl_backward"]

# Tokens per tile: the in-tile tree spans BLOCK_T lanes (a power of two). Part of the numerics
# family: changing it changes the bits of every per-sequence sum.
BLOCK_T = 1024
_LOG_BLOCK_T = BLOCK_T.bit_length() - 1
# Sequences per program of the per-sequence kernel (lanes are independent: any value works).
_BLOCK_B = 128
_NUM_WARPS = 4
_INTERPRETER_ROWS = 16


if triton is not None:

    @triton.jit
    def _tree_sum(x, N: tl.constexpr, LOG_N: tl.constexpr):
        """Sum of a [N] fp32 vector in a fixed pairwise order (first half + second half, ...)."""
        for i in tl.static_range(LOG_N):
            x = tl.sum(tl.reshape(x, (2, N >> (i + 1))), axis=0)
        return tl.sum(x, axis=0)

    @triton.jit
    def _tree_sum_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
        """Row sums of a [ROWS, N] tile, each in the pairwise order of :func:`_tree_sum`."""
        for i in tl.static_range(LOG_N):
            x = tl.sum(tl.reshape(x, (ROWS, 2, N >> (i + 1))), axis=1)
        return tl.sum(x, axis=1)

    @triton.jit
    def _exp(x):
        """fp32 ``exp``: x = n ln2 + r (Cody-Waite), exp(r) * 2**n1 * 2**n2 (exact scales)."""
        xc = tl.minimum(tl.maximum(x, -104.0), 89.0)
        n = tl.floor(xc * 1.4426950408889634 + 0.5)
        r = (xc - n * 0.693145751953125) - n * 1.428606765330187045e-06
        p = tl.exp(r)
        n1 = tl.floor(n * 0.5)
        s1 = ((n1.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        s2 = (((n - n1).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        y = p * s1 * s2
        return tl.where(x != x, x, y)

    @triton.jit
    def _k3(x, e):
        """``exp(x) - 1 - x`` given ``e = exp(x)``: Taylor series for |x| < 1/4."""
        p = x * (1.0 / 40320.0) + (1.0 / 5040.0)
        p = p * x + (1.0 / 720.0)
        p = p * x + (1.0 / 120.0)
        p = p * x + (1.0 / 24.0)
        p = p * x + (1.0 / 6.0)
        p = p * x + 0.5
        small = (x * x) * p
        return tl.where(tl.abs(x) < 0.25, small, (e - 1.0) - x)

    @triton.jit
    def _expm1(x, e):
        """``exp(x) - 1`` given ``e = exp(x)`` (accurate for small |x|, as :func:`_k3`)."""
        return tl.where(tl.abs(x) < 0.25, _k3(x, e) + x, e - 1.0)

    @triton.jit
    def _tile(B, T, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's tile of a (row blocks, T tiles) grid: sequences ``b`` [ROWS], tile
        index ``j``, ``rows`` (b < B), ``inb`` [ROWS, BLOCK] (in bounds) and the broadcast
        indices ``bb`` [ROWS, 1], ``tt`` [1, BLOCK] (int64 offsets)."""
        b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        t = j * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        rows = b < B
        inb = rows[:, None] & (t < T)[None, :]
        return b, j, rows, inb, b[:, None], t[None, :]

    @triton.jit
    def _load_tile(ptr, bb, tt, s_b, s_t, inb):
        """A [ROWS, BLOCK] tile of a strided [B, T] input as fp32 (0 out of bounds)."""
        return tl.load(ptr + bb * s_b + tt * s_t, mask=inb, other=0.0).to(tl.float32)

    @triton.jit
    def _load_mask(m_ptr, bb, tt, s_mb, s_mt, inb, HAS_MASK: tl.constexpr):
        """The tile's real tokens: the uint8 mask's nonzeros in bounds (all in bounds without
        a mask)."""
        if HAS_MASK:
            m = (tl.load(m_ptr + bb * s_mb + tt * s_mt, mask=inb, other=0) != 0) & inb
        else:
            m = inb
        return m

    @triton.jit
    def _log_ratio_tile(
        lp_ptr,
        old_ptr,
        m_ptr,
        B,
        T,
        s_lb,
        s_lt,
        s_ob,
        s_ot,
        s_mb,
        s_mt,
        HAS_MASK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """This program's tile (:func:`_tile`) with ``logp`` (fp32), the real tokens ``m`` and
        the raw log-ratio ``m * (logp - old_logp)`` (masked tokens read as 0): ``(b, j, rows,
        inb, bb, tt, lp, m, raw)``."""
        b, j, rows, inb, bb, tt = _tile(B, T, ROWS, BLOCK)
        lp = _load_tile(lp_ptr, bb, tt, s_lb, s_lt, inb)
        old = _load_tile(old_ptr, bb, tt, s_ob, s_ot, inb)
        m = _load_mask(m_ptr, bb, tt, s_mb, s_mt, inb, HAS_MASK)
        raw = tl.where(m, lp - old, 0.0)
        return b, j, rows, inb, bb, tt, lp, m, raw

    @triton.jit
    def _store_partials(
        part_ptr, x, m, b, j, NT, rows, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr
    ):
        """Each row's tile partials ``(sum of x, real-token count)`` at ``part[b * NT + j]``."""
        p = (b * NT + j) * 2
        tl.store(part_ptr + p, _tree_sum_rows(x, ROWS, N, LOG_N), mask=rows)
        cnt = _tree_sum_rows(m.to(tl.float32), ROWS, N, LOG_N)
        tl.store(part_ptr + p + 1, cnt, mask=rows)

    @triton.jit
    def _seq_partials(part_ptr, b, inb, NT, N: tl.constexpr):
        """[N] x 2: the tile partials of :func:`_store_partials` of sequences ``b`` (``inb``),
        added sequentially in tile order."""
        s = tl.zeros((N,), dtype=tl.float32)
        n = tl.zeros((N,), dtype=tl.float32)
        for j in range(0, NT):
            p = (b * NT + j) * 2
            s = s + tl.load(part_ptr + p, mask=inb, other=0.0)
            n = n + tl.load(part_ptr + p + 1, mask=inb, other=0.0)
        return s, n

    @triton.jit
    def _ratio_kl_tile_kernel(
        lp_ptr,
        old_ptr,
        m_ptr,
        lr_ptr,
        r_ptr,
        k1_ptr,
        k2_ptr,
        k3_ptr,
        w_ptr,
        keep_ptr,
        part_ptr,
        B,
        T,
        NT,
        s_lb,
        s_lt,
        s_ob,
        s_ot,
        s_mb,
        s_mt,
        clamp,
        cap,
        mis_lo,
        mis_hi,
        HAS_MASK: tl.constexpr,
        STORE: tl.constexpr,
        RAW_SUMS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
    ):
        """One program per (ROWS sequences, tile j): token outputs (STORE) and each row's tile
        partial sums (log-ratio, real-token count) for the per-sequence pass; ``RAW_SUMS``: of
        the raw log-ratio, before the clamp (grpo_loss's pre-pass). Rows are independent lanes:
        ROWS is a launch parameter, not part of the numerics."""
        b, j, rows, inb, bb, tt, _, m, raw = _log_ratio_tile(
            lp_ptr, old_ptr, m_ptr, B, T, s_lb, s_lt, s_ob, s_ot, s_mb, s_mt, HAS_MASK, ROWS, BLOCK
        )
        lr = tl.clamp(raw, -clamp, clamp)
        if STORE:
            r = _exp(lr)
            keep = m & (r >= mis_lo) & (r <= mis_hi)
            w = tl.where(keep, tl.minimum(r, cap), 0.0)
            o = bb * T + tt
            tl.store(lr_ptr + o, lr, mask=inb)
            tl.store(r_ptr + o, r, mask=inb)
            tl.store(k1_ptr + o, -lr, mask=inb)
            tl.store(k2_ptr + o, lr * lr * 0.5, mask=inb)
            tl.store(k3_ptr + o, _k3(lr, r), mask=inb)
            tl.store(w_ptr + o, w, mask=inb)
            tl.store(keep_ptr + o, keep.to(tl.int8), mask=inb)
        if RAW_SUMS:
            _store_partials(part_ptr, raw, m, b, j, NT, rows, ROWS, BLOCK, LOG_BLOCK)
        else:
            _store_partials(part_ptr, lr, m, b, j, NT, rows, ROWS, BLOCK, LOG_BLOCK)

    @triton.jit
    def _ratio_kl_seq_kernel(
        part_ptr,
        B,
        NT,
        slr_ptr,
        sr_ptr,
        sw_ptr,
        skeep_ptr,
        gsl_ptr,
        gsr_ptr,
        s_gsl,
        s_gsr,
        gseq_ptr,
        clamp,
        cap,
        mis_lo,
        mis_hi,
        GEOMETRIC: tl.constexpr,
        BWD: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        # One lane per sequence: tile partials added sequentially in tile order.
        b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
        inb = b < B
        s, n = _seq_partials(part_ptr, b, inb, NT, BLOCK_B)
        n1 = tl.maximum(n, 1.0)
        if GEOMETRIC:
            s = s / n1
        slr = tl.clamp(s, -clamp, clamp)
        sr = _exp(slr)
        if BWD:
            gsl = tl.load(gsl_ptr + b * s_gsl, mask=inb, other=0.0).to(tl.float32)
            gsr = tl.load(gsr_ptr + b * s_gsr, mask=inb, other=0.0).to(tl.float32)
            g = tl.where((s >= -clamp) & (s <= clamp), gsl + gsr * sr, 0.0)
            if GEOMETRIC:
                g = g / n1
            tl.store(gseq_ptr + b, g, mask=inb)
        else:
            keep = (sr >= mis_lo) & (sr <= mis_hi)
            tl.store(slr_ptr + b, slr, mask=inb)
            tl.store(sr_ptr + b, sr, mask=inb)
            tl.store(sw_ptr + b, tl.where(keep, tl.minimum(sr, cap), 0.0), mask=inb)
            tl.store(skeep_ptr + b, keep.to(tl.int8), mask=inb)

    @triton.jit
    def _ratio_kl_bwd_kernel(
        g_lr_ptr,
        g_r_ptr,
        g_k1_ptr,
        g_k2_ptr,
        g_k3_ptr,
        gseq_ptr,
        lp_ptr,
        old_ptr,
        m_ptr,
        d_lp_ptr,
        d_old_ptr,
        B,
        T,
        s_g1b,
        s_g1t,
        s_g2b,
        s_g2t,
        s_g3b,
        s_g3t,
        s_g4b,
        s_g4t,
        s_g5b,
        s_g5t,
        s_lb,
        s_lt,
        s_ob,
        s_ot,
        s_mb,
        s_mt,
        clamp,
        HAS_MASK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Per token ``d logp = [in clamp range] * (g_lr + gseq[b])`` (the reference's formula,
        ``gseq`` from the per-sequence kernel) and ``d old_logp = -d logp``."""
        b, _, rows, inb, bb, tt, _, m, raw = _log_ratio_tile(
            lp_ptr, old_ptr, m_ptr, B, T, s_lb, s_lt, s_ob, s_ot, s_mb, s_mt, HAS_MASK, ROWS, BLOCK
        )
        lr = tl.clamp(raw, -clamp, clamp)
        inr = m & (raw >= -clamp) & (raw <= clamp)
        r = _exp(lr)
        rm1 = _expm1(lr, r)
        g1 = _load_tile(g_lr_ptr, bb, tt, s_g1b, s_g1t, inb)
        g2 = _load_tile(g_r_ptr, bb, tt, s_g2b, s_g2t, inb)
        g3 = _load_tile(g_k1_ptr, bb, tt, s_g3b, s_g3t, inb)
        g4 = _load_tile(g_k2_ptr, bb, tt, s_g4b, s_g4t, inb)
        g5 = _load_tile(g_k3_ptr, bb, tt, s_g5b, s_g5t, inb)
        g = g1 + g2 * r - g3
        g = g + g4 * lr + g5 * rm1
        gs = tl.load(gseq_ptr + b, mask=rows, other=0.0)
        d = tl.where(inr, g + gs[:, None], 0.0)
        o = bb * T + tt
        tl.store(d_lp_ptr + o, d.to(d_lp_ptr.dtype.element_ty), mask=inb)
        tl.store(d_old_ptr + o, (-d).to(d_old_ptr.dtype.element_ty), mask=inb)


def _kernel(name: str, device: torch.device, scope: dict[str, Any] | None = None) -> Any:
    """The JIT kernel ``name`` of ``scope`` (default: this module): a cached launcher for CUDA
    tensors, interpreted for CPU tensors."""
    return _triton.launcher((globals() if scope is None else scope)[name], device)


def _check_device(t: torch.Tensor, op: str = "ratio_kl") -> None:
    _triton.check_device(op, t)


def rows_per_program(device: torch.device) -> int:
    """Sequences per program of the token kernels: 1 on the GPU (a [1, BLOCK_T] tile per
    program); more in the interpreter, whose cost is per program. Rows are independent lanes,
    so this changes no bits (a test checks it)."""
    return _INTERPRETER_ROWS if device.type == "cpu" else 1


_guard = _triton.device_guard


def _inputs(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The token kernels' inputs ``(logp, old_logp, mask as uint8 or logp)`` and their strides
    (0 for an absent mask)."""
    if mask is None:
        m, s_mb, s_mt = logp, 0, 0
    else:
        m = mask.view(torch.uint8)
        s_mb, s_mt = m.stride(0), m.stride(1)
    strides = (logp.stride(0), logp.stride(1), old_logp.stride(0), old_logp.stride(1), s_mb, s_mt)
    return (logp, old_logp, m), strides


def _partials(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor | None,
    clamp: float,
    outs: tuple[torch.Tensor, ...] | None,
    opts: tuple[float, float, float],
    raw_sums: bool = False,
) -> torch.Tensor:
    """Launch the tile kernel (token outputs when ``outs`` is given); returns the partials (of
    the raw log-ratio where ``raw_sums``)."""
    b, t = logp.shape
    nt = _triton.cdiv(t, BLOCK_T)
    part = torch.zeros((max(b * nt, 1), 2), dtype=torch.float32, device=logp.device)
    if b == 0 or nt == 0:
        return part
    inputs, strides = _inputs(logp, old_logp, mask)
    dummy = part
    o = outs if outs is not None else (dummy,) * 7
    with _guard(logp):
        rows = rows_per_program(logp.device)
        _kernel("_ratio_kl_tile_kernel", logp.device)[(_triton.cdiv(b, rows), nt)](
            *inputs,
            *o,
            part,
            b,
            t,
            nt,
            *strides,
            clamp,
            *opts,
            HAS_MASK=mask is not None,
            STORE=outs is not None,
            RAW_SUMS=raw_sums,
            ROWS=rows,
            BLOCK=BLOCK_T,
            LOG_BLOCK=_LOG_BLOCK_T,
            num_warps=_NUM_WARPS,
        )
    return part


def _launch_seq(
    part: torch.Tensor,
    b: int,
    nt: int,
    clamp: float,
    geometric: bool,
    outs: tuple[torch.Tensor, ...] | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    opts: tuple[float, float, float],
) -> None:
    """Launch the per-sequence kernel on the tile partials ``part``: the forward writes ``outs``
    (seq_log_ratio, seq_ratio, seq_weight, seq_keep; ``opts`` = seq cap and masked-IS range),
    the backward ``grads`` = (g_seq_log_ratio, g_seq_ratio) into their ``gseq`` term."""
    if grads is None:
        gsl, gsr, gseq = part, part, part
        s_gsl, s_gsr = 0, 0
    else:
        gsl, gsr, gseq = grads
        s_gsl, s_gsr = gsl.stride(0), gsr.stride(0)
    with _guard(part):
        _kernel("_ratio_kl_seq_kernel", part.device)[(_triton.cdiv(b, _BLOCK_B),)](
            part,
            b,
            nt,
            *(outs if outs is not None else (part,) * 4),
            gsl,
            gsr,
            s_gsl,
            s_gsr,
            gseq,
            clamp,
            *opts,
            GEOMETRIC=bool(geometric),
            BWD=grads is not None,
            BLOCK_B=_BLOCK_B,
            num_warps=_NUM_WARPS,
        )


@signature_of(reference.ratio_kl)
def ratio_kl(*args: Any) -> tuple[torch.Tensor, ...]:
    """Importance ratios, KL estimators and IS weights (Triton; the reference's semantics).

    Takes the arguments of :func:`rl_engine.ops.ratio_kl.reference.ratio_kl` (``logp`` and
    ``old_logp`` in any strides) and returns its outputs: ``(log_ratio, ratio, k1, k2, k3,
    token_weight, token_keep, seq_log_ratio, seq_ratio, seq_weight, seq_keep)``: [B, T] fp32 x 6,
    [B, T] bool, [B] fp32 x 3, [B] bool.
    """
    logp, old_logp, mask = args[:3]
    o = Options(*args[3:])
    check(logp, old_logp, mask, o[:7])
    _check_device(logp)
    b, t = logp.shape
    dev = logp.device
    tok = [torch.empty((b, t), dtype=torch.float32, device=dev) for _ in range(6)]
    tok_keep = torch.zeros((b, t), dtype=torch.uint8, device=dev)
    seq = [torch.empty((b,), dtype=torch.float32, device=dev) for _ in range(3)]
    seq_keep = torch.zeros((b,), dtype=torch.uint8, device=dev)
    if b > 0:
        clamp = float(o.log_ratio_clamp)
        part = _partials(
            logp,
            old_logp,
            mask,
            clamp,
            (*tok, tok_keep),
            (float(o.token_cap), float(o.token_mis_lo), float(o.token_mis_hi)),
        )
        seq_opts = (float(o.seq_cap), float(o.seq_mis_lo), float(o.seq_mis_hi))
        nt = _triton.cdiv(t, BLOCK_T)
        _launch_seq(part, b, nt, clamp, o.geometric, (*seq, seq_keep), None, seq_opts)
    return (
        *tok,
        tok_keep.view(torch.bool),
        *seq,
        seq_keep.view(torch.bool),
    )


@signature_of(reference.ratio_kl_backward)
def ratio_kl_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(d logp, d old_logp)`` in the inputs' dtypes (the reference's formulas).

    Takes the arguments of :func:`rl_engine.ops.ratio_kl.reference.ratio_kl_backward`: the
    upstream gradients (any strides) and the forward's inputs. ``d old_logp = -d logp`` before
    rounding.
    """
    *upstream, logp, old_logp, mask, log_ratio_clamp, geometric = args
    _check_device(logp)
    b, t = logp.shape
    dev = logp.device
    d_lp = torch.empty((b, t), dtype=logp.dtype, device=dev)
    d_old = torch.empty((b, t), dtype=old_logp.dtype, device=dev)
    if b == 0 or t == 0:
        return d_lp, d_old
    clamp = float(log_ratio_clamp)
    part = _partials(logp, old_logp, mask, clamp, None, (0.0, 0.0, 0.0))
    gseq = torch.empty((b,), dtype=torch.float32, device=dev)
    gsl, gsr = (g.float() for g in upstream[5:])
    nt = _triton.cdiv(t, BLOCK_T)
    _launch_seq(part, b, nt, clamp, geometric, None, (gsl, gsr, gseq), (0.0, 0.0, 0.0))
    grads = [x.float() for x in upstream[:5]]
    inputs, strides = _inputs(logp, old_logp, mask)
    with _guard(logp):
        rows = rows_per_program(dev)
        _kernel("_ratio_kl_bwd_kernel", dev)[(_triton.cdiv(b, rows), nt)](
            *grads,
            gseq,
            *inputs,
            d_lp,
            d_old,
            b,
            t,
            *[s for g in grads for s in g.stride()],
            *strides,
            clamp,
            HAS_MASK=mask is not None,
            ROWS=rows,
            BLOCK=BLOCK_T,
            num_warps=_NUM_WARPS,
        )
    return d_lp, d_old


PROVIDER = _triton.triton_provider(
    numerics="ratio_kl/triton", fn=ratio_kl, version="1", extras={"backward": ratio_kl_backward}
)
