"""Bitwise invariance checkers (``torch.equal``) used by the tests and by ``rl-engine check``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Row counts that every row-invariance check visits: k=1, odd counts, and counts around the
# thresholds that configs switch at (powers of two up to 256, plus 255 / 300).
ROW_COUNTS = (1, 2, 17, 31, 33, 64, 65, 127, 128, 129, 199, 255, 256, 257, 300)


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    ne = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    idx = ne.nonzero()
    if idx.numel() == 0:
        return "equal"
    first = tuple(idx[0].tolist())
    return f"{idx.shape[0]} elements differ, first at {first}: {a[first].item()!r} vs {b[first].item()!r}"


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: not bitwise equal: {first_mismatch(a, b)}")


def check_row_invariance(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    counts: Sequence[int] = ROW_COUNTS,
    what: str = "op",
) -> None:
    """``f(x)[:k] == f(x[:k])`` for every k in ``counts`` (<= len(x)), zero-padding rows,
    a chunked launch and a run-to-run repeat. ``f`` maps [rows, ...] -> [rows, ...]."""
    full = f(x)
    assert_bitwise(f(x), full, f"{what}: run-to-run")
    n = x.shape[0]
    for k in counts:
        if k <= n:
            assert_bitwise(f(x[:k]), full[:k], f"{what}: first {k} of {n} rows")
    # the last row alone (a row's position must not matter)
    assert_bitwise(f(x[n - 1 :]), full[n - 1 :], f"{what}: last row alone")
    # zero padding rows appended
    padded = torch.cat([x, torch.zeros_like(x[: min(n, 7)])])
    assert_bitwise(f(padded)[:n], full, f"{what}: with zero-padding rows")
    # chunked launches of uneven sizes
    parts, i, step = [], 0, 1
    while i < n:
        parts.append(f(x[i : i + step]))
        i += step
        step = step * 2 + 1
    assert_bitwise(torch.cat(parts), full, f"{what}: chunked launches")
