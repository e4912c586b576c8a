"""``triton`` provider of ``moe_router``: the top-k choice of a token in one kernel.

Numerics (family ``moe_router/native``, the reference's: the two are bitwise equal, tested).
The reference runs ~60 small torch kernels per call (the float64 ``exp`` polynomial of
:mod:`rl_engine.ops._math`, the halving trees, a sort); on a decode step of an MoE layer that
was most of the layer's time. This kernel does the same sequence of IEEE operations per row in
one launch (floating-point contraction into FMAs switched off, ``enable_fp_fusion=False``;
every float64 constant loaded from an exact float64 table):

1. ``l = logits.float()``; ``m = max(l)`` (exact); ``d = l - m`` in fp32;
2. ``e = exp64(d)`` rounded to fp32: ``_math.exp64`` step by step (clamp, ``n = floor(x log2e
   + 1/2)``, the two-part ln 2 reduction, the degree-13 Horner polynomial, the split exact
   scale ``2**n1 * 2**(n - n1)`` from the exponent bits);
3. ``p = e / tree(e)`` (``tl.div_rn``; the tree is ``_common.tree_sum``'s halving order over
   the row zero-padded to a power of two: the columns past ``E`` load ``-inf``, whose ``exp``
   is exactly 0);
4. top-k as the reference's stable descending sort: k rounds of "largest remaining score,
   the lowest id among equals" (NaN counts as the largest, as in ``torch.sort``);
5. ``scoring="softmax"``: ``w = p[ids]``, renormalised by ``w / tree(w)``;
   ``scoring="topk_softmax"``: top-k of ``l``, then steps 1-3 over the k chosen logits.

Backward: the reference's (torch ops on ``[T, E]``: the trainer's step, where the forward's
launch count does not dominate). A row's result depends on that row alone (one program owns
whole rows); tiles depend on ``E`` and ``k`` only.

Not promised beyond what the tests show: identity with the reference on every GPU model and
Triton version (the GPU tests compare them bitwise). On the CPU the kernel runs in the Triton
interpreter.
"""

from __future__ import annotations

import math

import torch

from rl_engine.ops import _triton
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.moe_router import reference
from rl_engine.ops.moe_router.reference import _check

__all__ = ["PROVIDER", "moe_topk"]

# ``_math.exp64``'s constants as exact float64 values: [log2(e), ln2_hi, ln2_lo, then the 14
# Horner coefficients 1/13!, 1/12!, ..., 1/0!].
EXP64_CONSTS: tuple[float, ...] = (
    1.4426950408889634,
    6.93147180369123816490e-01,
    1.90821492927058770002e-10,
    *(1.0 / math.factorial(i) for i in range(13, -1, -1)),
)
_N_COEF = 14


if triton is not None:
    # row sums in ``_common.tree_sum``'s halving order: logp's kernel helper
    from rl_engine.ops.logp.triton import _tree_sum_rows

    @triton.jit
    def _exp64(x, c_ptr, N_COEF: tl.constexpr):
        """``_math.exp64`` of a float64 tile (float64 result), operation for operation; the
        launch must pass ``enable_fp_fusion=False``. ``c_ptr``: :data:`EXP64_CONSTS`."""
        xc = tl.minimum(tl.maximum(x, -740.0), 709.0)
        n = tl.floor(xc * tl.load(c_ptr) + 0.5)
        r = (xc - n * tl.load(c_ptr + 1)) - n * tl.load(c_ptr + 2)
        p = tl.zeros_like(r) + tl.load(c_ptr + 3)
        for i in tl.static_range(1, N_COEF):
            p = p * r + tl.load(c_ptr + 3 + i)
        n1 = tl.floor(n * 0.5)
        s1 = ((n1.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        s2 = (((n - n1).to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        y = p * s1 * s2
        y = tl.where(x > 709.0, float("inf"), y)
        y = tl.where(x < -740.0, 0.0, y)
        return tl.where(x != x, x, y)

    @triton.jit
    def _softmax_rows(v, c_ptr, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr,
                      N_COEF: tl.constexpr):  # fmt: skip
        """``reference.softmax32`` of a [ROWS, N] fp32 tile (padding columns hold -inf)."""
        m = tl.max(v, axis=1)
        d = v - m[:, None]
        e = _exp64(d.to(tl.float64), c_ptr, N_COEF).to(tl.float32)
        return tl.div_rn(e, _tree_sum_rows(e, ROWS, N, LOG_N)[:, None])

    @triton.jit
    def _top1(score, avail, cols, BIG: tl.constexpr):
        """Per row: the largest available score and its column (lowest column among equals;
        NaN first, as a stable descending ``torch.sort``)."""
        isnan = avail & (score != score)
        nan_col = tl.min(tl.where(isnan, cols, BIG), axis=1)
        m = tl.max(tl.where(avail, score, float("-inf")), axis=1)
        col = tl.min(tl.where(avail & (score == m[:, None]), cols, BIG), axis=1)
        has_nan = nan_col < BIG
        col = tl.where(has_nan, nan_col, col)
        return col

    @triton.jit
    def _moe_topk_kernel(
        l_ptr, w_ptr, ids_ptr, c_ptr, T, E, stride_lt, stride_le,
        TOP_K: tl.constexpr, SOFTMAX_ALL: tl.constexpr, RENORM: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, LOG_E: tl.constexpr,
        BLOCK_K: tl.constexpr, LOG_K: tl.constexpr, N_COEF: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < T
        cols = tl.arange(0, BLOCK_E)
        cmask = cols < E
        mask = rmask[:, None] & cmask[None, :]
        lf = tl.load(
            l_ptr + rows[:, None] * stride_lt + cols[None, :] * stride_le,
            mask=mask,
            other=float("-inf"),
        ).to(tl.float32)
        if SOFTMAX_ALL:
            score = _softmax_rows(lf, c_ptr, BLOCK_T, BLOCK_E, LOG_E, N_COEF)
        else:
            score = lf
        kcols = tl.arange(0, BLOCK_K)
        avail = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1) | cmask[None, :]
        # the chosen values: weights pad with 0 (the tree's padding), logits with -inf (exp 0)
        sel = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32) + (
            0.0 if SOFTMAX_ALL else float("-inf")
        )
        ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            col = _top1(score, avail, cols[None, :], BLOCK_E)
            hit = cols[None, :] == col[:, None]
            val = tl.sum(tl.where(hit, score, 0.0), axis=1)  # the one chosen value (+ zeros)
            avail = avail & ~hit
            sel = tl.where(kcols[None, :] == j, val[:, None], sel)
            ids = tl.where(kcols[None, :] == j, col[:, None].to(tl.int64), ids)
        if SOFTMAX_ALL:
            w = sel
            if RENORM:
                w = tl.div_rn(w, _tree_sum_rows(w, BLOCK_T, BLOCK_K, LOG_K)[:, None])
        else:
            w = _softmax_rows(sel, c_ptr, BLOCK_T, BLOCK_K, LOG_K, N_COEF)
        omask = rmask[:, None] & (kcols[None, :] < TOP_K)
        out = rows[:, None] * TOP_K + kcols[None, :]
        tl.store(w_ptr + out, w, mask=omask)
        tl.store(ids_ptr + out, ids, mask=omask)


_consts: dict[str, torch.Tensor] = {}


def exp64_consts(device: torch.device) -> torch.Tensor:
    """:data:`EXP64_CONSTS` as a float64 tensor on ``device``, made once per device (so a
    CUDA-graph replay copies nothing)."""
    key = str(device)
    t = _consts.get(key)
    if t is None:
        t = _consts[key] = torch.tensor(EXP64_CONSTS, dtype=torch.float64, device=device)
    return t


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def moe_topk(
    logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and bits as :func:`rl_engine.ops.moe_router.reference.moe_topk`."""
    _check(logits, top_k, scoring, renormalize)
    _triton.check_device("moe_router", logits)
    t, e = logits.shape
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    block_e = _pow2(e)
    block_k = _pow2(top_k)
    # rows per program: ~2k elements of the [rows, E] tile (E = 128: 16 rows)
    block_t = max(1, min(64, 2048 // block_e, _pow2(t)))
    grid = (_triton.cdiv(t, block_t),)
    with _triton.device_guard(logits):
        _triton.launcher(_moe_topk_kernel, logits.device)[grid](
            logits, w, ids, exp64_consts(logits.device), t, e,
            logits.stride(0), logits.stride(1),
            TOP_K=top_k, SOFTMAX_ALL=scoring == "softmax", RENORM=bool(renormalize),
            BLOCK_T=block_t, BLOCK_E=block_e, LOG_E=block_e.bit_length() - 1,
            BLOCK_K=block_k, LOG_K=block_k.bit_length() - 1, N_COEF=_N_COEF,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return w, ids


PROVIDER = _triton.triton_provider(
    numerics="moe_router/native",
    fn=moe_topk,
    version="1",
    extras={"backward": reference.moe_topk_backward},
)
