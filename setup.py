"""Builds the optional CUDA C++ library from ``csrc/``; all metadata lives in pyproject.toml.

``librl_engine_sm90.so`` (the ``cuda`` provider of ``det_gemm``, SM90) is built by
``scripts/build_csrc.sh`` and packaged as ``rl_engine/_lib/librl_engine_sm90.so`` only when
``nvcc`` is on PATH **and** ``CUTLASS_DIR`` points at CUTLASS headers; everywhere else (CPU CI,
``scripts/install.sh``) the package installs as pure Python and the provider reports why it
cannot run. The library is a C ABI loaded with ctypes: it needs no CUDA build of torch.
Editable installs do not run this hook: build into ``build/csrc/`` with the script (the provider
looks there too).
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py


def _cutlass_dir():
    d = os.environ.get("CUTLASS_DIR", "")
    return d if d and os.path.isfile(os.path.join(d, "include", "cutlass", "cutlass.h")) else None


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        if shutil.which(os.environ.get("NVCC", "nvcc")) is None or _cutlass_dir() is None:
            print("rl_engine: not building csrc (needs nvcc and CUTLASS_DIR); pure Python install")
            return
        out = os.path.join(os.path.abspath(self.build_lib), "rl_engine", "_lib")
        subprocess.check_call(
            ["bash", os.path.join("scripts", "build_csrc.sh")], env={**os.environ, "OUT_DIR": out}
        )
        shutil.rmtree(os.path.join(out, "obj"), ignore_errors=True)


setup(cmdclass={"build_py": BuildPyWithCsrc})
