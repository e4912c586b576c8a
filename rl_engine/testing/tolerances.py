"""Central tolerance table: provider output vs a float64 evaluation of the same math.

One justification per row. Forward tolerances are for the op's output dtype; "scaled" rows grow
with the reduction length as ``sqrt(K / 1024)`` (random-walk growth of fp32 rounding), never less
than the base value.
"""

from __future__ import annotations

import math

import torch

# dtype -> (rtol, atol)
FORWARD = {
    # fp32 output, fp32 accumulation: error is a few ulps of the largest partial sums.
    torch.float32: (1e-5, 1e-5),
    # bf16 output: one final rounding (2^-8 relative) dominates; atol for values near zero.
    torch.bfloat16: (1e-2, 1e-2),
    # fp16 output: one final rounding (2^-11 relative); atol for values near zero.
    torch.float16: (1e-3, 1e-3),
}

GRAD = {
    # fp32 gradients: two chained fp32 reductions.
    torch.float32: (1e-4, 1e-4),
    # bf16 gradients: inputs to the backward GEMMs are themselves bf16-rounded.
    torch.bfloat16: (2e-2, 5e-2),
    # fp16 gradients: as bf16 with three more mantissa bits.
    torch.float16: (5e-3, 1e-2),
}

# Ops whose result is fp32 whatever the input dtype (logp, entropy, ratio_kl, grpo_loss): the
# input is exact in fp32, only the fp32 math rounds.
FP32_OUT = (1e-5, 1e-5)


def tolerance(
    dtype: torch.dtype, *, grad: bool = False, k: int | None = None
) -> tuple[float, float]:
    """(rtol, atol) for ``dtype``; scaled by reduction length ``k`` when given."""
    rtol, atol = (GRAD if grad else FORWARD)[dtype]
    if k is not None and k > 1024:
        s = math.sqrt(k / 1024)
        rtol, atol = rtol * s, atol * s
    if k is not None and dtype == torch.float32 and not grad:
        # An fp32 dot product of K unit-scale products has partial sums of size ~sqrt(K), each
        # addition rounding by up to half an ulp of the partial: the absolute error of the final
        # value grows like K * 2^-24 in the worst case seen on random data (e.g. 2.7e-5 at
        # K = 760), independent of how small the final value is. atol covers 2x that.
        atol = max(atol, 2.0 * k * 2.0**-24)
    return rtol, atol


# elements compared per step: float64 copies of a chunk, not of the whole tensor (GPU shards of
# the fuzzer share one device's memory)
_CHUNK = 1 << 22


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, what: str = ""
) -> None:
    """``torch.testing.assert_close`` on float64 copies, with max / mean abs error in the message.

    Elementwise, so it runs on ``actual``'s device over chunks of ``_CHUNK`` elements: every
    step is exact in float64 (the same verdict on any device and in any chunking); a GPU case of
    10^8 elements moves nothing through host memory and holds a few float64 chunks, not copies of
    the whole tensors. (With whole-tensor float64 copies on the GPU, four cases of a fuzz run
    with 14 shards per H100 stopped inside torch's comparison: ``tests/test_fuzz.py``,
    ``COMPARE_SEEDS``.)"""
    a = actual.detach()
    e = expected.detach().to(device=a.device)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
    fa, fe = a.reshape(-1), e.reshape(-1)
    n = fa.numel()
    for i in range(0, n, _CHUNK):
        ca, ce = fa[i : i + _CHUNK].double(), fe[i : i + _CHUNK].double()
        try:
            torch.testing.assert_close(ca, ce, rtol=rtol, atol=atol)
        except AssertionError as exc:
            maxes, total = [], 0.0
            for j in range(0, n, _CHUNK):
                d = (fa[j : j + _CHUNK].double() - fe[j : j + _CHUNK].double()).abs()
                maxes.append(d.max())
                total += float(d.sum())
            worst = float(torch.stack(maxes).max())  # a NaN stays a NaN
            raise AssertionError(
                f"{what}: max |err| {worst:.3e}, mean |err| {total / n:.3e} (rtol={rtol}, "
                f"atol={atol}); in elements {i}..{min(i + _CHUNK, n) - 1} of the flattened "
                f"tensors: {exc}"
            ) from None
