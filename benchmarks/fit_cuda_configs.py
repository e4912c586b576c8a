"""The ``cuda`` det_gemm provider's tile choice, fitted from measured per-config times.

Usage: ``python benchmarks/fit_cuda_configs.py RESULT.json [--out DIR]``, where ``RESULT.json``
is a ``bench_det_gemm_cuda.py --configs`` result (every row timed with every configuration of
``config.CUDA_CONFIGS``: ``cfg_<name>_us``, ``graph_cfg_<name>_us`` beside ``cublas_us`` /
``graph_cublas_us``). No GPU needed: it only reads times.

It prints, for eager calls and CUDA-graph replay, the ratio to cuBLAS (cuBLAS time / ours,
geomean and worst over the rows) of:

* ``table``  the choice the result was measured with (its rows' ``config``);
* ``model``  ``config.get_cuda_config`` as it is now (by M and one wave up to 256 rows, the wave
  model over the other candidates);
* ``fitted`` the same rule with the tile efficiencies (``config.CUDA_TILE_EFFICIENCY``: those of
  ``mid``, ``mid192``, ``large192``, ``square``) and the cluster threshold
  (``config.CUDA_CLUSTER_M``) that maximise the geomean of eager and graph ratios together
  (:func:`fit`);
* ``oracle`` the fastest configuration of each row (the ceiling of any choice rule),

then the rows where the fitted rule loses more than 5% to the oracle (what a rule by M and the
wave count cannot see), and per row count M the configuration that is best on most shapes (what
the table below 256 rows should say). Writes ``DIR/cuda_config_fit.json``. Every configuration
gives the same bits (``test_every_config_bitwise_equal``), so any choice is speed only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl_engine.ops.det_gemm import config as gemm_config  # noqa: E402

CONFIGS = tuple(gemm_config.CUDA_CONFIGS)
MODES = ("", "graph_")  # eager, CUDA-graph replay
EFFICIENCIES = tuple(round(0.6 + 0.05 * i, 2) for i in range(9))  # 0.60 .. 1.00
FITTED = ("mid", "mid192", "large192", "square")  # the efficiencies fitted (`large` is the unit)
CLUSTER_MS = (1024, 2048, 4096, 8192, 1 << 30)  # the last: never clustered


def _geomean(vals: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def load(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows timed with every configuration, and the device's SM count."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a readable result JSON ({exc})") from None
    need = [f"{mode}cfg_{c}_us" for mode in MODES for c in CONFIGS]
    rows = [r for r in data.get("rows", []) if all(k in r for k in need)]
    if not rows:
        raise SystemExit(
            f"{path}: no row has the per-config times {need[:2]}...: run "
            "bench_det_gemm_cuda.py with --configs (and the library built with every "
            "configuration of config.CUDA_CONFIGS)"
        )
    return rows, int(data.get("sm_count") or gemm_config.DEFAULT_SM_COUNT)


def ratios(rows: list[dict[str, Any]], pick, mode: str) -> list[float]:
    """cuBLAS time / the picked configuration's time, per row (``pick(row) -> name``)."""
    return [r[f"{mode}cublas_us"] / r[f"{mode}cfg_{pick(r)}_us"] for r in rows]


def oracle(row: dict[str, Any], mode: str) -> str:
    """The row's fastest configuration in ``mode``."""
    return min(CONFIGS, key=lambda c: row[f"{mode}cfg_{c}_us"])


def model(sms: int, efficiency: dict[str, float] | None = None, cluster_m: int | None = None):
    """``get_cuda_config`` at this SM count, tile efficiencies and cluster threshold (``None``:
    the config module's), as a row -> name pick."""
    cm = gemm_config.CUDA_CLUSTER_M if cluster_m is None else cluster_m
    return lambda r: gemm_config.get_cuda_config(
        r["m"], r["n"], r["k"], sms, efficiency, cluster_m=cm
    )


def summary(rows: list[dict[str, Any]], pick_for_mode) -> dict[str, float]:
    out = {}
    for mode in MODES:
        vals = ratios(rows, pick_for_mode(mode), mode)
        out[f"{mode}ratio_geomean"] = _geomean(vals)
        out[f"{mode}ratio_worst"] = min(vals)
    return out


def fit(rows: list[dict[str, Any]], sms: int) -> tuple[dict[str, float], int]:
    """The tile efficiencies (of :data:`FITTED`, over :data:`EFFICIENCIES`) and the cluster
    threshold (of :data:`CLUSTER_MS`) whose choice has the best geomean ratio over eager and
    graph rows together; where several tie (the same choices on these rows), the one nearest the
    config module's values (a fit moves a constant only as far as the rows demand)."""
    now = gemm_config.CUDA_TILE_EFFICIENCY

    def score(effs: dict[str, float], cm: int) -> float:
        pick = model(sms, effs, cm)
        return round(_geomean([v for mode in MODES for v in ratios(rows, pick, mode)]), 12)

    def distance(effs: dict[str, float], cm: int) -> float:
        d = sum(abs(effs[c] - now[c]) for c in FITTED)
        return d + abs(math.log2(cm) - math.log2(gemm_config.CUDA_CLUSTER_M))

    cands = [
        (dict(zip(FITTED, vals, strict=True)), cm)
        for vals in itertools.product(EFFICIENCIES, repeat=len(FITTED))
        for cm in CLUSTER_MS
    ]
    scores = [score(e, cm) for e, cm in cands]
    top = max(scores)
    tied = [c for c, sc in zip(cands, scores, strict=True) if sc == top]
    return min(tied, key=lambda c: distance(*c))


def best_by_m(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per row count M: how many shapes each configuration is fastest on (graph replay), and the
    configuration with the best geomean ratio over the shapes."""
    out: dict[int, dict[str, Any]] = {}
    for m in sorted({r["m"] for r in rows}):
        sub = [r for r in rows if r["m"] == m]
        wins = Counter(oracle(r, "graph_") for r in sub)
        geo = {c: _geomean(ratios(sub, lambda r, c=c: c, "graph_")) for c in CONFIGS}
        out[m] = {"wins": dict(wins), "best": max(geo, key=geo.get), "graph_geomean": geo}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("result", type=Path, help="a bench_det_gemm_cuda.py --configs JSON")
    p.add_argument("--out", type=Path, default=None, help="folder for cuda_config_fit.json")
    args = p.parse_args()
    rows, sms = load(args.result)
    eff, cluster_m = fit(rows, sms)
    rules = {
        "table": lambda mode: lambda r: r["config"],
        "model": lambda mode: model(sms),
        "fitted": lambda mode: model(sms, eff, cluster_m),
        "oracle": lambda mode: lambda r: oracle(r, mode),
    }
    results = {name: summary(rows, rule) for name, rule in rules.items()}
    now = {c: gemm_config.CUDA_TILE_EFFICIENCY[c] for c in FITTED}
    print(f"{len(rows)} rows, {sms} SMs; fitted efficiencies {eff} (now {now}), cluster from "
          f"M {cluster_m} (now {gemm_config.CUDA_CLUSTER_M})")  # fmt: skip
    print(f"{'rule':8s} {'eager geomean':>14s} {'eager worst':>12s} {'graph geomean':>14s} "
          f"{'graph worst':>12s}")  # fmt: skip
    for name, s in results.items():
        print(f"{name:8s} {s['ratio_geomean']:14.3f} {s['ratio_worst']:12.3f} "
              f"{s['graph_ratio_geomean']:14.3f} {s['graph_ratio_worst']:12.3f}")  # fmt: skip
    fitted = model(sms, eff, cluster_m)
    misses = []
    for r in rows:
        best = oracle(r, "graph_")
        got = fitted(r)
        loss = r[f"graph_cfg_{got}_us"] / r[f"graph_cfg_{best}_us"]
        if loss > 1.05:
            misses.append({"shape": r["shape"], "m": r["m"], "n": r["n"], "k": r["k"],
                           "fitted": got, "best": best, "slower_by": loss})  # fmt: skip
    print(
        f"\nrows where the fitted rule is > 5% slower than the best config (graph): {len(misses)}"
    )
    for x in misses:
        print(f"  {x['shape']:24s} M={x['m']:5d} fitted {x['fitted']:6s} best {x['best']:6s} "
              f"x{x['slower_by']:.2f}")  # fmt: skip
    per_m = best_by_m(rows)
    print(
        "\nper M (graph replay): the config with the best geomean over the shapes; wins per config"
    )
    for m, v in per_m.items():
        now = gemm_config.get_cuda_config(m, 4096, 4096, sms)
        print(f"  M={m:5d} best {v['best']:6s} now (N 4096) {now:6s} wins {v['wins']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "cuda_config_fit.json"
        path.write_text(json.dumps({
            "source": str(args.result), "sm_count": sms, "fitted_efficiency": eff,
            "current_efficiency": now, "fitted_cluster_m": cluster_m,
            "current_cluster_m": gemm_config.CUDA_CLUSTER_M,
            "rules": results, "misses": misses, "per_m": {str(m): v for m, v in per_m.items()},
        }, indent=1))  # fmt: skip
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
