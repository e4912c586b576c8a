"""Physical limits of the GPU, measured: device copy bandwidth and peak bf16 matmul rate.

Usage: ``python benchmarks/bench_limits.py [--out DIR]`` -> ``DIR/limits.json``. Every op page
states its cost against these (the roofline of ``bench_<op>.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main() -> None:
    args = common.cuda_args(__doc__, "bench_limits: no CUDA device; nothing to measure")
    if args is None:
        return
    limits = common.measure_limits(quick=args.quick)
    common.write_json(args.out, "limits", {"limits": limits})
    print(
        f"limits: copy {limits['copy_tb_s']:.2f} TB/s (read+write), "
        f"bf16 mm {limits['bf16_mm_tflop_s']:.0f} TFLOP/s (8192^3)"
    )


if __name__ == "__main__":
    main()
