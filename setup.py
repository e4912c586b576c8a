"""Builds the optional CUDA extension from ``csrc/``; all metadata lives in pyproject.toml.

The extension is built only when a CUDA toolchain (``nvcc``) and a CUDA build of torch are both
present; everywhere else the package installs as pure Python.
"""

import glob
import os
import shutil

from setuptools import setup


def _ext_modules():
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    if not sources:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or shutil.which("nvcc") is None:
        return [], {}
    ext = CUDAExtension(
        "rl_engine._C",
        sources + sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)),
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": ["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        },
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
