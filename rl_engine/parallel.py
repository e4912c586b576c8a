"""Tensor-parallel styles for rl_engine's modules (``torch.distributed.tensor.parallel``).

:class:`ResidualSequenceParallel` is the sequence-parallel style of a norm called with a
residual, ``norm(x, residual) -> (y, x + residual)`` (:class:`rl_engine.nn.RMSNorm`): both
inputs sharded on the sequence dim, the parameters replicated, both outputs sharded like the
inputs. Torch's own ``SequenceParallel`` style takes one input. The norm runs on DTensors
through the sharding strategies of ``rl_engine/ops/_dtensor.py``: the outputs and the input
gradients are computed on each rank's rows, the weight gradient over all rows in the op's fixed
order, so everything is bitwise the unsharded module's.

    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(model, mesh, {"layers.0.post_attention_layernorm": ResidualSequenceParallel()})
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ResidualSequenceParallel"]


def _style_base() -> type:
    try:
        from torch.distributed.tensor.parallel import ParallelStyle
    except ImportError:  # torch without distributed: the class still imports, applying raises
        return object
    return ParallelStyle


class ResidualSequenceParallel(_style_base()):  # type: ignore[misc]
    """Shard ``(x, residual)`` on ``sequence_dim``, replicate the module's parameters.

    Args:
        sequence_dim: the dim the inputs are sharded on (1 for [batch, sequence, hidden]; 0 for
            packed [tokens, hidden]). Not the last (normalised) dim: refused at the first
            input.
        use_local_output: give back local tensors (the rank's rows) instead of DTensors.

    Plain tensor inputs are taken as the rank's shard of an even split (as torch's
    ``SequenceParallel`` does: the global shape is the local one times the ranks; pass DTensors
    for an uneven split); DTensor inputs placed otherwise are redistributed to the sequence
    sharding.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _placements(self) -> list:
        from torch.distributed.tensor import Shard

        return [Shard(self.sequence_dim)]

    def _replicate_params(self, name: str, module: nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor import Replicate, distribute_tensor

        for p_name, param in list(module.named_parameters(recurse=False)):
            rep = distribute_tensor(param.detach(), mesh, [Replicate()])
            module.register_parameter(p_name, nn.Parameter(rep, param.requires_grad))

    def _inputs(self, module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        from torch.distributed.tensor import DTensor

        placements = self._placements()
        out = []
        for t in inputs:
            if isinstance(t, DTensor):
                if list(t.placements) != placements:
                    t = t.redistribute(mesh, placements)
            elif isinstance(t, torch.Tensor):
                if t.dim() < 2 or self.sequence_dim % t.dim() == t.dim() - 1:
                    raise ValueError(
                        f"ResidualSequenceParallel: sequence_dim {self.sequence_dim} is the "
                        f"normalised dim of a {t.dim()}-dim input"
                    )
                t = DTensor.from_local(t, mesh, placements, run_check=False)
            out.append(t)
        return tuple(out)

    def _outputs(self, module: nn.Module, outputs: Any, mesh: Any) -> Any:
        if not self.use_local_output:
            return outputs
        if isinstance(outputs, tuple):
            return tuple(o.to_local() for o in outputs)
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module, device_mesh, self._replicate_params, self._inputs, self._outputs
        )
