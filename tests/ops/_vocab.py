"""Test pieces shared by the vocabulary ops (``logp``, ``entropy``, ``linear_logp``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rl_engine.ops.logp.reference import VOCAB_TILE

# [T, V] logits shapes: one row, a partial tile, exactly one tile, two tiles and one column, a real
# vocabulary (GPT-2's 50257), no rows
VOCAB_SHAPES = [(1, 7), (33, 1000), (17, VOCAB_TILE), (9, 2 * VOCAB_TILE + 1), (3, 50257), (0, 10)]


def forward_grid(test):
    """Parametrise a forward-numerics test over the grid of the vocabulary ops: ``dtype`` (every
    float dtype) x ``shape`` (:data:`VOCAB_SHAPES`) x ``temperature`` (1.0, 0.7)."""
    test = pytest.mark.parametrize("temperature", [1.0, 0.7])(test)
    test = pytest.mark.parametrize("shape", VOCAB_SHAPES)(test)
    return pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])(test)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten / custom op produces while active.

    ``by``: what "largest" means, ``"numel"`` (elements) or ``"nbytes"`` (bytes). The ``numel``,
    ``nbytes`` and ``shape`` attributes are those of that tensor (0, 0, () if none).
    """

    def __init__(self, by: str = "numel"):
        super().__init__()
        if by not in ("numel", "nbytes"):
            raise ValueError(f"LargestTensor: by must be 'numel' or 'nbytes', got {by!r}")
        self.by = by
        self.numel = 0
        self.nbytes = 0
        self.shape = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            size = t.numel() if self.by == "numel" else t.nbytes
            if size > getattr(self, self.by):
                self.numel, self.nbytes, self.shape = t.numel(), t.nbytes, tuple(t.shape)
        return out
