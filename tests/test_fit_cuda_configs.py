"""``benchmarks/fit_cuda_configs.py`` reads a ``bench_det_gemm_cuda.py --configs`` result (GPU
times) and fits the ``cuda`` det_gemm tile choice; here on synthetic times that follow the wave
model with a known ``square`` efficiency, so the fit must find a rule as good as the oracle."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from rl_engine.ops.det_gemm import config as gemm_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "fit_cuda_configs.py"
SHAPES = (("o_proj", 4096, 4096), ("qkv_proj", 4096, 6144), ("down_proj", 14336, 4096))
MS = (1, 64, 128, 256, 512, 1024, 2048, 8192)


def _result(path: Path, square_efficiency: float, sms: int = 132) -> Path:
    """Rows whose per-config times are the wave model's at ``square_efficiency`` above 256
    rows (the 64-row tiles, small / mid / narrow, three times slower there), the table's choice
    best up to 256 rows."""
    rows = []
    for name, k, n in SHAPES:
        for m in MS:
            t = {}
            for c in gemm_config.CUDA_CONFIGS:
                if m <= 256:
                    t[c] = 10.0 if c == gemm_config.get_cuda_config(m, n, k) else 15.0
                else:
                    base = gemm_config.cuda_wave_cost(c, m, n, sms, square_efficiency)
                    t[c] = 10.0 * base * (3.0 if gemm_config.CUDA_TILES[c][0] < 128 else 1.0)
            row = {"shape": name, "m": m, "k": k, "n": n, "config": "large" if m > 256 else
                   gemm_config.get_cuda_config(m, n, k), "cublas_us": min(t.values()),
                   "graph_cublas_us": min(t.values())}  # fmt: skip
            for c, us in t.items():
                row[f"cfg_{c}_us"] = row[f"graph_cfg_{c}_us"] = us
            rows.append(row)
    path.write_text(json.dumps({"op": "det_gemm_cuda", "sm_count": sms, "rows": rows}))
    return path


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_fit_recovers_a_rule_as_good_as_the_oracle(tmp_path):
    src = _result(tmp_path / "det_gemm_cuda.json", square_efficiency=0.7)
    proc = _run(src, "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fit = json.loads((tmp_path / "cuda_config_fit.json").read_text())
    rules = fit["rules"]
    # the oracle is 1.0 everywhere (cuBLAS = the best config here); the fitted rule reaches it
    assert math.isclose(rules["oracle"]["graph_ratio_worst"], 1.0)
    assert math.isclose(rules["fitted"]["graph_ratio_geomean"], 1.0)
    assert math.isclose(rules["fitted"]["ratio_worst"], 1.0)
    assert fit["misses"] == []
    # the table the rows were measured with (large for every row above 256) is worse
    assert rules["table"]["graph_ratio_worst"] < 1.0
    # the fitted efficiency gives the same choices as the true one on every row
    eff = fit["fitted_square_efficiency"]
    for _, k, n in SHAPES:
        for m in MS:
            assert gemm_config.get_cuda_config(m, n, k, 132, eff) == gemm_config.get_cuda_config(
                m, n, k, 132, 0.7
            )
    assert fit["per_m"]["512"]["best"] == "square"
    assert "fitted square efficiency" in proc.stdout


def test_fit_refuses_a_result_without_per_config_times(tmp_path):
    src = tmp_path / "det_gemm_cuda.json"
    src.write_text(json.dumps({"rows": [{"m": 1, "n": 8, "k": 8, "cublas_us": 1.0}]}))
    proc = _run(src)
    assert proc.returncode != 0
    assert "--configs" in proc.stderr
