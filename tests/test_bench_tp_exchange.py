"""``benchmarks/bench_tp_exchange.py`` runs on GPUs only after a device call starts; its gloo
smoke mode (2 CPU ranks, small shapes) runs every path here: the exchange against the
all-reduce, the row-parallel layer on its shards, rank 0's output against the TP = 1 product,
the JSON and the figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tp_exchange_bench_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_tp_exchange.py"),
           "--device", "cpu", "--quick", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((tmp_path / "tp_exchange.json").read_text())
    layers = [r for r in rep["rows"] if r["part"] == "layer"]
    assert {r["layer"] for r in layers} == {"o_proj", "down_proj"}
    assert all(r["bitwise_equal_tp1"] is True for r in layers)
    assert rep["summary"]["layers_bitwise_equal_tp1"] is True
    assert all(r["exchange_us"] > 0 and r["all_reduce_us"] > 0
               for r in rep["rows"] if r["part"] == "collective")  # fmt: skip


def test_tp_exchange_bench_node_dtype_smoke(tmp_path):
    """``--node-dtype bf16``: only the fp32-vs-bf16 subtree payload part, in its own JSON; every
    rank's exchange outputs (fp32 and bf16 subtrees) equal the tree over the gathered subtrees."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_tp_exchange.py"), "--device", "cpu",
           "--quick", "--node-dtype", "bf16", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "tp_exchange.json").exists()
    rep = json.loads((tmp_path / "tp_exchange_node_dtype.json").read_text())
    assert rep["node_dtype"] == "bf16"
    assert {r["part"] for r in rep["rows"]} == {"node_dtype"}
    assert {r["tokens"] for r in rep["rows"]} == {1, 16}
    for r in rep["rows"]:
        assert r["bitwise_equal_tree"] is True
        assert r["subtree_bytes_bf16"] * 2 == r["subtree_bytes_fp32"]
        assert r["exchange_bf16_us"] > 0 and r["allgather_bf16_us"] > 0
    assert rep["summary"]["node_dtype_bitwise_equal_tree"] is True
    assert "tp2_exchange_bf16_vs_fp32" in rep["summary"]
