"""``stock`` provider of ``det_gemm``: plain ``torch.mm`` / ``torch.addmm``.

Not batch invariant (BLAS / cuBLAS choose kernels and split-K by shape). Registered so that the
audit mode can measure the "before" picture; strict mode refuses it.
"""

from __future__ import annotations

import torch

from rl_engine.ops.det_gemm.reference import _check


def det_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.addmm(bias, a, b)`` / ``torch.mm(a, b)`` as the framework computes it."""
    _check(a, b, bias)
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def det_gemm_wgrad(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.t().float(), grad.float())
