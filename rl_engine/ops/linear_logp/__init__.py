"""``linear_logp``: LM head + token log-probabilities (and entropy) without [T, V] logits.

Custom ops: ``rl_engine::linear_logp(hidden, weight, tokens, temperature, return_entropy,
provider) -> (logp, entropy, lse)`` (``entropy`` is empty [0] unless requested; ``lse`` is saved
for the backward and is not differentiable) and ``rl_engine::linear_logp_backward(...) ->
(dhidden, dweight)``, which recomputes the logits block by block.
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.linear_logp import reference, stock, unfused
from rl_engine.ops.logp.reference import VOCAB_TILE
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = ["linear_logp"]


def _linear_logp_fake(hidden, weight, tokens, temperature, return_entropy):
    reference._check(hidden, weight, tokens, temperature, return_entropy)
    t = hidden.shape[0]
    f32 = torch.float32
    return (
        hidden.new_empty(t, dtype=f32),
        hidden.new_empty(t if return_entropy else 0, dtype=f32),
        hidden.new_empty(t, dtype=f32),
    )


_linear_logp_op = provider_op(
    "linear_logp", "linear_logp", reference.linear_logp_forward, _linear_logp_fake, "forward"
)


def _linear_logp_backward_fake(
    hidden,
    weight,
    tokens,
    temperature,
    lse,
    entropy,
    grad_logp,
    grad_entropy,
    need_dhidden,
    need_dweight,
):
    dh = torch.empty_like(hidden) if need_dhidden else hidden.new_empty(0)
    dw = torch.empty_like(weight) if need_dweight else weight.new_empty(0)
    return dh, dw


_linear_logp_backward_op = provider_op(
    "linear_logp",
    "linear_logp_backward",
    reference.linear_logp_backward,
    _linear_logp_backward_fake,
    "backward",
)


def _setup_context(ctx, inputs, output):
    hidden, weight, tokens, temperature, return_entropy, provider = inputs
    _, ent, lse = output
    ctx.save_for_backward(hidden, weight, tokens, lse, ent)
    ctx.temperature = temperature
    ctx.return_entropy = return_entropy
    ctx.provider = provider
    ctx.mark_non_differentiable(lse)
    if not return_entropy:
        ctx.mark_non_differentiable(ent)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, tokens, lse, ent = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dh or need_dw):
        return None, None, None, None, None, None
    dh, dw = _linear_logp_backward_op(
        hidden,
        weight,
        tokens,
        ctx.temperature,
        lse,
        ent,
        grad_logp,
        grad_entropy if ctx.return_entropy else None,
        need_dh,
        need_dw,
        ctx.provider,
    )
    return (dh if need_dh else None), (dw if need_dw else None), None, None, None, None


_linear_logp_op.register_autograd(_backward, setup_context=_setup_context)


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant LM-head token log-probabilities, never materialising [T, V] logits.

    Bitwise equal to ``logp(det_gemm(hidden, weight.t()), tokens, temperature)`` (and, with
    ``return_entropy``, to ``entropy(det_gemm(hidden, weight.t()), temperature)``).

    Args:
        hidden: [T, H] float32 / bfloat16 / float16.
        weight: [V, H] same dtype (LM head as stored).
        tokens: [T] int64 / int32 ids in ``[0, V)`` (checked on the CPU).
        temperature: Python float > 0, or a one-element floating tensor (read on the host).
        return_entropy: also return the entropy [T].
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        fp32 ``logp`` [T], or ``(logp, entropy)``; differentiable wrt ``hidden`` and ``weight``.

    See :func:`rl_engine.ops.linear_logp.reference.linear_logp` for the contract.
    """
    from rl_engine.ops.logp.reference import as_temperature

    check_tensor("hidden", hidden)  # the full check runs once, in _run
    temperature = as_temperature(temperature)
    provider = resolve_provider("linear_logp", hidden.device.type, backend)
    return _run(hidden, weight, tokens, temperature, return_entropy, provider)


def _check_gemm_family(provider: str, device_type: str) -> None:
    """The Triton provider computes its logits with the Triton det_gemm: refuse it when
    ``det_gemm`` resolves to an opt-in family (the ``cuda`` one), which a user selects so that
    every side runs it: the fused op would silently stop equalling ``logp(det_gemm(...))``.
    The ``native`` provider calls the resolved det_gemm itself."""
    if provider != "triton":
        return
    gemm = resolve_provider("det_gemm", device_type)
    from rl_engine.registry import BackendUnavailableError

    if any(p.name == gemm and p.opt_in for p in KernelRegistry.providers("det_gemm")):
        raise BackendUnavailableError(
            f"linear_logp[triton] computes its logits with det_gemm[triton], but det_gemm "
            f"resolves to {gemm!r} here: the fused op would not equal logp(det_gemm(...)). Use "
            "linear_logp's unfused provider with it (RL_ENGINE_BACKEND_LINEAR_LOGP=unfused: "
            "those logits, then the Triton log-softmax a rollout's logp runs), or the native one"
        )


def _run(
    hidden, weight, tokens, temperature, return_entropy, provider: str
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The op through ``provider`` on :func:`linear_logp`'s arguments (checked here, once)."""
    reference._check(hidden, weight, tokens, temperature, return_entropy)
    _check_gemm_family(provider, hidden.device.type)
    lp, ent, _ = _linear_logp_op(
        hidden, weight, tokens, float(temperature), return_entropy, provider
    )
    return (lp, ent) if return_entropy else lp


register_op(
    "linear_logp",
    entry=registry_entry(linear_logp, _run),
    native=(f"linear_logp/native-v{VOCAB_TILE}", reference),
    stock=("linear_logp/stock-torch", stock),
    extras=("forward", "backward"),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
# Opt-in: the resolved det_gemm's logits, then the Triton log-softmax (for an opt-in det_gemm
# family, which the fused Triton provider cannot follow).
KernelRegistry.register_provider(unfused.PROVIDER)
