"""Host-side helpers shared by every Triton provider: availability, device checks, the device
guard, and running a ``@triton.jit`` kernel in the interpreter for CPU tensors.

Kernels live in each op's ``triton.py``; this module holds no kernel and no numerics.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rl_engine import config as _rl_config

try:  # Triton is optional: without it every Triton provider reports why it cannot run.
    import triton  # noqa: F401

    IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install
    triton = None  # type: ignore[assignment]
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

_interpreted: dict[str, Any] = {}


def available(device: str, *, triton_interpret: bool) -> str | None:
    """The registry's availability check of a Triton provider (reads no environment)."""
    if triton is None:
        return f"triton is not importable ({IMPORT_ERROR})"
    if device == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is available"
    if device == "cpu":
        if triton_interpret:
            return None
        return (
            "Triton kernels need a CUDA device; set TRITON_INTERPRET=1 to run them in the "
            "interpreter"
        )
    return f"device {device!r} is not supported"


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Raise unless the tensors can run Triton kernels (CUDA, or the CPU under the interpreter)."""
    if triton is None:
        raise RuntimeError(f"{op}[triton]: triton is not importable ({IMPORT_ERROR})")
    dev = tensors[0].device
    if dev.type == "cuda":
        return
    if dev.type == "cpu":
        if not _rl_config.settings().triton_interpret:
            raise RuntimeError(
                f"{op}[triton]: Triton kernels need a CUDA device; set TRITON_INTERPRET=1 "
                "to run them in the interpreter on the CPU"
            )
        return
    raise RuntimeError(f"{op}[triton]: tensors on {dev} are not supported (cuda or cpu)")


def device_guard(t: torch.Tensor) -> Any:
    """``torch.cuda.device(t.device)`` for CUDA tensors, a no-op context otherwise."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def interpreted(kern: Any, device: torch.device) -> Any:
    """``kern`` itself for CUDA tensors; for CPU tensors its interpreter version, whatever
    ``TRITON_INTERPRET`` was when the kernel's module was imported."""
    if device.type != "cpu":
        return kern
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kern, InterpretedFunction):
        return kern
    key = f"{kern.fn.__module__}.{kern.fn.__qualname__}"
    if key not in _interpreted:
        _interpreted[key] = InterpretedFunction(kern.fn)
    return _interpreted[key]
