"""DTensor inputs for the norms: sharding strategies of their custom ops.

``rms_norm`` (+ residual), ``poly_norm`` and ``fused_mul_poly_norm`` take DTensors sharded on
any dim but the normalised (last) one, with replicated parameters. What runs where, and why the
bits are those of the unsharded op:

* **Row-wise ops** (the forwards, ``rms_norm_dx``): a row's result depends on that row alone
  (the row invariance every provider is tested for), so each rank computes its rows with the
  local op: inputs ``Shard(d)`` (``d`` < last), parameters ``Replicate``, outputs ``Shard(d)``.
* **Parameter gradients** (``rms_norm_wgrad``, ``poly_norm_backward``): a sum over all rows in
  the op's fixed chunk order. A ``Partial`` output (a per-rank sum all-reduced by the
  collective) would add the ranks' sums in the collective's order, not the op's; so these ops
  accept replicated inputs only: DTensor gathers the rows and every rank computes the
  unsharded op (the same bits, at the cost of an all-gather of the activations and the full
  parameter-gradient pass on each rank). ``poly_norm``'s input gradient comes out of that op
  replicated and is given back in the input's placement (a local slice).

The strategies are registered on first use (:func:`ensure`): ``torch.distributed.tensor`` is
imported only when a DTensor is seen. Tested on the CPU with 2 gloo ranks
(``tests/ops/test_dtensor_norms.py``).
"""

from __future__ import annotations

from typing import Any

import torch

_REGISTERED = False


def _dtensor_cls() -> Any:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return None
    return DTensor


def any_dtensor(*tensors: Any) -> bool:
    """Whether any of ``tensors`` is a DTensor (without importing DTensor for plain tensors)."""
    if all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def like(t: Any, ref: Any) -> Any:
    """``t`` (a DTensor) in ``ref``'s placements (``t`` itself when either is not a DTensor)."""
    cls = _dtensor_cls()
    if cls is None or not isinstance(t, cls) or not isinstance(ref, cls):
        return t
    if tuple(t.placements) == tuple(ref.placements):
        return t
    return t.redistribute(ref.device_mesh, ref.placements)


# Argument kinds of each op: "row" (sharded like x), "param" (replicated), None (not a tensor).
_ROWWISE = {
    "rms_norm": (("row", "param", None, None), 1),
    "fused_add_rms_norm": (("row", "row", "param", None, None), 2),
    "rms_norm_dx": (("row", "row", "param", None, None), 1),
    "poly_norm": (("row", "row", "param", "param", None, None), 1),
}
_REPLICATED = {
    "rms_norm_wgrad": (("row", "row", None, None), 1),
    "rms_norm_backward": (("row", "row", "param", "row", None, None), 2),
    "poly_norm_backward": (("row", "row", "row", "param", "param", None, None), 4),
}


def _strategies(kinds: tuple, n_out: int, rowwise: bool):
    from torch.distributed.tensor import Replicate, Shard

    def strategy(*args):
        ndim = next(a.ndim for a, k in zip(args, kinds, strict=False) if k == "row")
        out = []

        def inputs(place):
            return [
                None if k is None or a is None else (place if k == "row" else Replicate())
                for a, k in zip(args, kinds, strict=False)
            ]

        out.append(([Replicate()] * n_out, inputs(Replicate())))
        if rowwise:
            for d in range(ndim - 1):
                out.append(([Shard(d)] * n_out, inputs(Shard(d))))
        return out

    return strategy


def ensure() -> None:
    """Register the strategies of the norms' custom ops with DTensor (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.distributed.tensor.experimental import register_sharding

    import rl_engine.ops  # noqa: F401  (defines the custom ops)

    for table, rowwise in ((_ROWWISE, True), (_REPLICATED, False)):
        for name, (kinds, n_out) in table.items():
            op = getattr(torch.ops.rl_engine, name).default
            register_sharding(op)(_strategies(kinds, n_out, rowwise))
    _REGISTERED = True
