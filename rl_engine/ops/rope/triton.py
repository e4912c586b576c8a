"""``triton`` provider of ``rope``: rotary embedding with the tables computed inside the kernel.

Numerics (family ``rope/native-f64table``, the reference's: the two are bitwise equal, tested).
The kernel evaluates the reference's tables itself, with the same sequence of IEEE float64
operations as :func:`rl_engine.ops._math.cos_sin64` (floating-point contraction into FMAs is
switched off, ``enable_fp_fusion=False``, and every constant is loaded as an exact float64):

1. ``inv_freq`` [rotary_dim / 2]: :func:`rl_engine.ops.rope.reference.inv_freq_table` (Python
   floats, scaling included) copied once per (device, theta, rotary_dim, scaling) to a float64
   device table.
2. ``angle = float64(position) * inv_freq``; quadrant reduction with the 3-part pi/2 and the
   degree-22/23 Taylor polynomials of ``cos_sin64``; ``cos, sin`` rounded to fp32.
3. ``o1 = x1 * cos - x2 * sin``, ``o2 = x2 * cos + x1 * sin`` in fp32 (separate roundings, as
   torch's elementwise ops), one rounding to ``x.dtype``; channels past ``rotary_dim`` copied.

Backward is the same kernel with ``sin`` negated (the inverse rotation). A token's output
depends on its row of ``x``, its position and the parameters only; tiles (tokens x heads x
pairs) depend on the head shape only, never on the number of tokens.

Not promised: identity across GPU models or Triton versions beyond what the tests show. On the
CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops._triton import tl, triton  # None without Triton: the provider says why
from rl_engine.ops.rope import reference
from rl_engine.ops.rope.reference import _check, inv_freq_table

__all__ = [
    "PROVIDER",
    "RopeConfig",
    "get_config",
    "rope",
    "rope_backward",
    "rope_qk",
    "rope_qk_backward",
]


# The constants of ``_math.cos_sin64``, as exact float64 values (loaded by the kernel, so no
# compiler rounds them through fp32): [inv_pio2, pio2_1, pio2_2, pio2_3, 1/23!, 1/22!,
# 1/21!, 1/19!, ..., 1/1! (11 values), 1/20!, 1/18!, ..., 1/0! (11 values)].
_CONSTS: tuple[float, ...] = (
    6.36619772367581382433e-01,
    1.57079632673412561417e00,
    6.07710050630396597660e-11,
    2.02226624879595063154e-21,
    1.0 / math.factorial(23),
    1.0 / math.factorial(22),
    *(1.0 / math.factorial(k) for k in range(21, 0, -2)),
    *(1.0 / math.factorial(k) for k in range(20, -1, -2)),
)


@dataclass(frozen=True)
class RopeConfig:
    """Launch configuration; a function of (heads, head_dim, rotary_dim) only.

    Attributes:
        block_t: tokens per program.
        block_h: heads per tile (power of two >= heads).
        block_p: rotation pairs per tile (power of two >= rotary_dim / 2).
        block_c: pass-through channels per tile (power of two >= head_dim - rotary_dim, or 1).
        num_warps: warps per program.
    """

    block_t: int
    block_h: int
    block_p: int
    block_c: int
    num_warps: int


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def get_config(heads: int, head_dim: int, rotary_dim: int) -> RopeConfig:
    """Tiles of about 2048 rotation pairs; several tokens per program for small heads."""
    block_h = _pow2(heads)
    block_p = max(2, _pow2(rotary_dim // 2))
    block_c = max(1, _pow2(head_dim - rotary_dim))
    block_t = max(1, 2048 // (block_h * block_p))
    return RopeConfig(block_t, block_h, block_p, block_c, 8 if block_h * block_p >= 1024 else 4)


if triton is not None:

    @triton.jit
    def _rotate_heads(
        x_ptr, y_ptr, toks, tmask, pairs, pmask, cos, sin,
        stride_xt, stride_xh, stride_xd, stride_yt, stride_yh,
        NH: tl.constexpr, RD: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """The rotation of the ``NH`` heads of tokens ``toks`` (fp32, one rounding to y's dtype)."""
        HALF: tl.constexpr = RD // 2
        heads = tl.arange(0, BLOCK_H)
        mask = tmask[:, None, None] & (heads < NH)[None, :, None] & pmask[None, None, :]
        row = x_ptr + toks[:, None, None] * stride_xt + heads[None, :, None] * stride_xh
        out = y_ptr + toks[:, None, None] * stride_yt + heads[None, :, None] * stride_yh
        if IS_NEOX:
            i1 = pairs[None, None, :]
            i2 = pairs[None, None, :] + HALF
        else:
            i1 = 2 * pairs[None, None, :]
            i2 = 2 * pairs[None, None, :] + 1
        x1 = tl.load(row + i1 * stride_xd, mask=mask, other=0.0)
        x2 = tl.load(row + i2 * stride_xd, mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        o1 = x1f * cos - x2f * sin
        o2 = x2f * cos + x1f * sin
        tl.store(out + i1, o1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(out + i2, o2.to(y_ptr.dtype.element_ty), mask=mask)
        if RD < HD:  # partial rotary: the other channels pass through
            ch = RD + tl.arange(0, BLOCK_C)
            cmask = tmask[:, None, None] & (heads < NH)[None, :, None] & (ch < HD)[None, None, :]
            v = tl.load(row + ch[None, None, :] * stride_xd, mask=cmask, other=0.0)
            tl.store(out + ch[None, None, :], v, mask=cmask)

    @triton.jit
    def _rope_fwd_kernel(
        x_ptr,
        x2_ptr,
        pos_ptr,
        inv_ptr,
        c_ptr,
        y_ptr,
        y2_ptr,
        T,
        stride_xt,
        stride_xh,
        stride_xd,
        stride_yt,
        stride_yh,
        stride_x2t,
        stride_x2h,
        stride_x2d,
        stride_y2t,
        stride_y2h,
        NH: tl.constexpr,
        NH2: tl.constexpr,
        RD: tl.constexpr,
        HD: tl.constexpr,
        IS_NEOX: tl.constexpr,
        INVERSE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_H2: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
        INT64: tl.constexpr,
    ):
        # NH2 > 0: a second tensor (k next to q) at the same positions, rotated with the same
        # tables in the same program (one launch, the tables computed once).
        HALF: tl.constexpr = RD // 2
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        if INT64:
            toks = toks.to(tl.int64)
        tmask = toks < T
        pairs = tl.arange(0, BLOCK_P)
        pmask = pairs < HALF
        # ---- the tables: _math.cos_sin64 step by step (float64, no contraction) ----
        pos = tl.load(pos_ptr + toks, mask=tmask, other=0).to(tl.int64).to(tl.float64)
        inv = tl.load(inv_ptr + pairs, mask=pmask, other=0.0)
        a = pos[:, None] * inv[None, :]
        n = tl.floor(a * tl.load(c_ptr) + 0.5)
        r = ((a - n * tl.load(c_ptr + 1)) - n * tl.load(c_ptr + 2)) - n * tl.load(c_ptr + 3)
        r2 = r * r
        s = tl.zeros_like(r) + tl.load(c_ptr + 4)
        c = tl.zeros_like(r) + tl.load(c_ptr + 5)
        for k in tl.static_range(11):
            s = s * (-r2) + tl.load(c_ptr + 6 + k)
        for k in tl.static_range(11):
            c = c * (-r2) + tl.load(c_ptr + 17 + k)
        s = s * r
        q = n - 4.0 * tl.floor(n * 0.25)
        cos64 = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
        sin64 = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
        cos = cos64.to(tl.float32)
        sin = sin64.to(tl.float32)
        if INVERSE:
            sin = -sin
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        # ---- the rotation, fp32 ----
        _rotate_heads(
            x_ptr, y_ptr, toks, tmask, pairs, pmask, cos, sin,
            stride_xt, stride_xh, stride_xd, stride_yt, stride_yh,
            NH, RD, HD, IS_NEOX, BLOCK_H, BLOCK_C,
        )  # fmt: skip
        if NH2 > 0:
            _rotate_heads(
                x2_ptr, y2_ptr, toks, tmask, pairs, pmask, cos, sin,
                stride_x2t, stride_x2h, stride_x2d, stride_y2t, stride_y2h,
                NH2, RD, HD, IS_NEOX, BLOCK_H2, BLOCK_C,
            )  # fmt: skip


_tables: dict[tuple[Any, ...], torch.Tensor] = {}


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``: a cached launcher for CUDA tensors, interpreted for CPU tensors."""
    return _triton.launcher(globals()[name], device)


def _table(key: tuple[Any, ...], values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A float64 device copy of ``values``, made once (so a CUDA-graph replay copies nothing)."""
    full = (str(device), *key)
    t = _tables.get(full)
    if t is None:
        t = _tables[full] = torch.tensor(values, dtype=torch.float64, device=device)
    return t


def _check_device(t: torch.Tensor) -> None:
    _triton.check_device("rope", t)


_guard = _triton.device_guard


def _rope(
    x, positions, theta, rotary_dim, is_neox, scaling, *, inverse: bool, x2=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y`` (and ``y2`` for a second tensor ``x2`` of the same tokens and head dim)."""
    rotary_dim, canon = _check(x, positions, theta, rotary_dim, is_neox, scaling)
    _check_device(x)
    t, nh, hd = x.shape
    y = torch.empty((t, nh, hd), dtype=x.dtype, device=x.device)
    nh2 = 0
    y2 = None
    if x2 is not None:
        _check(x2, positions, theta, rotary_dim, is_neox, scaling)
        if x2.shape[0] != t or x2.shape[2] != hd or x2.dtype != x.dtype or x2.device != x.device:
            raise ValueError(
                f"rope: k {tuple(x2.shape)} {x2.dtype} does not go with q {tuple(x.shape)} "
                f"{x.dtype} (same tokens, head dim, dtype and device)"
            )
        nh2 = x2.shape[1]
        y2 = torch.empty((t, nh2, hd), dtype=x2.dtype, device=x2.device)
    if y.numel() == 0 and (y2 is None or y2.numel() == 0):
        return y, y2
    inv = _table(
        ("inv", float(theta), rotary_dim, canon),
        inv_freq_table(float(theta), rotary_dim, canon),
        x.device,
    )
    consts = _table(("consts",), _CONSTS, x.device)
    cfg = get_config(nh + nh2, hd, rotary_dim)
    spans = [sum((s - 1) * abs(st) for s, st in zip(x.shape, x.stride())), y.numel()]
    reach = [cfg.block_t * y.stride(0)]
    x2_args: tuple[Any, ...] = (x, y, 0, 0, 0, 0, 0)  # unused (NH2 = 0)
    if x2 is not None:
        spans += [sum((s - 1) * abs(st) for s, st in zip(x2.shape, x2.stride())), y2.numel()]
        reach.append(cfg.block_t * y2.stride(0))
        x2_args = (x2, y2, x2.stride(0), x2.stride(1), x2.stride(2), y2.stride(0), y2.stride(1))
    with _guard(x):
        _kernel("_rope_fwd_kernel", x.device)[(_triton.cdiv(t, cfg.block_t),)](
            x,
            x2_args[0],
            positions,
            inv,
            consts,
            y,
            x2_args[1],
            t,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            y.stride(0),
            y.stride(1),
            *x2_args[2:],
            NH=nh,
            NH2=nh2,
            RD=rotary_dim,
            HD=hd,
            IS_NEOX=is_neox,
            INVERSE=inverse,
            BLOCK_T=cfg.block_t,
            BLOCK_H=_pow2(nh),
            BLOCK_H2=_pow2(nh2) if nh2 else 1,
            BLOCK_P=cfg.block_p,
            BLOCK_C=cfg.block_c,
            INT64=max(spans) + max(reach) >= _triton.INT32_MAX,
            num_warps=cfg.num_warps,
            enable_fp_fusion=False,
        )
    return y, y2


@signature_of(reference.rope)
def rope(*args: Any) -> torch.Tensor:
    """Batch-invariant rotary embedding on the GPU (Triton); bitwise equal to the reference.

    Args:
        x: [T, heads, head_dim] float32 / bfloat16 / float16, any strides.
        positions: [T] int32 / int64.
        theta: the RoPE base.
        rotary_dim: rotated channels (even, <= head_dim; default head_dim).
        is_neox: rotate-half layout (True) or GPT-J interleaved pairs (False).
        scaling: None or a Hugging Face ``rope_scaling`` dict (``default``, ``linear``,
            ``llama3``).

    Returns:
        [T, heads, head_dim] in ``x.dtype``.
    """
    return _rope(*args, inverse=False)[0]


@signature_of(reference.rope_backward)
def rope_backward(*args: Any) -> torch.Tensor:
    """Gradient w.r.t. ``x``: the inverse rotation of ``grad`` [T, heads, head_dim]."""
    return _rope(*args, inverse=True)[0]


@signature_of(reference.rope_qk)
def rope_qk(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope` of ``q`` [T, Hq, D] and ``k`` [T, Hk, D] at the same positions in one launch
    (the tables computed once per token); each output bitwise equal to its own :func:`rope`."""
    q, k, *params = args
    return _rope(q, *params, inverse=False, x2=k)


@signature_of(reference.rope_backward, "grad_q", "grad_k", replaces=1)
def rope_qk_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_backward` of both gradients in one launch."""
    grad_q, grad_k, *params = args
    return _rope(grad_q, *params, inverse=True, x2=grad_k)


PROVIDER = _triton.triton_provider(
    numerics="rope/native-f64table",
    fn=rope,
    version="1",
    extras={"backward": rope_backward, "qk": rope_qk, "qk_backward": rope_qk_backward},
)
