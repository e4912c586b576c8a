"""``triton`` provider of ``entropy``: the shared Triton vocabulary reduction of ``logp``.

Numerics (family ``entropy/triton-v1024``): exactly the kernels of
:mod:`rl_engine.ops.logp.triton` (same tiles, same lane sums, same segment combination, so the
same ``lse`` bits as ``logp``'s ``triton`` provider), which also keep
``u = sum_j exp(z_j - m) (z_j - m)`` with the same rescaling; ``entropy = log(s) - u / s``.
Backward: ``dlogits = grad * (-p * (z - lse + entropy)) / temperature`` (elementwise, ``p = 0``
columns give 0), one rounding to ``logits.dtype``. Row invariant, bitwise run to run. Not
promised: identity with the ``native`` family, across GPU models or Triton versions.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops.entropy import reference
from rl_engine.ops.logp.triton import (
    NUMERICS,
    check_device,
    vocab_backward,
    vocab_forward,
)

__all__ = ["PROVIDER", "entropy", "entropy_backward", "entropy_forward"]


def entropy_forward(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, lse)``, both fp32 [T]; see :func:`entropy`. The arguments are trusted
    (checked at the public entry)."""
    check_device(logits, "entropy")
    _, ent, lse = vocab_forward(logits, None, temperature, with_entropy=True)
    assert ent is not None
    return ent, lse


@signature_of(reference.entropy_backward)
def entropy_backward(*args: Any) -> torch.Tensor:
    """``grad * (-p * (z - lse + entropy)) / temperature`` in ``logits.dtype`` [T, V]."""
    logits, temperature, lse, entropy, grad = args
    check_device(logits, "entropy")
    return vocab_backward(
        logits,
        temperature,
        lse.float().contiguous(),
        entropy=entropy.float().contiguous(),
        grad_entropy=grad,
    )


@signature_of(reference.entropy)
def entropy(*args: Any) -> torch.Tensor:
    """Batch-invariant entropy of ``softmax(logits / temperature)`` per row, in Triton: fp32 [T]
    (nats). Takes the arguments of :func:`rl_engine.ops.entropy.reference.entropy`."""
    reference._check(*args)
    return entropy_forward(*args)[0]


PROVIDER = _triton.triton_provider(
    numerics=f"entropy/{NUMERICS}",
    fn=entropy,
    version="1",
    extras={"forward": entropy_forward, "backward": entropy_backward},
)
