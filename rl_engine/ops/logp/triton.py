"""``triton`` provider of ``logp`` and the shared Triton vocabulary reduction (``entropy`` and
``linear_logp`` use the same kernels, so the three ops reduce a row in exactly the same order).

Numerics (family ``logp/triton-v1024``), per row of ``z = logits.float() / temperature`` (an IEEE
division, ``tl.div_rn``, by the fp32 temperature), in fp32:

* The vocabulary is cut into tiles of ``VOCAB_TILE = 1024`` columns from column 0 and into
  segments of ``SEGMENT_TILES = 16`` tiles (the last tile / segment may be shorter; masked
  columns read ``-inf``). Every constant here is fixed: nothing depends on the token count.
* Inside a segment, tiles are visited in vocabulary order with the online rescaling of the
  reference, but the sums are kept **per lane** (lane ``j`` of a tile is column ``j`` of it)::

      m_new = max(m, max(z_tile))                        # exact, any order
      a     = exp(m - m_new)
      s[j]  = s[j] * a + exp(z_tile[j] - m_new)          # elementwise: no reduction order
      u[j]  = (u[j] + (m - m_new) * s[j]) * a + exp(..) * (z_tile[j] - m_new)   # entropy

  so the loop contains no sum at all. At the end of the segment the 1024 lanes are summed once
  by a fixed halving tree (lane ``i`` of the first half plus lane ``i`` of the second half,
  repeated; each step a sum over an axis of size 2, i.e. one exact-order addition), which does
  not depend on the register layout the compiler picks (``tl.sum`` over a long axis would: its
  order follows the layout, which pointer-alignment specialisation can change).
* Segment results ``(m, s, u)`` are combined sequentially in segment order with the same
  rescaling (one lane per row); ``lse = m + log(s)``, ``logp = z[token] - lse``,
  ``entropy = log(s) - u / s``. ``exp`` / ``log`` are Triton's (``tl.exp`` / ``tl.log``).
* Backward (elementwise given the row's ``lse`` and ``entropy``): ``p = exp(z - lse)``,
  ``dz = g_logp * ([j == token] - p) + g_ent * (-p * (z - lse + entropy))``, ``dlogits =
  dz / temperature`` (IEEE division), one rounding to ``logits.dtype``.

Rows are independent lanes everywhere (``ROWS`` rows per program is a launch parameter, not
numerics): a row's results depend on that row, ``V`` and the temperature only (row invariant),
no atomics (bitwise run to run). Not promised: identity with the ``native`` family, across GPU
models or Triton versions. On the CPU the kernels run in the Triton interpreter
(``TRITON_INTERPRET=1``): a test vehicle whose bits are not the GPU's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.logp import reference

__all__ = [
    "PROVIDER",
    "SEGMENT_TILES",
    "VOCAB_TILE",
    "logp",
    "logp_backward",
    "logp_forward",
    "sampled_forward",
    "vocab_backward",
    "vocab_forward",
]

# Part of the numerics (family ``...-v1024``): lanes per tile and tiles per segment.
VOCAB_TILE = 1024
_LOG_TILE = VOCAB_TILE.bit_length() - 1
SEGMENT_TILES = 16
SEGMENT = SEGMENT_TILES * VOCAB_TILE
NUMERICS = f"triton-v{VOCAB_TILE}"
# Launch parameters (no effect on the bits): rows per program on the GPU and in the interpreter.
_GPU_ROWS = 1
_INTERPRETER_ROWS = 16
_COMBINE_ROWS = 128
_NUM_WARPS = 4


if triton is not None:
    # Row sums of a [ROWS, N] tile: halving tree (first half + second half, repeated)
    from rl_engine.ops.ratio_kl.triton import _tree_sum_rows

    @triton.jit
    def _vocab_partial_kernel(
        x_ptr,
        part_ptr,
        T,
        V,
        n_seg,
        stride_t,
        stride_v,
        temp,
        temp_ptr,
        tok_ptr,
        cnt_ptr,
        WITH_ENT: tl.constexpr,
        ROW_TEMP: tl.constexpr,
        RANK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
        SEG: tl.constexpr,
    ):
        # part[row, seg] = (m, s, u) of the segment's columns (lane sums, then one tree).
        # ROW_TEMP: the row's fp32 temperature from temp_ptr (else the scalar temp); the same
        # IEEE division either way. RANK: cnt[row, seg] = #(z > z[token]) in the segment.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        seg = tl.program_id(1)
        rmask = rows < T
        cols = tl.arange(0, BLOCK)
        base = x_ptr + rows[:, None] * stride_t
        if ROW_TEMP:
            t_row = tl.load(temp_ptr + rows, mask=rmask, other=1.0)[:, None]
        else:
            t_row = temp
        if RANK:
            tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
            xt = tl.load(x_ptr + rows * stride_t + tok * stride_v, mask=rmask, other=0.0)
            if ROW_TEMP:
                zt = tl.div_rn(xt.to(tl.float32)[:, None], t_row)
            else:
                zt = tl.div_rn(xt.to(tl.float32), temp)[:, None]
            cnt = tl.zeros((ROWS, BLOCK), dtype=tl.int32)
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        s = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        u = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        c_begin = seg * SEG
        c_end = tl.minimum(V, c_begin + SEG)
        for c0 in range(c_begin, c_end, BLOCK):
            c = c0 + cols
            msk = rmask[:, None] & (c < c_end)[None, :]
            x = tl.load(base + c[None, :].to(tl.int64) * stride_v, mask=msk, other=float("-inf"))
            z = tl.div_rn(x.to(tl.float32), t_row)
            if RANK:
                cnt += (z > zt).to(tl.int32)  # masked columns read -inf: never counted
            m_new = tl.maximum(m, tl.max(z, axis=1))
            # rows that have seen only -inf so far: shift by 0 (no -inf - -inf)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            sh = z - m_ref[:, None]
            e = tl.exp(sh)
            alpha = tl.exp(m - m_ref)
            if WITH_ENT:
                eu = tl.where(e > 0, e * sh, 0.0)  # 0 * -inf -> 0
                u_old = tl.where(s > 0, u + (m - m_ref)[:, None] * s, 0.0)
                u = u_old * alpha[:, None] + eu
            s = s * alpha[:, None] + e
            m = m_new
        s_tot = _tree_sum_rows(s, ROWS, BLOCK, LOG_BLOCK)
        p = part_ptr + (rows * n_seg + seg) * 3
        tl.store(p, m, mask=rmask)
        tl.store(p + 1, s_tot, mask=rmask)
        if WITH_ENT:
            tl.store(p + 2, _tree_sum_rows(u, ROWS, BLOCK, LOG_BLOCK), mask=rmask)
        if RANK:  # integer counts: exact in any order
            tl.store(cnt_ptr + rows * n_seg + seg, tl.sum(cnt, axis=1), mask=rmask)

    @triton.jit
    def _vocab_combine_kernel(
        part_ptr,
        x_ptr,
        tok_ptr,
        logp_ptr,
        ent_ptr,
        lse_ptr,
        T,
        n_seg,
        stride_t,
        stride_v,
        temp,
        temp_ptr,
        cnt_ptr,
        rank_ptr,
        WITH_TOK: tl.constexpr,
        WITH_ENT: tl.constexpr,
        ROW_TEMP: tl.constexpr,
        RANK: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # Segments combined in order (one lane per row); then lse, entropy, logp (and, with
        # RANK, rank = 1 + the segments' counts, int64).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        rmask = rows < T
        if ROW_TEMP:
            t_row = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
        else:
            t_row = temp
        if RANK:
            above = tl.zeros((ROWS,), dtype=tl.int64)
            for j in range(0, n_seg):
                above += tl.load(cnt_ptr + rows * n_seg + j, mask=rmask, other=0).to(tl.int64)
            tl.store(rank_ptr + rows, above + 1, mask=rmask)
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        s = tl.zeros((ROWS,), dtype=tl.float32)
        u = tl.zeros((ROWS,), dtype=tl.float32)
        for j in range(0, n_seg):
            p = part_ptr + (rows * n_seg + j) * 3
            mj = tl.load(p, mask=rmask, other=float("-inf"))
            sj = tl.load(p + 1, mask=rmask, other=0.0)
            m_new = tl.maximum(m, mj)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp(m - m_ref)
            b = tl.exp(mj - m_ref)
            if WITH_ENT:
                uj = tl.load(p + 2, mask=rmask, other=0.0)
                ua = tl.where(s > 0, (u + (m - m_ref) * s) * a, 0.0)
                ub = tl.where(sj > 0, (uj + (mj - m_ref) * sj) * b, 0.0)
                u = ua + ub
            s = s * a + sj * b
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + rows, lse, mask=rmask)
        if WITH_ENT:
            tl.store(ent_ptr + rows, log_s - tl.div_rn(u, s), mask=rmask)
        if WITH_TOK:
            tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
            xt = tl.load(x_ptr + rows * stride_t + tok * stride_v, mask=rmask, other=0.0)
            zt = tl.div_rn(xt.to(tl.float32), t_row)
            tl.store(logp_ptr + rows, zt - lse, mask=rmask)

    @triton.jit
    def _vocab_bwd_kernel(
        x_ptr,
        dx_ptr,
        tok_ptr,
        lse_ptr,
        ent_ptr,
        gl_ptr,
        ge_ptr,
        T,
        V,
        col0,
        stride_t,
        stride_v,
        stride_dt,
        stride_dv,
        temp,
        HAS_GL: tl.constexpr,
        HAS_GE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # dlogits of one [ROWS, BLOCK] tile (elementwise; may run in place, dx_ptr == x_ptr).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < T
        msk = rmask[:, None] & (c < V)[None, :]
        c64 = c[None, :].to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_t + c64 * stride_v, mask=msk, other=0.0)
        z = tl.div_rn(x.to(tl.float32), temp)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        p = tl.exp(z - lse[:, None])
        dz = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        if HAS_GL:
            tok = tl.load(tok_ptr + rows, mask=rmask, other=-1)
            gl = tl.load(gl_ptr + rows, mask=rmask, other=0.0)
            hit = (c[None, :] + col0) == tok[:, None]
            dz = tl.where(hit, 1.0 - p, -p) * gl[:, None]
        if HAS_GE:
            ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
            ge = tl.load(ge_ptr + rows, mask=rmask, other=0.0)
            de = -p * ((z - lse[:, None]) + ent[:, None]) * ge[:, None]
            de = tl.where(p > 0, de, 0.0)  # p = 0 at z = -inf: 0, not 0 * inf
            if HAS_GL:
                dz = dz + de
            else:
                dz = de
        dx = tl.div_rn(dz, temp)
        tl.store(
            dx_ptr + rows[:, None] * stride_dt + c64 * stride_dv,
            dx.to(dx_ptr.dtype.element_ty),
            mask=msk,
        )


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``: a cached launcher for CUDA tensors, interpreted for CPU tensors."""
    return _triton.launcher(globals()[name], device)


def check_device(t: torch.Tensor, op: str = "logp") -> None:
    """Raise unless Triton can run on ``t``'s device (CUDA, or the CPU interpreter)."""
    _triton.check_device(op, t)


_guard = _triton.device_guard


def _rows_per_program(t: torch.Tensor) -> int:
    return _INTERPRETER_ROWS if t.device.type == "cpu" else _GPU_ROWS


def vocab_forward(
    logits: torch.Tensor,
    tokens: torch.Tensor | None,
    temperature: float,
    *,
    with_entropy: bool,
    out_logp: torch.Tensor | None = None,
    out_ent: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    row_temperatures: torch.Tensor | None = None,
    out_rank: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Shared forward: ``(logp, entropy, lse)`` fp32 [T] of ``logits`` [T, V] (module doc).

    ``logp`` is ``None`` without ``tokens``, ``entropy`` is ``None`` unless ``with_entropy``.
    ``out_*`` are optional contiguous fp32 [T] destinations (``linear_logp`` writes its token
    chunks into slices of its outputs). ``row_temperatures`` (contiguous fp32 [T], on the
    logits' device) replaces ``temperature`` row by row: the same IEEE division, so row ``i``
    has the bits of a call at ``temperature = row_temperatures[i]``. ``out_rank`` (contiguous
    int64 [T], needs ``tokens``) receives ``1 + #(z > z[token])`` per row, counted in the same
    pass. No input checks: the callers check.
    """
    n, vocab = logits.shape
    dev = logits.device
    f32 = torch.float32
    lse = out_lse if out_lse is not None else torch.empty(n, dtype=f32, device=dev)
    lp = None
    if tokens is not None:
        lp = out_logp if out_logp is not None else torch.empty(n, dtype=f32, device=dev)
    ent = None
    if with_entropy:
        ent = out_ent if out_ent is not None else torch.empty(n, dtype=f32, device=dev)
    if n == 0:
        return lp, ent, lse
    n_seg = _triton.cdiv(vocab, SEGMENT)
    rows = _rows_per_program(logits)
    part = torch.empty((n, n_seg, 3), dtype=f32, device=dev)
    # dummies for the pointers a launch does not read (the kernels' constexpr flags say which)
    tok = tokens.contiguous() if tokens is not None else lse  # the kernel reads tok[row]
    row_temp = row_temperatures is not None
    rank = out_rank is not None
    temps = row_temperatures if row_temp else lse
    cnt = torch.empty((n, n_seg), dtype=torch.int32, device=dev) if rank else lse
    temp = float(temperature)
    with _guard(logits):
        _kernel("_vocab_partial_kernel", dev)[(_triton.cdiv(n, rows), n_seg)](
            logits,
            part,
            n,
            vocab,
            n_seg,
            logits.stride(0),
            logits.stride(1),
            temp,
            temps,
            tok,
            cnt,
            WITH_ENT=with_entropy,
            ROW_TEMP=row_temp,
            RANK=rank,
            ROWS=rows,
            BLOCK=VOCAB_TILE,
            LOG_BLOCK=_LOG_TILE,
            SEG=SEGMENT,
            num_warps=_NUM_WARPS,
        )
        _kernel("_vocab_combine_kernel", dev)[(_triton.cdiv(n, _COMBINE_ROWS),)](
            part,
            logits,
            tok,
            lp if lp is not None else lse,
            ent if ent is not None else lse,
            lse,
            n,
            n_seg,
            logits.stride(0),
            logits.stride(1),
            temp,
            temps,
            cnt,
            out_rank if rank else lse,
            WITH_TOK=tokens is not None,
            WITH_ENT=with_entropy,
            ROW_TEMP=row_temp,
            RANK=rank,
            ROWS=_COMBINE_ROWS,
            num_warps=_NUM_WARPS,
        )
    return lp, ent, lse


def vocab_backward(
    logits: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    *,
    tokens: torch.Tensor | None = None,
    grad_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    col0: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared backward: ``dlogits`` [T, V] in ``out.dtype`` (default ``logits.dtype``).

    ``logits`` are columns ``col0 .. col0 + V`` of the full vocabulary (token ids compare
    against ``col0 + j``). ``out`` may be ``logits`` itself (in place). Elementwise per row.
    """
    if out is None:
        out = torch.empty_like(logits)
    n, vocab = logits.shape
    if n == 0 or vocab == 0:
        return out
    dev = logits.device
    rows = _rows_per_program(logits)
    has_gl = grad_logp is not None
    has_ge = grad_entropy is not None
    if not (has_gl or has_ge):
        return out.zero_()
    gl = grad_logp.float().contiguous() if has_gl else lse
    tok = tokens.long().contiguous() if has_gl else lse  # the kernel reads tok[row]
    ge = grad_entropy.float().contiguous() if has_ge else lse
    ent = entropy if has_ge else lse
    with _guard(logits):
        _kernel("_vocab_bwd_kernel", dev)[(_triton.cdiv(n, rows), _triton.cdiv(vocab, VOCAB_TILE))](
            logits,
            out,
            tok,
            lse,
            ent,
            gl,
            ge,
            n,
            vocab,
            col0,
            logits.stride(0),
            logits.stride(1),
            out.stride(0),
            out.stride(1),
            float(temperature),
            HAS_GL=has_gl,
            HAS_GE=has_ge,
            ROWS=rows,
            BLOCK=VOCAB_TILE,
            num_warps=_NUM_WARPS,
        )
    return out


# ---------------------------------------------------------------------------- the provider
def logp_forward(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, lse)``, both fp32 [T]; see :func:`logp`. The arguments are trusted (checked at
    the public entry)."""
    check_device(logits, "logp")
    reference.check_token_range(tokens, logits.shape[1])
    lp, _, lse = vocab_forward(logits, tokens, temperature, with_entropy=False)
    assert lp is not None
    return lp, lse


def sampled_forward(
    logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, rank)`` of each row's token at the row's own temperature, in one pass over
    the logits (two launches): the bits of :func:`logp_forward` at ``temperatures[t]`` for row
    ``t``, and ``rank = 1 + #(z > z[token])`` (int64) counted in the same tiles.
    ``temperatures``: fp32 [T] on the logits' device (the rollout's per-request values)."""
    reference._check(logits, tokens, 1.0)
    reference.check_row_temperatures(logits, temperatures)
    check_device(logits, "logp")
    rank = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    lp, _, lse = vocab_forward(
        logits,
        tokens,
        1.0,
        with_entropy=False,
        row_temperatures=temperatures.contiguous(),
        out_rank=rank,
    )
    assert lp is not None
    return lp, lse, rank


@signature_of(reference.logp_backward)
def logp_backward(*args: Any) -> torch.Tensor:
    """``grad * (onehot - softmax(z)) / temperature`` in ``logits.dtype`` [T, V]."""
    logits, tokens, temperature, lse, grad = args
    check_device(logits, "logp")
    return vocab_backward(
        logits, temperature, lse.float().contiguous(), tokens=tokens, grad_logp=grad
    )


def logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Batch-invariant ``log_softmax(logits / temperature)[token]`` in Triton (fp32 [T]).

    Args:
        logits: [T, V] float32 / bfloat16 / float16, any strides.
        tokens: [T] int64 / int32 token ids in ``[0, V)``.
        temperature: Python float > 0.

    Returns:
        fp32 [T]; the reduction of the module docstring.
    """
    reference._check(logits, tokens, temperature)
    return logp_forward(logits, tokens, temperature)[0]


assert math.log2(VOCAB_TILE).is_integer() and VOCAB_TILE == reference.VOCAB_TILE

PROVIDER = _triton.triton_provider(
    numerics=f"logp/{NUMERICS}",
    fn=logp,
    version="1",
    extras={"forward": logp_forward, "backward": logp_backward, "sampled": sampled_forward},
)
