"""``triton`` provider of ``moe_combine``: the weighted slot-order sum in one kernel.

Numerics (family ``moe_combine/native``, the reference's: the two are bitwise equal, tested).
The reference is ``2k + 2`` torch kernels (a multiply and an add per slot, each over ``[T, H]``
fp32); this kernel does the same IEEE operations per element in one launch, floating-point
contraction switched off (``enable_fp_fusion=False``: each product rounds before its add)::

    acc = 0;  for s in 0..k-1: acc = acc + weights[t, s] * float(y[t, s, h])
    shared:   acc = acc + g * float(shared[t, h]),  g = sigmoid64(shared_gate[t]) rounded to fp32
    out = acc rounded to y.dtype

``sigmoid64`` is :func:`rl_engine.ops._math.sigmoid` (``1 / (1 + exp64(-x))`` in float64, the
``exp64`` of :mod:`rl_engine.ops.moe_router.triton`). Backward: the reference's (torch ops).
Each output element depends on its token's row alone; the tiles depend on ``H`` only.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.moe_combine import reference
from rl_engine.ops.moe_combine.reference import _check

__all__ = ["PROVIDER", "moe_combine"]

if triton is not None:
    from rl_engine.ops.moe_router.triton import _exp64

    @triton.jit
    def _moe_combine_kernel(
        y_ptr, w_ptr, sh_ptr, g_ptr, out_ptr, c_ptr, T, H,
        stride_yt, stride_ys, stride_yh, stride_wt, stride_ws, stride_sht, stride_shh,
        stride_gt, stride_ot, stride_oh,
        TOP_K: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, N_COEF: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < T
        mask = rmask[:, None] & (cols[None, :] < H)
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            w = tl.load(w_ptr + rows * stride_wt + s * stride_ws, mask=rmask, other=0.0)
            y = tl.load(
                y_ptr + rows[:, None] * stride_yt + s * stride_ys + cols[None, :] * stride_yh,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
            acc = acc + w[:, None] * y
        if SHARED:
            sh = tl.load(
                sh_ptr + rows[:, None] * stride_sht + cols[None, :] * stride_shh,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
            if GATED:
                x = tl.load(g_ptr + rows * stride_gt, mask=rmask, other=0.0).to(tl.float64)
                gate = (1.0 / (1.0 + _exp64(-x, c_ptr, N_COEF))).to(tl.float32)
                acc = acc + gate[:, None] * sh
            else:
                acc = acc + sh
        tl.store(
            out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_oh,
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@signature_of(reference.moe_combine)
def moe_combine(*args: Any) -> torch.Tensor:
    """Same contract and bits as :func:`rl_engine.ops.moe_combine.reference.moe_combine`
    (its arguments ``(y, weights, shared=None, shared_gate=None)``)."""
    from rl_engine.ops.moe_router.triton import _N_COEF, exp64_consts

    y, weights, shared, shared_gate = args
    _check(y, weights, shared, shared_gate)
    _triton.check_device("moe_combine", y)
    t, k, h = y.shape
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    sh = shared if shared is not None else out
    gt = shared_gate if shared_gate is not None else weights
    block_h = min(1024, 1 << max(0, h - 1).bit_length())
    block_t = max(1, min(16, 4096 // block_h))
    grid = (_triton.cdiv(t, block_t), _triton.cdiv(h, block_h))
    with _triton.device_guard(y):
        _triton.launcher(_moe_combine_kernel, y.device)[grid](
            y, weights, sh, gt, out, exp64_consts(y.device), t, h,
            y.stride(0), y.stride(1), y.stride(2), weights.stride(0), weights.stride(1),
            sh.stride(0), sh.stride(1), gt.stride(0), out.stride(0), out.stride(1),
            TOP_K=k, SHARED=shared is not None, GATED=shared_gate is not None,
            BLOCK_T=block_t, BLOCK_H=block_h, N_COEF=_N_COEF,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


PROVIDER = _triton.triton_provider(
    numerics="moe_combine/native",
    fn=moe_combine,
    version="1",
    extras={"backward": reference.moe_combine_backward},
)
