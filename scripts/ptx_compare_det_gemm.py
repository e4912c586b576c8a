"""Offline check, no GPU needed: does a change leave det_gemm's compiled kernels as they were?

Compiles the Triton kernels of ``rl_engine/ops/det_gemm/triton.py`` for Hopper (sm_90, Triton's
own compiler on the CPU) at a base revision and in the working tree, for the launch setups the
provider uses (the persistent TMA kernel's forward and weight-gradient plans, the pointer
weight-gradient kernel, its combine kernel), and compares the TTGIR, LLVM IR and PTX after
stripping debug information (source paths, line numbers). A positive control compiles the
working tree's TMA kernel with ``ACC_INIT=True`` and checks that the PTX changes, so the
comparison is shown able to fail.

    python scripts/ptx_compare_det_gemm.py --base c479faa

Exit status 0 when every setup is identical, 1 otherwise. Speed claims still need a GPU: this
only shows that a refactor or a new, switched-off specialisation compiles to the same code.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTS = ("ttgir", "llir", "ptx")


# ----------------------------------------------------------------------------- worker (one tree)
def _setups(mod):
    """(tag, kernel, runtime arg types {name: (type, 16-divisible)}, constexprs, options)."""

    def tma_types(bm, bn, bk, a_mmajor, b_kmajor, c_type):
        a_blk = [bk, bm] if a_mmajor else [bm, bk]
        b_blk = [bn, bk] if b_kmajor else [bk, bn]
        return {
            "a_desc": (f"tensordesc<bf16[{a_blk[0]}, {a_blk[1]}]>", False),
            "b_desc": (f"tensordesc<bf16[{b_blk[0]}, {b_blk[1]}]>", False),
            "bias_ptr": (c_type, True),  # no bias: the launcher passes out here
            "c_ptr": (c_type, True),
            "ws_ptr": ("*fp32", True),
            "M": ("i32", False),  # not specialised (see the kernel)
            "N": ("i32", True),
            "K": ("i32", True),
            "stride_cm": ("i32", True),
            "num_progs": ("i32", False),
        }

    tma = mod._det_gemm_tma_kernel
    out = []
    for multi in (False, True):
        for b_kmajor in (False, True):  # the forward: bf16 out, 128x256x64, 8 warps, 3 stages
            out.append((
                f"tma_fwd_mc{int(multi)}_bk{int(b_kmajor)}",
                tma,
                tma_types(128, 256, 64, False, b_kmajor, "*bf16"),
                dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, KC_TILES=64,
                     MULTI_CHUNK=multi, SPLIT=False, HAS_BIAS=False, A_MMAJOR=False,
                     B_KMAJOR=b_kmajor, stride_cn=1, ACC_INIT=False),
                {"num_warps": 8, "num_stages": 3},
            ))  # fmt: skip
        out.append((  # the weight gradient's TMA plan: fp32 out, a.t(), 128x128x64
            f"tma_wgrad_mc{int(multi)}",
            tma,
            tma_types(128, 128, 64, True, False, "*fp32"),
            dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, KC_TILES=64, MULTI_CHUNK=multi,
                 SPLIT=False, HAS_BIAS=False, A_MMAJOR=True, B_KMAJOR=False, stride_cn=1,
                 ACC_INIT=False),
            {"num_warps": 8, "num_stages": 4},
        ))  # fmt: skip
    wtypes = {
        "a_ptr": ("*bf16", True), "g_ptr": ("*bf16", True), "out_ptr": ("*fp32", True),
        "T": ("i32", True), "KO": ("i32", True), "N": ("i32", True), "stride_at": ("i32", True),
        "stride_gt": ("i32", True), "stride_os": ("i32", True), "stride_ok": ("i32", True),
        "chunks_per_prog": ("i32", False),
    }  # fmt: skip
    out.append((
        "wgrad_pointer",
        mod._det_gemm_wgrad_kernel,
        wtypes,
        dict(CHUNK=4096, BLOCK_O=128, BLOCK_N=128, BLOCK_T=64, UPCAST=False, IEEE=False,
             INT64=False, stride_ak=1, stride_gn=1, stride_on=1, ACC_INIT=False),
        {"num_warps": 8, "num_stages": 4},
    ))  # fmt: skip
    out.append((
        "wgrad_combine",
        mod._det_gemm_wgrad_combine_kernel,
        {"ws_ptr": ("*fp32", True), "out_ptr": ("*fp32", True), "n_parts": ("i32", False),
         "numel": ("i32", True)},
        dict(BLOCK=1024, ACC_INIT=False),
        {"num_warps": 4},
    ))  # fmt: skip
    return out


def _compile(kernel, types, consts, opts):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    divisible = CUDABackend.parse_attr("D")  # what the JIT gives 16-byte aligned arguments
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr or p.name in consts:  # constexprs; runtime ints specialised to 1
            value = consts.get(p.name, p.default)
            if value is inspect.Parameter.empty:
                raise KeyError(f"{kernel.__name__}: no value for constexpr {p.name}")
            sig[p.name], cx[p.name] = "constexpr", value
        else:
            sig[p.name], div = types[p.name]
            if div:
                attrs[(i,)] = divisible
    src = ASTSource(kernel, sig, cx, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _worker(out_dir: Path, control: bool) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    mod = importlib.import_module("rl_engine.ops.det_gemm.triton")
    out_dir.mkdir(parents=True, exist_ok=True)
    for tag, kernel, types, consts, opts in _setups(mod):
        if control:
            if not tag.startswith("tma_wgrad_mc1"):
                continue
            consts, tag = {**consts, "ACC_INIT": True}, tag + "_acc_init"
        k = _compile(kernel, types, consts, opts)
        for ext in EXTS:
            (out_dir / f"{tag}.{ext}").write_text(k.asm[ext])
        print(f"compiled {tag}", flush=True)


# ----------------------------------------------------------------------------- driver
def _normalise(text: str, ext: str) -> list[str]:
    """The code without debug information (paths, line numbers, DWARF sections)."""
    lines, in_debug = [], False
    for line in text.splitlines():
        if ext == "ptx":
            if re.match(r"\s*\.section\s+\.debug_", line):
                in_debug = True
                continue
            if in_debug:
                in_debug = line.strip() != "}"
                continue
            line = re.sub(r"//.*", "", line)
            if re.match(r"\s*\.(version|file|loc|section)\b", line):
                continue
        elif ext == "ttgir":
            line = re.sub(r"\s*loc\(.*?\)\)*$", "", line)
            if line.startswith("#loc"):
                continue
        elif ext == "llir":
            line = re.sub(r", !dbg !\d+", "", line)
            if line.startswith(("!", "source_filename")):
                continue
        if line.strip():
            lines.append(line.rstrip())
    return lines


def _run_worker(pkg_root: Path, out_dir: Path, cache: Path, control: bool = False) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(pkg_root), TRITON_CACHE_DIR=str(cache))
    cmd = [sys.executable, __file__, "--worker", str(out_dir)] + (["--control"] if control else [])
    subprocess.run(cmd, env=env, check=True, cwd=pkg_root)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="git revision to compare the working tree against")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.control)
        return 0
    if not args.base:
        ap.error("--base REV is required")
    with tempfile.TemporaryDirectory(prefix="ptx_compare_") as tmp:
        tmp = Path(tmp)
        base_root = tmp / "base"
        base_root.mkdir()
        archive = tmp / "base.tar"
        with open(archive, "wb") as f:
            subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "rl_engine"], stdout=f,
                           check=True)  # fmt: skip
        with tarfile.open(archive) as t:
            t.extractall(base_root, filter="data")
        _run_worker(base_root, tmp / "out_base", tmp / "cache_base")
        _run_worker(ROOT, tmp / "out_tree", tmp / "cache_tree")
        _run_worker(ROOT, tmp / "out_control", tmp / "cache_control", control=True)
        bad, report = 0, {}
        for path in sorted((tmp / "out_base").iterdir()):
            ext = path.suffix[1:]
            a = _normalise(path.read_text(), ext)
            b = _normalise((tmp / "out_tree" / path.name).read_text(), ext)
            same = a == b
            bad += not same
            report[path.name] = same
            print(f"{path.name:32s} {'identical' if same else 'DIFFERENT'} ({len(a)} lines)")
            if not same:
                print("\n".join(list(difflib.unified_diff(a, b, "base", "tree", lineterm=""))[:40]))
        plain = (tmp / "out_tree" / "tma_wgrad_mc1.ptx").read_text()
        acc = (tmp / "out_control" / "tma_wgrad_mc1_acc_init.ptx").read_text()
        control_ok = _normalise(plain, "ptx") != _normalise(acc, "ptx")
        print(
            f"positive control (ACC_INIT=True changes the PTX): {'ok' if control_ok else 'FAILED'}"
            f" (ld.global {plain.count('ld.global')} -> {acc.count('ld.global')})"
        )
        print(json.dumps({"base": args.base, "identical": not bad, "control_ok": control_ok}))
        return 0 if not bad and control_ok else 1


if __name__ == "__main__":
    sys.exit(main())
