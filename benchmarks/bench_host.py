"""Host (CPU) time per call of the Triton providers' launch paths, against stock torch calls.

Usage: ``python benchmarks/bench_host.py [--out DIR] [--quick] [--profile]``.

Writes ``DIR/host.json``. A GPU kernel call costs the host time to validate arguments, pick a
config and launch; when that is longer than the GPU time of the kernel (decode-sized GEMMs, norms
of a few rows), the GPU waits for the CPU and eager timings measure the host. Each row is the
median wall time of one call, timed call by call while the GPU queue has room (launches are
asynchronous, so this is host time), for:

* ``torch.mm`` and the det_gemm provider (M = 1: pointer kernel; M = 512: persistent TMA kernel),
  the provider with rl_engine's cached launches (default) and with Triton's own launch path
  (``_triton._CACHED_LAUNCH = False``), and the public op (registry resolution + autograd entry);
* ``F.rms_norm`` and the rms_norm provider, forward, and backward through ``torch.autograd.grad``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from rl_engine.ops import _triton as _tr  # noqa: E402
from rl_engine.ops import det_gemm as public_det_gemm  # noqa: E402  (the functional op)
from rl_engine.ops import rms_norm as public_rms_norm  # noqa: E402
from rl_engine.ops.det_gemm import triton as gemm_triton  # noqa: E402
from rl_engine.ops.rms_norm import triton as norm_triton  # noqa: E402


def host_us(fn, *, calls: int = 400, batch: int = 50) -> float:
    """Median wall time of one call of ``fn`` in microseconds, timed call by call in batches
    of ``batch`` (synchronising between batches so the launch queue never fills)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    clock = time.perf_counter
    for _ in range(calls // batch):
        for _ in range(batch):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def _set_cached(on: bool) -> None:
    _tr._CACHED_LAUNCH = on


def run(args) -> list[dict]:
    calls = 200 if args.quick else 1000
    rows = []
    cached = _tr._CACHED_LAUNCH

    def add(name, fn, **info):
        us = host_us(fn, calls=calls)
        rows.append({"call": name, "host_us": us, **info})
        print(f"{name:48s} {us:8.1f} us", flush=True)

    bf16 = torch.bfloat16
    w = torch.randn(4096, 4096, device="cuda", dtype=bf16)
    for m in (1, 512):
        a = torch.randn(m, 4096, device="cuda", dtype=bf16)
        b = w.t()
        cfg = gemm_triton.get_config(m, 4096, 4096, bf16)
        kind = "tma" if cfg.tma else "pointer"
        add(f"torch.mm M={m}", lambda a=a, b=b: torch.mm(a, b), m=m)
        _set_cached(cached)
        add(f"det_gemm provider M={m} ({kind})", lambda a=a, b=b: gemm_triton.det_gemm(a, b), m=m)
        _set_cached(False)
        add(
            f"det_gemm provider M={m}, Triton's launch path",
            lambda a=a, b=b: gemm_triton.det_gemm(a, b),
            m=m,
        )
        _set_cached(cached)
        add(
            f"rl_engine.ops.det_gemm M={m} (registry + entry)",
            lambda a=a, b=b: public_det_gemm(a, b),
            m=m,
        )
    _set_cached(cached)
    rows += breakdown(calls)

    for m in (1, 16384):
        x = torch.randn(m, 8192, device="cuda", dtype=bf16)
        wn = torch.randn(8192, device="cuda", dtype=bf16)
        add(
            f"F.rms_norm fwd {m}x8192",
            lambda x=x, wn=wn: torch.nn.functional.rms_norm(x, (8192,), wn, 1e-6),
            m=m,
        )
        add(f"rms_norm provider fwd {m}x8192", lambda x=x, wn=wn: norm_triton.rms_norm(x, wn), m=m)
        xs, ws = x.clone().requires_grad_(), wn.clone().requires_grad_()
        ys = torch.nn.functional.rms_norm(xs, (8192,), ws, 1e-6)
        g = torch.randn_like(x)
        add(
            f"F.rms_norm bwd (autograd.grad) {m}x8192",
            lambda ys=ys, xs=xs, ws=ws, g=g: torch.autograd.grad(
                ys, (xs, ws), g, retain_graph=True
            ),
            m=m,
        )
        xr, wr = x.clone().requires_grad_(), wn.clone().requires_grad_()
        yr = public_rms_norm(xr, wr, 1e-6)
        add(
            f"rms_norm bwd (autograd.grad) {m}x8192",
            lambda yr=yr, xr=xr, wr=wr, g=g: torch.autograd.grad(
                yr, (xr, wr), g, retain_graph=True
            ),
            m=m,
        )
    return rows


def breakdown(calls: int) -> list[dict]:
    """Host time of the steps of one det_gemm provider call (M = 1, pointer kernel)."""
    a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16).t()
    out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = gemm_triton.get_config(1, 4096, 4096, torch.bfloat16)
    kern = gemm_triton._det_gemm_fwd_kernel
    lau = _tr.launcher(kern, a.device)
    main = gemm_triton._plan_for(a, b, None, out, cfg, gemm_triton.K_CHUNK).main  # the real launch
    args = (a, b, out, out, out, *main.rest)
    kw = main.kwargs
    grid = main.grid
    lau[grid](*args, **kw)
    ck, tail = lau._kernels[(a.get_device(), *map(_tr._arg_spec, args), *kw.items())]
    vals = args + tuple(kw[n] for n in tail)
    stream = torch._C._cuda_getCurrentRawStream(0)
    from triton import knobs

    steps = {
        "checks (_valid_cuda_args)": lambda: gemm_triton._valid_cuda_args(a, b, None),
        "get_config": lambda: gemm_triton.get_config(1, 4096, 4096, torch.bfloat16),
        "torch.empty": lambda: torch.empty((1, 4096), dtype=a.dtype, device=a.device),
        "_needs_int64": lambda: gemm_triton._needs_int64(a, b, out),
        "device_guard": lambda: gemm_triton._guard(a).__enter__(),
        "launcher lookup": lambda: gemm_triton._kernel("_det_gemm_fwd_kernel", a.device),
        "cache key": lambda: (0, *map(_tr._arg_spec, args), *kw.items()),
        "launch: cached launcher": lambda: lau[grid](*args, **kw),
        "launch: Triton's kernel[grid]": lambda: kern[grid](*args, **kw),
        "launch: CompiledKernel.run only": lambda: ck.run(
            *grid,
            stream,
            ck.function,
            ck.packed_metadata,
            None,
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *vals,
        ),
    }
    rows = []
    for name, fn in steps.items():
        us = host_us(fn, calls=calls)
        rows.append({"call": f"det_gemm M=1 step: {name}", "host_us": us, "m": 1})
        print(f"{'  step: ' + name:48s} {us:8.1f} us", flush=True)
    return rows


def profile(n: int = 2000) -> None:
    """cProfile of the rms_norm backward through autograd (1 x 8192): the top functions."""
    import cProfile
    import pstats

    x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    y = public_rms_norm(x, w, 1e-6)
    for _ in range(20):
        torch.autograd.grad(y, (x, w), g, retain_graph=True)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        torch.autograd.grad(y, (x, w), g, retain_graph=True)
        if i % 50 == 0:
            torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    args = common.cuda_args(
        __doc__,
        "bench_host: no CUDA device; nothing to measure",
        lambda p: p.add_argument("--profile", action="store_true", help="cProfile, then exit"),
    )
    if args is None:
        return
    if args.profile:
        profile()
        return
    rows = run(args)
    by = {r["call"]: r["host_us"] for r in rows}

    def provider(m):
        return next(v for k, v in by.items() if k.startswith(f"det_gemm provider M={m} ("))

    summary = {
        "det_gemm_m1_vs_torch_mm": provider(1) / by["torch.mm M=1"],
        "det_gemm_m512_vs_torch_mm": provider(512) / by["torch.mm M=512"],
        "cached_launch_saving_us_m1": by["det_gemm provider M=1, Triton's launch path"]
        - provider(1),
        "cached_launch_saving_us_m512": by["det_gemm provider M=512, Triton's launch path"]
        - provider(512),
        "rms_norm_bwd_vs_stock_1row": by["rms_norm bwd (autograd.grad) 1x8192"]
        / by["F.rms_norm bwd (autograd.grad) 1x8192"],
    }
    common.finish(
        args.out,
        "host",
        {
            "definition": "median wall time of one call, host side (asynchronous launches)",
        },
        summary=summary,
        rows=rows,
        digits=2,
    )


if __name__ == "__main__":
    main()
