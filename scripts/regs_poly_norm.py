"""Offline check, no GPU needed: registers and spills of the ``poly_norm`` Triton kernels.

Compiles ``_poly_fwd_kernel`` and ``_poly_bwd_kernel`` (bf16, plain and fused-mul) for Hopper
(sm_90a, Triton's own compiler and its bundled ``ptxas -v`` on the CPU) for the launch setups
given (``lanes:warps:unroll``, default: the shipped ones and the sweep's candidates), and prints
registers per thread, spilled bytes and how many row programs fit an SM by registers (a warp's
registers are allocated in 256-register units; at most 32 programs an SM). A file of an earlier
provider version (``--module path/to/triton.py``) without ``UNROLL`` compiles its kernels as
they were.

    python scripts/regs_poly_norm.py
    python scripts/regs_poly_norm.py --setups 256:1:8,1024:2:1 --module /tmp/poly_norm_v2.py

Use the GPU images' Triton for numbers that hold there (``PYTHONPATH`` to a Triton 3.6 tree).
Speed needs a GPU: ``scripts/gpu_poly_norm.sh``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

P = ("*bf16", True)
F32P = ("*fp32", True)
I32 = ("i32", True)
F32 = ("fp32", False)
FWD_TYPES = {"X": P, "MUL": P, "Y": P, "W": F32P, "B": F32P, "H": I32, "h_f": F32,
             "stride_x": I32, "stride_m": I32, "stride_y": I32, "eps": F32}  # fmt: skip
BWD_TYPES = {"G": P, "X": P, "MUL": P, "DX": P, "DMUL": P, "PART": F32P, "W": F32P, "B": F32P,
             "H": I32, "h_f": F32, "stride_g": I32, "stride_x": I32, "stride_m": I32,
             "stride_dx": I32, "stride_dm": I32, "eps": F32}  # fmt: skip


def _module(path: str | None):
    if path is None:
        from rl_engine.ops.poly_norm import triton as mod

        return mod
    spec = importlib.util.spec_from_file_location("poly_norm_triton_file", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ptxas_regs(ptx: str) -> tuple[int, int]:
    import triton

    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas*"))
    if not ptxas:
        raise SystemExit("no ptxas in this Triton install")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas[0], "-v", "-arch=sm_90a", str(src), "-o", str(src) + ".o"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def _fit(regs: int, warps: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    return min(32, 65536 // (per_warp * warps))


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default=None, help="lanes:warps:unroll,...")
    ap.add_argument("--module", default=None, help="a poly_norm triton.py file to compile")
    args = ap.parse_args()
    import triton
    from ptx_compare_det_gemm import _compile

    mod = _module(args.module)
    if args.setups:
        setups = [tuple(int(v) for v in s.split(":")) for s in args.setups.split(",")]
    else:
        shipped = (
            {tuple(mod.launch_config(h)) for h in (2048, 5120)}
            if hasattr(mod, "launch_config")
            else set()
        )
        setups = sorted(
            shipped | {(256, 1, 2), (256, 1, 4), (256, 2, 4), (512, 1, 4), (1024, 2, 1)}
        )
    print(f"triton {triton.__version__}, sm_90a")
    for lanes, warps, unroll in setups:
        for kern, types in ((mod._poly_fwd_kernel, FWD_TYPES), (mod._poly_bwd_kernel, BWD_TYPES)):
            for has_mul in (False, True):
                consts = {"HAS_MUL": has_mul, "BLOCK": lanes, "LOG_BLOCK": lanes.bit_length() - 1}
                if "UNROLL" in [p.name for p in kern.params]:
                    consts["UNROLL"] = unroll
                compiled = _compile(
                    kern, types, consts, {"num_warps": warps, "enable_fp_fusion": False}
                )
                regs, spill = _ptxas_regs(compiled.asm["ptx"])
                print(f"{kern.__name__:17s} mul={int(has_mul)} lanes={lanes:5d} warps={warps} "
                      f"unroll={unroll}: {regs:3d} registers, {spill} bytes spilled, "
                      f"{_fit(regs, warps):2d} programs / SM")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
