"""``entropy``: batch-invariant entropy of ``softmax(logits / T)`` per row, in fp32.

Custom ops: ``rl_engine::entropy(logits, temperature, provider) -> (entropy, lse)`` (``lse`` is
saved for the backward and is not differentiable) and
``rl_engine::entropy_backward(logits, temperature, lse, entropy, grad, provider) -> dlogits``.
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import lse_reduction_ops, register_op, register_triton, registry_entry
from rl_engine.ops.entropy import reference, stock
from rl_engine.ops.logp import on_logit_rows
from rl_engine.ops.logp.reference import VOCAB_TILE

__all__ = ["entropy"]


_entropy_op, _entropy_backward_op = lse_reduction_ops(
    "entropy",
    reference.entropy_forward,
    reference.entropy_backward,
    reference._check,
    saves_value=True,
)


def _run(logits, temperature, provider: str) -> torch.Tensor:
    """The op through ``provider`` on :func:`entropy`'s [T, V] arguments (checked here)."""
    reference._check(logits, temperature)
    return _entropy_op(logits, float(temperature), provider)[0]


def entropy(
    logits: torch.Tensor, temperature: float = 1.0, *, backend: str | None = None
) -> torch.Tensor:
    """Batch-invariant entropy of ``softmax(logits / temperature)`` per row (fp32 [T], nats).

    Args:
        logits: [T, V] float32 / bfloat16 / float16, or [..., V] (rows flattened, the result
            has the leading shape).
        temperature: Python float > 0, or a one-element floating tensor (read on the host).
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        fp32 [T] (or the leading shape); differentiable wrt ``logits``.

    See :func:`rl_engine.ops.entropy.reference.entropy` for the contract.
    """
    return on_logit_rows("entropy", _run, backend, logits, temperature)


register_op(
    "entropy",
    entry=registry_entry(entropy, _run),
    native=(f"entropy/native-v{VOCAB_TILE}", reference),
    stock=("entropy/stock-torch", stock),
    extras=("forward", "backward"),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
