"""``nn.Module`` drop-ins that run on rl_engine's batch-invariant ops.

Parameter names and shapes equal torch's / Hugging Face's, so existing state dicts load:

* :class:`RMSNorm` — ``weight`` [H] (as ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` / ``torch.nn.RMSNorm``).
* :class:`Linear` — ``weight`` [out, in] and optional ``bias`` [out] (as ``torch.nn.Linear``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rl_engine.ops import det_gemm, rms_norm

__all__ = ["Linear", "RMSNorm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim through :func:`rl_engine.ops.rms_norm`.

    Args:
        hidden_size: H, the size of the normalised (last) dim.
        eps: added to the mean square.
        device: of the ``weight`` parameter (initialised to ones).
        dtype: of the ``weight`` parameter.
        backend: pin a provider (default: the registry's resolution).

    ``forward(x)`` maps [..., H] -> [..., H]; ``forward(x, residual)`` returns
    ``(rms_norm(x + residual), x + residual)`` (the fused residual add of vLLM's ``RMSNorm``).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm: hidden_size must be > 0, got {hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    @property
    def variance_epsilon(self) -> float:
        """Hugging Face's name of :attr:`eps`."""
        return self.eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> [..., H] (or ``(y, x + residual)`` with a residual)."""
        return rms_norm(x, self.weight, self.eps, residual, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class Linear(nn.Module):
    """``y = x @ weight.t() + bias`` through :func:`rl_engine.ops.det_gemm`.

    Args:
        in_features: size of the last dim of the input.
        out_features: size of the last dim of the output.
        bias: whether to add a learnable bias [out_features].
        device: of the parameters (initialised like ``torch.nn.Linear``).
        dtype: of the parameters.
        backend: pin a provider (default: the registry's resolution).

    ``forward`` maps [..., in_features] -> [..., out_features]; the input must have the
    parameters' dtype (no implicit casts).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initialisation of ``torch.nn.Linear``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features]."""
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear: input shape {tuple(x.shape)} does not end in in_features="
                f"{self.in_features}"
            )
        lead = x.shape[:-1]
        y = det_gemm(
            x.reshape(-1, self.in_features), self.weight.t(), self.bias, backend=self.backend
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
