"""``logp``: batch-invariant token log-probabilities ``log_softmax(logits / T)[token]`` in fp32.

Custom ops: ``rl_engine::logp(logits, tokens, temperature, provider) -> (logp, lse)`` (``lse``
is saved for the backward and is not differentiable) and
``rl_engine::logp_backward(logits, tokens, temperature, lse, grad, provider) -> dlogits``.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import (
    check_tensor,
    lse_reduction_ops,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.logp import reference, stock
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = ["logp", "logp_at", "sampled_logp"]


_logp_op, _logp_backward_op = lse_reduction_ops(
    "logp", reference.logp_forward, reference.logp_backward, reference._check
)


def on_logit_rows(
    op: str, run: Any, backend: str | None, logits: Any, temperature: Any, *tokens: Any
) -> torch.Tensor:
    """The public call of a reduction over the vocabulary (:func:`logp`; ``entropy`` without
    ``tokens``): ``logits`` [..., V] (and ``tokens`` [...]) as rows [T, V] (and [T]), the
    temperature as a float (:func:`reference.as_temperature`), then ``run(logits, [tokens,]
    temperature, provider)`` through the provider the registry resolves for ``op`` (``run``
    checks the arguments, once), the result in the leading shape."""
    check_tensor("logits", logits)  # the full check runs once, in run
    temperature = reference.as_temperature(temperature)
    logits, flat_tokens, lead = reference.flatten_rows(logits, *tokens)
    provider = resolve_provider(op, logits.device.type, backend)
    out = run(logits, *((flat_tokens,) if tokens else ()), temperature, provider)
    return out if lead is None else out.reshape(lead)


def _run(logits, tokens, temperature, provider: str) -> torch.Tensor:
    """The op through ``provider`` on :func:`logp`'s [T, V] / [T] arguments (checked here)."""
    reference._check(logits, tokens, temperature)
    return _logp_op(logits, tokens, float(temperature), provider)[0]


def logp(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Batch-invariant ``log_softmax(logits / temperature)[token]`` (fp32 [T]).

    Args:
        logits: [T, V] float32 / bfloat16 / float16, or [..., V] (e.g. [B, T, V]: rows are
            flattened, the result has the leading shape).
        tokens: [T] (or the logits' leading shape) int64 / int32 ids in ``[0, V)`` (checked
            on the CPU; a device-side assert on an accelerator).
        temperature: Python float > 0, or a one-element floating tensor (read on the host).
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        fp32 [T] (or the leading shape); differentiable wrt ``logits``.

    See :func:`rl_engine.ops.logp.reference.logp` for the contract.
    """
    return on_logit_rows("logp", _run, backend, logits, temperature, tokens)


def sampled_logp(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    backend: str | None = None,
    check_range: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rollout's sampled-token log-probs: ``(logp, lse, rank)`` per row, no gradient.

    Row ``t`` of ``logp`` is bitwise ``logp(logits[t:t+1], tokens[t:t+1], temperatures[t])``
    (the same provider and numerics family), ``lse`` its log-sum-exp and ``rank`` (int64) is
    ``1 + #(z > z[token])`` over the row's scaled logits ``z = logits / temperature`` (vLLM's
    rank). On the Triton provider: one pass over the model-dtype logits, no fp32 copy.

    Args:
        logits: [T, V] float32 / bfloat16 / float16.
        tokens: [T] int64 / int32 ids in ``[0, V)``.
        temperatures: fp32 [T] on the logits' device, each finite and > 0 (not checked on the
            host: that would synchronise the stream).
        backend: pin a provider for this call (raises when it cannot run).
        check_range: check that the ids lie in ``[0, V)`` (on an accelerator a device-side
            assert; on the CPU a host read). ``False`` for ids a sampler drew from these logits.
    """
    check_tensor("logits", logits)  # the providers check the rest (once, on the hot path)
    if check_range:
        reference._check(logits, tokens, 1.0)  # the range check needs valid token tensors
        reference.check_token_range(tokens, logits.shape[1])
    provider = resolve_provider("logp", logits.device.type, backend)
    fn = KernelRegistry.provider("logp", provider).extras.get("sampled")
    if fn is None:
        raise NotImplementedError(f"logp provider {provider!r} has no per-row-temperature path")
    with torch.no_grad():
        return fn(logits, tokens, temperatures)


logp_at = reference.logp_at

register_op(
    "logp",
    entry=registry_entry(logp, _run),
    native=(f"logp/native-v{reference.VOCAB_TILE}", reference),
    stock=("logp/stock-torch", stock),
    extras={"forward": "logp_forward", "backward": "logp_backward", "sampled": "sampled_forward"},
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
