"""Elementwise transcendental functions with a fixed sequence of IEEE operations.

Why: on the CPU, PyTorch evaluates a contiguous elementwise op with SIMD code for most elements
and with scalar code for the tail of the buffer (and of each thread's share of it). For some
functions the two differ in the last bit (``torch.sigmoid`` / ``F.silu`` were seen to), so the
value computed for one element would depend on the tensor's total size: not batch invariant.

These functions use only ``+ - * /``, ``floor``, comparisons, ``where`` and exact integer bit
manipulation, each an exactly-rounded IEEE operation that SIMD and scalar code compute
identically. They evaluate in float64 and round once to float32, so they are also accurate (the
float64 polynomials are good to a few float64 ulps). Every reference provider uses them for
``exp`` / ``log`` / ``sigmoid`` / ``cos`` / ``sin``; nothing here depends on any other element.
"""

from __future__ import annotations

import math

import torch

_LN2_HI = 6.93147180369123816490e-01  # fdlibm split of ln 2
_LN2_LO = 1.90821492927058770002e-10
_LOG2E = 1.4426950408889634
# exp(r) for |r| <= ln2/2: Taylor to degree 13 (error < 1e-17 relative)
_EXP_COEF = [1.0 / math.factorial(i) for i in range(13, -1, -1)]


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n for integer-valued float64 ``n`` in [-1022, 1023], exactly, via the exponent bits."""
    bits = (n.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a float64 tensor (float64 result). -inf -> 0, +inf -> inf, nan -> nan."""
    x = x.to(torch.float64)
    xc = x.clamp(-740.0, 709.0)
    n = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[0])
    for c in _EXP_COEF[1:]:
        p = p * r + c
    # split the scale so that 2**n never leaves the normal range (subnormal results stay exact)
    n1 = torch.floor(n * 0.5)
    y = p * _pow2(n1) * _pow2(n - n1)
    y = torch.where(x > 709.0, torch.full_like(y, math.inf), y)
    y = torch.where(x < -740.0, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp`` rounded to float32 (input any float dtype)."""
    return exp64(x).to(torch.float32)


_SQRT_HALF = 0.70710678118654752440


def log64(x: torch.Tensor) -> torch.Tensor:
    """``log`` of a float64 tensor (float64 result). 0 -> -inf, inf -> inf, <0 / nan -> nan."""
    x = x.to(torch.float64)
    xs = torch.where(x > 0, x, torch.ones_like(x))
    xs = torch.where(torch.isinf(xs), torch.ones_like(xs), xs)
    # subnormals: scale up so the exponent field is exact
    small = xs < 2.2250738585072014e-308
    xs = torch.where(small, xs * 18014398509481984.0, xs)  # * 2**54
    bits = xs.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1022
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FE0000000000000).view(torch.float64)  # [0.5, 1)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = torch.where(low, e - 1, e).to(torch.float64)
    e = torch.where(small, e - 54.0, e)
    # log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, 1.0 / 31.0)
    for k in range(29, 0, -2):
        p = p * s2 + 1.0 / k
    y = 2.0 * s * p
    y = (e * _LN2_HI + y) + e * _LN2_LO
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(torch.isposinf(x), torch.full_like(y, math.inf), y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, math.nan), y)


def log(x: torch.Tensor) -> torch.Tensor:
    """``log`` rounded to float32."""
    return log64(x).to(torch.float32)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` rounded to float32."""
    return (1.0 / (1.0 + exp64(-x.to(torch.float64)))).to(torch.float32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` in float64, rounded once to float32."""
    x64 = x.to(torch.float64)
    return (x64 / (1.0 + exp64(-x64))).to(torch.float32)


_PIO2_1 = 1.57079632673412561417e00  # fdlibm 3-part split of pi/2
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624879595063154e-21
_INV_PIO2 = 6.36619772367581382433e-01


def cos_sin64(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of float64 angles (|angle| up to ~1e9 keeps ~1e-9 absolute accuracy)."""
    a = angle.to(torch.float64)
    n = torch.floor(a * _INV_PIO2 + 0.5)
    r = ((a - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3  # |r| <= pi/4
    r2 = r * r
    # Taylor series to degree 22 / 23: error < 1e-17 on |r| <= pi/4
    s = torch.full_like(r, 1.0 / math.factorial(23))
    c = torch.full_like(r, 1.0 / math.factorial(22))
    for k in range(21, 0, -2):
        s = s * (-r2) + 1.0 / math.factorial(k)
    for k in range(20, -1, -2):
        c = c * (-r2) + 1.0 / math.factorial(k)
    s = s * r
    q = n - 4.0 * torch.floor(n * 0.25)  # quadrant 0..3
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    return cos, sin
