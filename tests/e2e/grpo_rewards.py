"""Reward functions for tests/e2e/test_grpo.py (imported by the GRPO worker process)."""


def raise_on_second(prompt: list[int], completion: list[int]) -> float:
    """Scores the first sequence, raises on the second."""
    raise_on_second.calls = getattr(raise_on_second, "calls", 0) + 1
    if raise_on_second.calls == 2:
        raise ValueError("bad completion")
    return 0.0
