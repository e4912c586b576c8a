"""PyTorch reference of ``rope`` (the ``native`` provider): the spec of the op.

Numerics (family ``rope/native``). The cos / sin tables are computed inside the op from
``(positions, theta, rotary_dim, scaling)`` so that every engine uses the same ones:

1. ``inv_freq[i] = 1 / theta ** (2 i / rotary_dim)`` for ``i < rotary_dim / 2`` in float64 (Python
   floats: the same table on every device), then the scaling of ``scaling["rope_type"]``:
   ``default`` none; ``linear`` ``inv_freq / factor``; ``llama3`` the Llama 3.1 rule (wavelengths
   longer than ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``,
   shorter than ``original_max_position_embeddings / high_freq_factor`` kept, smooth
   interpolation between).
2. ``angle = positions.double()[:, None] * inv_freq``; ``cos, sin = _math.cos_sin64(angle)``
   rounded to fp32.
3. Rotation of the first ``rotary_dim`` channels in fp32, one rounding to ``x.dtype``; the other
   channels pass through unchanged. NeoX / rotate-half layout (``is_neox=True``; Llama / Qwen in
   Hugging Face and vLLM) pairs channel ``i`` with ``i + rotary_dim / 2``; GPT-J layout
   (``is_neox=False``) pairs channels ``2i`` and ``2i + 1``. For a pair ``(x1, x2)`` and
   frequency ``i``: ``o1 = x1 * cos - x2 * sin``, ``o2 = x2 * cos + x1 * sin``.

Backward is the inverse rotation (``sin`` negated), in fp32 with one rounding; ``positions`` has
no gradient. Only elementwise tensor operations are used: a token's output depends on its row of
``x``, its position and the parameters only (row invariant by construction).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rl_engine.ops._common import check_float, check_same_device, check_tensor, signature_of
from rl_engine.ops._math import cos_sin64

ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}
# keys of a Hugging Face rope dict that carry no scaling information of their own (checked below)
_TOLERATED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")

# canonical scaling: (rope_type, factor, low_freq_factor, high_freq_factor, original_max_pos)
Canonical = tuple[str, float, float, float, int]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def canonical_scaling(
    scaling: Mapping[str, Any] | None, *, theta: float, head_dim: int, rotary_dim: int
) -> Canonical:
    """Validate a Hugging Face ``rope_scaling`` dict and reduce it to its numeric content."""
    if scaling is None:
        return ("default", 1.0, 0.0, 0.0, 0)
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope: scaling must be None or a dict, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope: rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    unknown = sorted(set(scaling) - set(_REQUIRED[rope_type]) - set(_TOLERATED))
    if unknown:
        raise ValueError(f"rope: scaling keys {unknown} are not supported for {rope_type!r}")
    missing = [k for k in _REQUIRED[rope_type] if k not in scaling]
    if missing:
        raise ValueError(f"rope: scaling of type {rope_type!r} needs {missing}")
    for k in _REQUIRED[rope_type]:
        if not _is_number(scaling[k]) or not math.isfinite(scaling[k]) or scaling[k] <= 0:
            raise ValueError(
                f"rope: scaling[{k!r}] must be a finite number > 0, got {scaling[k]!r}"
            )
    if "rope_theta" in scaling and float(scaling["rope_theta"]) != float(theta):
        raise ValueError(f"rope: scaling['rope_theta']={scaling['rope_theta']} != theta={theta}")
    if "partial_rotary_factor" in scaling:
        expect = int(head_dim * scaling["partial_rotary_factor"])
        if expect != rotary_dim:
            raise ValueError(
                f"rope: scaling['partial_rotary_factor'] gives rotary_dim {expect}, the call "
                f"uses {rotary_dim}"
            )
    if rope_type == "default":
        return ("default", 1.0, 0.0, 0.0, 0)
    if rope_type == "linear":
        return ("linear", float(scaling["factor"]), 0.0, 0.0, 0)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    if not high > low:
        raise ValueError(
            f"rope: llama3 needs high_freq_factor > low_freq_factor, got {high}, {low}"
        )
    orig = scaling["original_max_position_embeddings"]
    if not isinstance(orig, int) and not (isinstance(orig, float) and orig.is_integer()):
        raise ValueError(f"rope: original_max_position_embeddings must be an int, got {orig!r}")
    return ("llama3", float(scaling["factor"]), low, high, int(orig))


def scaling_dict(canon: Canonical) -> dict[str, Any] | None:
    """Inverse of :func:`canonical_scaling` (the custom op passes scalars, providers get a dict)."""
    rope_type, factor, low, high, orig = canon
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


@functools.lru_cache(maxsize=128)
def inv_freq_table(theta: float, rotary_dim: int, canon: Canonical) -> tuple[float, ...]:
    """The float64 inverse frequencies [rotary_dim / 2] (Python floats; see module docstring)."""
    inv = [1.0 / theta ** ((2 * i) / rotary_dim) for i in range(rotary_dim // 2)]
    rope_type, factor, low, high, orig = canon
    if rope_type == "linear":
        inv = [f / factor for f in inv]
    elif rope_type == "llama3":
        low_wavelen = orig / low
        high_wavelen = orig / high
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (orig / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    return tuple(inv)


def _check(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int | None,
    is_neox: bool,
    scaling: Mapping[str, Any] | None,
) -> tuple[int, Canonical]:
    """Validate the arguments; return ``(rotary_dim, canonical scaling)``."""
    check_tensor("x", x, dims=3)
    check_tensor("positions", positions, dims=1)
    check_float("x", x)
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"rope: positions must be int32 or int64, got {positions.dtype}")
    check_same_device(x=x, positions=positions)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(
            f"rope: positions has {positions.shape[0]} entries, x has {x.shape[0]} tokens"
        )
    if not _is_number(theta) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope: theta must be a finite number > 0, got {theta!r}")
    head_dim = x.shape[2]
    if rotary_dim is None:
        rotary_dim = head_dim
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise TypeError(f"rope: rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(
            f"rope: rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}"
        )
    if not isinstance(is_neox, bool):
        raise TypeError(f"rope: is_neox must be a bool, got {type(is_neox).__name__}")
    canon = canonical_scaling(scaling, theta=theta, head_dim=head_dim, rotary_dim=rotary_dim)
    return rotary_dim, canon


def check_positions(positions: torch.Tensor) -> None:
    """Every position >= 0 (a negative one would rotate by a negative angle: no engine's table
    has it). Called once, at the public entry. CPU tensors in eager mode: checked at once
    (``ValueError``). Accelerator tensors, and any under ``torch.compile``: a device-side assert
    with ``RL_ENGINE_DEVICE_CHECKS=1`` (a host check would synchronise the stream once per layer,
    or break the graph), else nothing."""
    from rl_engine import config

    if positions.numel() == 0:
        return
    msg = "rope: positions must be >= 0"
    if positions.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool((positions < 0).any()):
            raise ValueError(f"{msg}; got min {int(positions.min())}")
    elif config.settings().device_checks:
        torch._assert_async((positions >= 0).all(), msg)


def cos_sin(
    positions: torch.Tensor, theta: float, rotary_dim: int, canon: Canonical
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` [T, rotary_dim / 2] for the given positions."""
    inv = torch.tensor(
        inv_freq_table(float(theta), rotary_dim, canon),
        dtype=torch.float64,
        device=positions.device,
    )
    angle = positions.to(torch.float64)[:, None] * inv[None, :]
    c, s = cos_sin64(angle)
    return c.to(torch.float32), s.to(torch.float32)


def rotate_pairs(
    xr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    """The rotation of the rotated channels ``xr`` [T, heads, rotary_dim] in ``xr``'s dtype,
    ``cos`` / ``sin`` [T, 1, rotary_dim / 2]: ``o1 = x1 * cos - x2 * sin``,
    ``o2 = x2 * cos + x1 * sin`` for the pairs of the layout (see the module docstring)."""
    if is_neox:
        h = rotary_dim // 2
        x1, x2 = xr[..., :h], xr[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = xr[..., 0::2], xr[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rotary_dim].float()
    out = rotate_pairs(xr, cos, sin, rotary_dim, is_neox).to(x.dtype)
    if rotary_dim < x.shape[-1]:
        out = torch.cat([out, x[..., rotary_dim:]], dim=-1)
    return out


def _rope(x, positions, theta, rotary_dim, is_neox, scaling, *, inverse: bool) -> torch.Tensor:
    rotary_dim, canon = _check(x, positions, theta, rotary_dim, is_neox, scaling)
    c, s = cos_sin(positions, theta, rotary_dim, canon)
    return _rotate(x, c, -s if inverse else s, rotary_dim, is_neox)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    scaling: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Batch-invariant rotary position embedding of ``q`` or ``k``.

    Equivalent to Hugging Face's ``apply_rotary_pos_emb`` (``is_neox=True``) or the GPT-J
    interleaved rotation (``is_neox=False``) with float64 tables rounded to fp32 and the rotation
    in fp32.

    Args:
        x: [T, heads, head_dim] float32 / bfloat16 / float16, any strides.
        positions: [T] int32 / int64 token positions.
        theta: the RoPE base.
        rotary_dim: rotated channels (even, <= head_dim; default head_dim). The remaining
            channels pass through unchanged (partial rotary).
        is_neox: rotate-half layout (True) or GPT-J interleaved pairs (False).
        scaling: None or a Hugging Face ``rope_scaling`` dict of ``rope_type`` ``default``,
            ``linear`` (``factor``) or ``llama3`` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``).

    Returns:
        [T, heads, head_dim] in ``x.dtype``.
    """
    return _rope(x, positions, theta, rotary_dim, is_neox, scaling, inverse=False)


@signature_of(rope, "grad", replaces=1)
def rope_backward(*args: Any) -> torch.Tensor:
    """Gradient w.r.t. ``x``: the inverse rotation of ``grad`` [T, heads, head_dim] (the other
    arguments as :func:`rope`'s)."""
    return _rope(*args, inverse=True)


def on_q_and_k(
    fn: Callable[..., torch.Tensor], names: tuple[str, str] = ("q", "k")
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The two-tensor form of a one-tensor ``rope`` function: ``(fn(q, ...), fn(k, ...))`` with
    the same positions and parameters (the spec of the fused ``rope_qk``); its signature is
    ``fn``'s with ``names`` for the one tensor (what a provider's ``rope_qk`` takes; its
    ``rope_qk_backward`` takes ``grad_q, grad_k``)."""

    @signature_of(fn, *names, replaces=1)
    def both(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, *params = args
        return fn(q, *params), fn(k, *params)

    both.__name__ = f"{fn.__name__}_qk"
    both.__doc__ = f"``{fn.__name__}`` of ``q`` and of ``k`` (same positions and parameters)."
    return both


rope_qk = on_q_and_k(rope)
rope_qk_backward = on_q_and_k(rope_backward, ("grad_q", "grad_k"))
