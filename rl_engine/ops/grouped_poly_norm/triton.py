"""``triton`` provider of ``grouped_poly_norm``: PolyNorm-activated experts in three kernels.

Numerics (family ``grouped_poly_norm/triton-b{LANES}``, ``LANES`` = 256: the ``poly_norm``
Triton family ``poly_norm/triton-b{LANES}`` applied per expert; version ``1.<poly_norm's>``,
so it changes whenever poly_norm's Triton numerics do). Row ``n`` with expert ``e =
expert_ids[n]`` is bitwise ``fused_mul_poly_norm(gate[n], up[n], weight[e], bias[e], eps)`` of
:mod:`rl_engine.ops.poly_norm.triton`, forward and input gradients (dgate, dup): one program
per row runs poly_norm's own row helpers (``_fwd_row`` / ``_bwd_row``: the lane sums, trees
and elementwise passes of that module's docstring) with its expert's parameters loaded as
fp32, so a row's bits depend on that row, its expert's parameters and D only.

Parameter gradients: each row's backward program writes its four fp32 partials ``[p3, p2, p1,
t_b]`` (poly_norm's) at the row's place in the rows sorted stably by expert (rows of expert
``e`` in row order, at ``offs[e] .. offs[e + 1]``); one program per expert then sums its
rows' partials with poly_norm's row sum (``_sum_rows``: :func:`poly_norm.reference.sum_rows`'s
pairwise tree over the expert's rows zero-padded to a power of two). So dweight[e] / dbias[e]
are bitwise poly_norm's Triton ``dweight`` / ``dbias`` over the rows of expert ``e`` in row
order: deterministic, other experts' rows never enter, zero-gradient rows add exact zeros, and
an expert with no rows gets exact zeros. The sort and the offsets are integer torch ops
(``torch.sort(stable=True)``, ``searchsorted``): exact, no host synchronisation.

An expert id outside ``[0, E)`` is refused by the public entry on the CPU; on the GPU (where
checking would synchronise) such a row reads no parameter memory: its parameters load as NaN,
so its output and input gradients are NaN, and its partials fall outside every expert's range.

Not promised: the ``grouped_poly_norm/native`` family's bits (poly_norm's Triton and native
families differ in low bits; within the tolerance table). Launch setup (warps, blocks per
loop step) as :func:`rl_engine.ops.poly_norm.triton.launch_config`: speed only.

**Not yet run on a GPU** (2026-11-28): checked in the Triton interpreter, and compiled offline
for sm_90a (Triton 3.9 and its ptxas): no spills; the row kernels take poly_norm's registers at
the same setup (backward 95 at D = 768, 116 at D = 4160, bf16).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.grouped_poly_norm import reference
from rl_engine.ops.poly_norm import triton as pn

if triton is not None:
    from rl_engine.ops.poly_norm.triton import _bwd_row, _fwd_row, _sum_rows

__all__ = ["PROVIDER", "grouped_poly_norm", "grouped_poly_norm_backward"]

K_PARTS = 4  # partials per row: the three weights' and the bias'


if triton is not None:

    @triton.jit
    def _row_expert_params(W, B, IDS, E):
        # this program's row and the fp32 parameters of its expert (W [E, 3], B [E, 1]
        # contiguous), as poly_norm's _params loads them; an expert id outside [0, E) loads NaN
        # (no access out of bounds)
        row = tl.program_id(0).to(tl.int64)
        e = tl.load(IDS + row).to(tl.int64)
        ok = (e >= 0) & (e < E)
        w0 = tl.load(W + e * 3, mask=ok, other=float("nan")).to(tl.float32)
        w1 = tl.load(W + e * 3 + 1, mask=ok, other=float("nan")).to(tl.float32)
        w2 = tl.load(W + e * 3 + 2, mask=ok, other=float("nan")).to(tl.float32)
        b = tl.load(B + e, mask=ok, other=float("nan")).to(tl.float32)
        return row, w0, w1, w2, b

    @triton.jit
    def _grouped_poly_norm_fwd_kernel(
        X,
        MUL,
        Y,
        W,
        B,
        IDS,
        E,
        H,
        h_f,
        stride_x,
        stride_m,
        stride_y,
        eps,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
        UNROLL: tl.constexpr,
    ):
        row, w0, w1, w2, b = _row_expert_params(W, B, IDS, E)
        _fwd_row(X + row * stride_x, MUL + row * stride_m, Y + row * stride_y, w0, w1, w2, b,
                 H, h_f, eps, True, BLOCK, LOG_BLOCK, UNROLL)  # fmt: skip

    @triton.jit
    def _grouped_poly_norm_bwd_kernel(
        G,
        X,
        MUL,
        DX,
        DMUL,
        PART,
        POS,
        W,
        B,
        IDS,
        E,
        H,
        h_f,
        stride_g,
        stride_x,
        stride_m,
        stride_dx,
        stride_dm,
        eps,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
        UNROLL: tl.constexpr,
    ):
        row, w0, w1, w2, b = _row_expert_params(W, B, IDS, E)
        part = PART + tl.load(POS + row).to(tl.int64) * 4  # the row's place among its expert's
        _bwd_row(G + row * stride_g, X + row * stride_x, MUL + row * stride_m,
                 DX + row * stride_dx, DMUL + row * stride_dm, part, w0, w1, w2, b, H, h_f,
                 eps, True, BLOCK, LOG_BLOCK, UNROLL)  # fmt: skip

    @triton.jit
    def _grouped_poly_norm_sum_kernel(PART, TMP, OUT, OFFS, K: tl.constexpr,
                                      BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr,
                                      RBLOCK: tl.constexpr, LOG_RBLOCK: tl.constexpr):  # fmt: skip
        # OUT[e] = poly_norm's sum_rows of PART[OFFS[e]:OFFS[e + 1]] (expert e's rows in row
        # order); TMP: the same rows' K * m floats hold its levels in memory (half <= m). The
        # offsets within the expert's rows in int32, as poly_norm's (int64: 3x the registers)
        e = tl.program_id(0).to(tl.int64)
        start = tl.load(OFFS + e)
        m = (tl.load(OFFS + e + 1) - start).to(tl.int32)
        half = m * 0 + 1  # rows zero-padded to 2 * half (a power of two >= m; 2 for m < 2)
        while half * 2 < m:
            half = half * 2
        _sum_rows(PART + start * K, TMP + start * K, OUT + e * K, m, half, K, BLOCK, LOG_BLOCK,
                  RBLOCK, LOG_RBLOCK)  # fmt: skip


def _launch_fwd(gate, up, weight, bias, expert_ids, eps, cfg: pn.Config | None = None):
    _triton.check_device("grouped_poly_norm", gate)
    n, h = gate.shape
    cfg = pn.launch_config(h) if cfg is None else pn._checked(cfg)
    x2, m2 = _triton.rows(gate), _triton.rows(up)
    y = torch.empty(x2.shape, dtype=gate.dtype, device=gate.device)
    blk = pn.block_for(h, cfg.lanes)
    if n:
        with _triton.device_guard(gate):
            _triton.launcher(_grouped_poly_norm_fwd_kernel, gate.device)[(n,)](
                x2, m2, y, weight.contiguous(), bias.contiguous(), expert_ids.contiguous(),
                weight.shape[0], h, float(h), x2.stride(0), m2.stride(0), y.stride(0),
                float(eps), BLOCK=blk, LOG_BLOCK=blk.bit_length() - 1, UNROLL=cfg.unroll,
                num_warps=cfg.warps, enable_fp_fusion=False,
            )  # fmt: skip
    return y


def expert_order(expert_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos, offs)``: ``pos[n]`` the place of row ``n`` in the rows sorted stably by expert
    (int64 [N]); the rows of expert ``e`` are places ``offs[e] .. offs[e + 1]`` (int64 [E + 1]),
    in row order. Ids outside ``[0, E)`` sort outside every expert's range."""
    ids = expert_ids.contiguous()
    sorted_ids, order = torch.sort(ids, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(ids.shape[0], device=ids.device)
    bounds = torch.arange(n_experts + 1, dtype=ids.dtype, device=ids.device)
    return pos, torch.searchsorted(sorted_ids, bounds).to(torch.int64)


def sum_experts(part: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 [E, K]: row ``e`` is :func:`rl_engine.ops.poly_norm.triton.sum_rows` (bitwise
    :func:`poly_norm.reference.sum_rows`) of ``part[offs[e]:offs[e + 1]]`` (fp32 [M, K], K a
    power of two; ``offs`` int64 [E + 1], non-decreasing, on ``part``'s device), exact zeros
    for an empty range: one program per expert (:func:`_grouped_poly_norm_sum_kernel`)."""
    n_experts, k = offs.shape[0] - 1, part.shape[1]
    out = torch.zeros((n_experts, k), dtype=torch.float32, device=part.device)
    if n_experts and part.shape[0]:
        part = part.contiguous()
        with _triton.device_guard(part):
            _triton.launcher(_grouped_poly_norm_sum_kernel, part.device)[(n_experts,)](
                part, torch.empty_like(part), out, offs.contiguous(), K=k, BLOCK=pn._SUM_BLOCK,
                LOG_BLOCK=pn._SUM_BLOCK.bit_length() - 1, RBLOCK=pn._SUM_RBLOCK,
                LOG_RBLOCK=pn._SUM_RBLOCK.bit_length() - 1, num_warps=8,
            )  # fmt: skip
    return out


def _launch_bwd(grad, gate, up, weight, bias, expert_ids, eps, cfg: pn.Config | None = None):
    _triton.check_device("grouped_poly_norm", gate)
    n, h = gate.shape
    n_experts = weight.shape[0]
    cfg = pn.launch_config(h) if cfg is None else pn._checked(cfg)
    x2, m2, g2 = _triton.rows(gate), _triton.rows(up), _triton.rows(grad.to(gate.dtype))
    dx = torch.empty(x2.shape, dtype=gate.dtype, device=gate.device)
    dm = torch.empty(x2.shape, dtype=gate.dtype, device=gate.device)
    pos, offs = expert_order(expert_ids, n_experts)
    part = torch.empty((n, K_PARTS), dtype=torch.float32, device=gate.device)
    blk = pn.block_for(h, cfg.lanes)
    if n:
        w, b = weight.contiguous(), bias.contiguous()
        with _triton.device_guard(gate):
            _triton.launcher(_grouped_poly_norm_bwd_kernel, gate.device)[(n,)](
                g2, x2, m2, dx, dm, part, pos, w, b, expert_ids.contiguous(), n_experts, h,
                float(h), g2.stride(0), x2.stride(0), m2.stride(0), dx.stride(0), dm.stride(0),
                float(eps), BLOCK=blk, LOG_BLOCK=blk.bit_length() - 1, UNROLL=cfg.unroll,
                num_warps=cfg.warps, enable_fp_fusion=False,
            )  # fmt: skip
    sums = sum_experts(part, offs)
    # copies: the op's outputs must not alias each other
    return dx, dm, sums[:, :3].contiguous(), sums[:, 3:].contiguous()


@signature_of(reference.grouped_poly_norm)
def grouped_poly_norm(*args: Any) -> torch.Tensor:
    """``poly_norm(gate[n]) * up[n]`` with row ``n``'s expert's weights (module docstring); the
    public entry has checked the arguments (:func:`reference._check`)."""
    gate, up, weight, bias, expert_ids, eps = args
    return _launch_fwd(gate, up, weight, bias, expert_ids, eps)


@signature_of(reference.grouped_poly_norm_backward)
def grouped_poly_norm_backward(
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dgate, dup, dweight [E, 3] fp32, dbias [E, 1] fp32)`` as
    :func:`reference.grouped_poly_norm_backward`, in this family's bits (module docstring)."""
    grad, gate, up, weight, bias, expert_ids, eps = args
    return _launch_bwd(grad, gate, up, weight, bias, expert_ids, eps)


PROVIDER = _triton.triton_provider(
    numerics=f"grouped_poly_norm/triton-b{pn.LANES}",
    fn=grouped_poly_norm,
    version=f"1.{pn.PROVIDER.version}",
    extras={"backward": grouped_poly_norm_backward},
)
