"""Tensor-parallel experts: the grouped ``moe_experts`` and its TP exchange.

An engine that shards every expert's intermediate dimension ``I`` over its TP group (vLLM's
default for an MoE model at ``tensor_parallel_size > 1`` without expert parallelism) holds on
rank ``r`` the rows ``[gate_r; up_r]`` of ``w13`` and the columns ``r`` of ``w2``. Numerics of the
grouped experts (family ``moe_experts_tp/g<G>[<moe_experts family>]``, ``G`` =
:data:`rl_engine.ops.det_gemm.tp.TP_GROUPS` unless ``RL_ENGINE_TP_GROUPS`` says otherwise):

* gate / up: ``det_gemm`` per column, the same bits whatever ``N`` (column invariance), so a
  rank's ``silu_and_mul(x @ w13_r[e].T)`` is its columns of the one-device activation;
* down: ``det_gemm_tp``'s grouped K reduction (``I`` in ``G`` equal contiguous groups, fp32
  group products, a pair tree of adjacent groups), of which a rank's shard is a whole subtree of
  ``G / t`` groups (:func:`rl_engine.ops.moe_experts.moe_experts_subtree`);
* the ranks' ``[T * k, H]`` fp32 subtrees are combined by the TP group's
  :class:`~rl_engine.ops.det_gemm.tp.Exchange` (the tree's top levels, one rounding): every rank
  gets the one-device rows ``moe_experts(..., groups=G)``; then ``moe_combine`` as always.

So TP 1, 2, 4 and 8 give the same bits when every engine uses ``groups_for(its TP degree)``
(:func:`rl_engine.ops.det_gemm.tp.groups_for`): with ``RL_ENGINE_TP_GROUPS=8`` all of them run
the grouped experts, also at TP 1 (a trainer) and under expert parallelism (whole experts: all
``G`` groups local, no exchange).

Here: the registry op ``moe_experts_tp`` (provenance names the grouped family: one provider per
``moe_experts`` provider, same name, available where that provider runs *and* serves the
``"subtree"`` extra), :func:`resolve` (the experts provider of a grouped call, with a clear
error where it has no ``"subtree"``), :func:`family`, and the inference op of a TP rank,
``rl_engine::moe_experts_tp(x, ids, w13, w2, expert_map, groups, exchange, provider)``
(:func:`moe_experts_tp`: subtree and exchange in one custom op, opaque to ``torch.compile``, the
exchange found by name as ``rl_engine::tp_row_parallel`` finds it).
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import signature_of
from rl_engine.ops.det_gemm import tp as dtp
from rl_engine.ops.det_gemm.tp import TP_GROUPS
from rl_engine.ops.moe_experts import reference
from rl_engine.registry import BackendUnavailableError, KernelRegistry, resolve_provider

__all__ = ["family", "moe_experts_tp", "resolve"]

_OP = "moe_experts"
_TP_OP = "moe_experts_tp"


def _experts_provider(name: str):
    """The ``moe_experts`` provider ``name`` (no execution count)."""
    for p in KernelRegistry.providers(_OP):
        if p.name == name:
            return p
    raise BackendUnavailableError(f"{_OP}: no provider named {name!r}")


def _no_subtree(name: str) -> str | None:
    if "subtree" in _experts_provider(name).extras:
        return None
    return (
        f"the moe_experts provider {name!r} has no 'subtree' extra: it cannot compute the "
        "grouped (TP-invariant) experts (RL_ENGINE_TP_GROUPS / tensor-parallel experts); pin "
        "a provider that has one (RL_ENGINE_BACKEND_MOE_EXPERTS=native)"
    )


@torch._dynamo.assume_constant_result
def resolve(device_type: str, backend: str | None = None) -> str:
    """The ``moe_experts`` provider a grouped call runs (``backend``, or the op's resolution),
    resolved and recorded as the op ``moe_experts_tp`` (provenance: the grouped family).

    Raises:
        BackendUnavailableError: the provider has no ``"subtree"`` extra (named in the error).
    """
    name = backend or resolve_provider(_OP, device_type)
    reason = _no_subtree(name)
    if reason is not None:
        raise BackendUnavailableError(f"moe_experts with groups on {device_type}: {reason}")
    return resolve_provider(_TP_OP, device_type, name)


def family(device: torch.device | str = "cpu", backend: str | None = None,
           groups: int = TP_GROUPS) -> str:  # fmt: skip
    """The numerics family id of the grouped experts on ``device``."""
    name = resolve(torch.device(device).type, backend)
    return f"moe_experts_tp/g{groups}[{_experts_provider(name).numerics}]"


# ----------------------------------------------------------------------------- a TP rank's op
@torch.library.custom_op("rl_engine::moe_experts_tp", mutates_args=())
def _moe_experts_tp_op(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None,
    groups: int,
    exchange: str,
    provider: str,
) -> torch.Tensor:
    ex = dtp.exchange_named(exchange)
    sub = KernelRegistry.provider(_OP, provider).extras["subtree"]
    y = sub(x, ids, w13, w2, groups, expert_map)  # fp32 [T, k, H]
    t, k, h = y.shape
    # (the one-shot exchange copies a subtree that is not in its staging buffer itself: the
    # "subtree" extra has no ``out``, so there is no Exchange.subtree_out staging here)
    return ex(y.view(t * k, h), None, x.dtype).view(t, k, h)


@_moe_experts_tp_op.register_fake
def _(x, ids, w13, w2, expert_map, groups, exchange, provider):
    reference._check(x, ids, w13, w2, expert_map, values=False)
    return x.new_empty((ids.shape[0], ids.shape[1], x.shape[1]))


def moe_experts_tp(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    groups: int,
    exchange: str,
    *,
    expert_map: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One TP rank's experts (its ``I / t`` shard), exchanged: the whole [T, k, H] rows of
    ``moe_experts(x, ids, w13_full, w2_full, groups=G)`` on every rank (inference: no autograd).

    Args:
        x: [T, H] the (replicated) token rows; ids: [T, k].
        w13: [E_local, 2 * I / t, H] this rank's ``[gate_r; up_r]``; w2: [E_local, H, I / t].
        groups: this rank's group count ``G / t``.
        exchange: the name the TP group's :class:`~rl_engine.ops.det_gemm.tp.Exchange` is
            registered (or buildable) under (vLLM: ``compat.tp_exchange()``).
        expert_map: as :func:`rl_engine.ops.moe_experts.moe_experts`.
        backend: as :func:`rl_engine.ops.moe_experts.moe_experts`.

    Returns:
        [T, k, H] in ``x.dtype``, the same on every rank of the group.
    """
    provider = resolve(x.device.type, backend)
    reference._check(
        x, ids, w13, w2, expert_map, groups=groups, values=not torch.compiler.is_compiling()
    )
    return _moe_experts_tp_op(x, ids, w13, w2, expert_map, groups, exchange, provider)


# ----------------------------------------------------------------------------- registry
# ``moe_experts_tp`` is an op of its own in the registry (the grouped experts are a numerics
# family of their own: provenance and the audit tell a grouped side from a plain one), one
# provider per invariant moe_experts provider, same name and devices; available where that
# provider runs and has a "subtree" extra.
def _grouped(x, ids, w13, w2, expert_map, provider: str) -> torch.Tensor:
    from rl_engine.ops.moe_experts import moe_experts

    return moe_experts(x, ids, w13, w2, expert_map=expert_map, groups=TP_GROUPS,
                       backend=provider)  # fmt: skip


@signature_of(reference.moe_experts)
def _reference(*args) -> torch.Tensor:
    """``moe_experts(x, ids, w13, w2, expert_map=expert_map, groups=TP_GROUPS)``, native."""
    x, ids, w13, w2, expert_map = args
    sub = reference.moe_experts_subtree(x, ids, w13, w2, TP_GROUPS, expert_map)
    return dtp.finish(sub, None, x.dtype)


def _provider_fn(name: str):
    @signature_of(reference.moe_experts)
    def fn(*args) -> torch.Tensor:
        return _grouped(*args, name)

    return fn


def _available(name: str, base):
    def available(device: str, *, triton_interpret: bool) -> str | None:
        return base(device, triton_interpret=triton_interpret) or _no_subtree(name)

    return available


def _entry(x, ids, w13, w2, expert_map=None, *, provider: str):
    return _grouped(x, ids, w13, w2, expert_map, provider)


dtp.register_grouped(_TP_OP, _OP, entry=_entry, reference=_reference, fn=_provider_fn,
                     available=_available)  # fmt: skip
