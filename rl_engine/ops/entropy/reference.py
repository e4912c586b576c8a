"""PyTorch reference of ``entropy`` (the ``native`` provider): the spec of the op.

Numerics (family ``entropy/native-v1024``): the tiled online reduction of
:class:`rl_engine.ops.logp.reference.VocabLogSumExp` (same tiles, same order, same ``lse`` bits
as ``logp``), which also keeps ``u = sum_j exp(z_j - m) (z_j - m)`` with the same rescaling, and
``entropy = log(s) - u / s``, where ``z = logits.float() / temperature``. Row invariant by
construction (elementwise ops, ``amax`` and ``tree_sum`` only).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import check_float, check_tensor
from rl_engine.ops.logp.reference import (
    VocabLogSumExp,
    check_temperature,
    dlogits,
    temperature_tensor,
)

__all__ = ["entropy", "entropy_backward", "entropy_forward"]


def _check(logits: Any, temperature: Any) -> None:
    check_tensor("logits", logits, dims=2)
    check_float("logits", logits)
    check_temperature(temperature)
    if logits.shape[1] == 0:
        raise ValueError("logits has an empty vocabulary dimension (shape [T, 0])")


def entropy_forward(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, lse)``, both fp32 [T]; see :func:`entropy`. The arguments are trusted:
    checked once at the public entry (the op's ``_run``, or :func:`entropy`)."""
    temp = temperature_tensor(temperature, logits.device)
    state = VocabLogSumExp(logits.shape[0], logits.device, with_entropy=True)
    state.add(logits, temp)
    lse, ent = state.lse_and_entropy()
    return ent, lse


def entropy_backward(
    logits: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad: torch.Tensor,
) -> torch.Tensor:
    """``grad * (-p * (z - lse + entropy)) / temperature`` in ``logits.dtype`` [T, V]."""
    return dlogits(logits, temperature, lse, entropy=entropy, grad_entropy=grad.float())


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row.

    Equivalent to ``-(p * log p).sum(-1)`` with ``p = softmax(logits.float() / temperature)``,
    computed with the tiled online reduction of the module docstring.

    Args:
        logits: [T, V] float32 / bfloat16 / float16, any strides.
        temperature: Python float > 0.

    Returns:
        fp32 [T] (nats).
    """
    _check(logits, temperature)
    return entropy_forward(logits, temperature)[0]
