"""Verifiable rewards for the GRPO loop, and how a reward function is named and called.

A reward function is ``fn(prompt: list[int], completion: list[int]) -> float`` (token ids). The
CLI names one as ``band`` (built in) or ``package.module:function`` (imported in the worker).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

RewardFn = Callable[[list[int], list[int]], float]

__all__ = ["BUILTIN", "RewardError", "RewardFn", "band_reward", "resolve", "score"]


class RewardError(RuntimeError):
    """The reward function raised or returned a non-finite value; names the prompt."""

    def __init__(self, message: str, index: int, prompt: list[int]):
        super().__init__(message)
        self.index = index
        self.prompt = prompt


def band_reward(vocab_size: int, fraction: int = 8) -> RewardFn:
    """Reward = the fraction of completion tokens whose id lies in the lowest ``1/fraction`` of
    the vocabulary above the special ids (``3 <= id < 3 + vocab_size // fraction``).

    A random tiny model scores about ``1/fraction``; the policy gradient only has to shift the LM
    head's output mass, so a tiny model learns it in a few steps. Exact and cheap to verify.
    """
    lo, hi = 3, 3 + vocab_size // fraction

    def reward(prompt: list[int], completion: list[int]) -> float:
        if not completion:
            return 0.0
        return sum(lo <= t < hi for t in completion) / len(completion)

    reward.__name__ = f"band[{lo},{hi})"
    return reward


BUILTIN = ("band",)


def resolve(name: str, vocab_size: int) -> RewardFn:
    """``band`` or ``package.module:function`` -> the reward function."""
    if name == "band":
        return band_reward(vocab_size)
    if ":" not in name:
        raise ValueError(
            f"reward {name!r}: expected one of {', '.join(BUILTIN)} or 'package.module:function'"
        )
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward {name!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn


def score(fn: RewardFn, prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
    """Call ``fn`` on every (prompt, completion); stop at the first that raises or returns a
    non-finite / non-numeric value with a :class:`RewardError` naming that prompt."""
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        try:
            r = fn(p, c)
        except Exception as exc:
            raise RewardError(
                f"the reward function raised on sequence {i}, prompt {p} (completion {c}): "
                f"{type(exc).__name__}: {exc}",
                i,
                p,
            ) from exc
        try:
            value = float(r)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise RewardError(
                f"the reward function returned {r!r} (not a finite number) on sequence {i}, "
                f"prompt {p} (completion {c})",
                i,
                p,
            )
        out.append(value)
    return out
