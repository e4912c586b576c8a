"""Print a short table of every ``<op>.json`` in a results folder (last step of gpu_check.sh).

Usage: ``python benchmarks/summary.py DIR``. A bench JSON may carry ``summary`` (a dict of
figures) and ``rows`` (with ``ratio``); both are shown when present.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("benchmarks/results")
    files = sorted(p for p in out.glob("*.json") if not p.name.endswith("_sweep.json"))
    if not files:
        print(f"no results in {out}")
        return
    print(f"== benchmark summary ({out}) ==")
    for path in files:
        try:
            data = json.loads(path.read_text())
        except Exception as exc:
            print(f"{path.name}: unreadable ({exc})")
            continue
        head = f"{data.get('op', path.stem):14s} {data.get('device', '')}"
        if "limits" in data and data.get("op") == "limits":
            lim = data["limits"]
            print(
                f"{head}: copy {lim['copy_tb_s']:.2f} TB/s, bf16 mm {lim['bf16_mm_tflop_s']:.0f} TFLOP/s"
            )
            continue
        summ = data.get("summary") or {
            k: v for k, v in data.items() if k.startswith("ratio_") or k.endswith("_diff")
        }
        figs = ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summ.items()
        )
        print(f"{head}: {figs}")
        rows = [r for r in data.get("rows", []) if "ratio" in r]
        if rows and data.get("op") == "det_gemm":
            ms = sorted({r["m"] for r in rows})
            shapes = list(dict.fromkeys(r["shape"] for r in rows))
            for key, title in (("ratio", "eager"), ("graph_ratio", "CUDA graph")):
                if not all(key in r for r in rows):
                    continue
                print(f"  {title} ratio vs cuBLAS " + " ".join(f"{m:>6d}" for m in ms))
                for s in shapes:
                    vals = {r["m"]: r[key] for r in rows if r["shape"] == s}
                    print(f"  {s:17s} " + " ".join(f"{vals.get(m, float('nan')):6.2f}" for m in ms))


if __name__ == "__main__":
    main()
