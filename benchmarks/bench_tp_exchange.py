"""Benchmark of the TP-invariant exchange against NCCL's all-reduce, on 2 / 4 / 8 GPUs of one host.

Usage: ``python benchmarks/bench_tp_exchange.py [--out DIR] [--quick] [--ranks N]
[--node-dtype {fp32,bf16,both}]`` (``--device cpu``: gloo ranks on the CPU, small shapes: a smoke
run of the script, not a measurement; tests/test_bench_tp_exchange.py).

Writes ``DIR/tp_exchange.json`` and ``DIR/tp_exchange.png``. Two parts, each at every TP degree
``t`` (powers of two from 2 up to the GPU count, at most 8), bf16, hidden 4096:

* ``collective``: combining the ranks' ``[M, 4096]`` partials of a row-parallel layer. Baseline:
  what Megatron / vLLM run, ``all_reduce`` of the bf16 partials (NCCL picks the order: not
  TP-invariant); rl_engine: ``Exchange`` on the fp32 subtrees (all-to-all of column blocks, the
  tree's top levels + one rounding on the own block, all-gather of the bf16 blocks). With
  sequence parallelism: NCCL ``reduce_scatter`` of bf16 vs ``Exchange.scatter``. Bytes a rank
  sends are in the rows (``ring`` = ``2 (t-1)/t * 2MN``, exchange ``(t-1)/t * 6MN``).
* ``layer``: a whole row-parallel layer's forward on its shard, Llama-3-8B ``o_proj`` (K 4096) and
  ``down_proj`` (K 14336): cuBLAS GEMM + NCCL all-reduce (stock) vs ``tp_linear(parallel="row")``
  (the 8 / t group products, the pair tree, the exchange), and whether the output equals
  the TP = 1 grouped product bitwise on every rank (``det_gemm_tp`` on one device; 1,021 tokens
  take the exchange's column-block path, the other counts its row blocks).

* ``oneshot`` (CUDA): the one-shot exchange (``rl_engine.ops.det_gemm.oneshot``: the fp32
  subtrees through symmetric memory, one Triton kernel) by message size down to decode sizes
  (1 - 256 tokens x 4096), against NCCL's bf16 all-reduce and the NCCL exchange, each rank's
  output checked against the NCCL exchange's bitwise; where the one-shot path beats the NCCL
  exchange is the switch point (``ONESHOT_MAX_BYTES``: 4 MiB, from the 4 x H200 layer timings
  of 2026-11-27; larger messages are not timed with it here). The layer
  rows add ``rl_engine_per_group_*`` (the group products as one launch each: the path before the
  one-launch kernel) and, up to 256 tokens, ``rl_engine_oneshot_*``.

* ``node_dtype`` (``--node-dtype bf16`` or ``both``; issue 44 item 4): what bf16 tree nodes
  across ranks would save, at decode sizes (1 - 256 tokens x 4096). The same exchange timed with
  the fp32 subtrees (shipped) and with bf16 subtrees of the same element count (half the bytes):
  the NCCL ``Exchange`` (bf16 all-to-all, the received blocks widened to fp32 for the tree's top
  levels, one rounding, bf16 all-gather: ``exchange_fp32`` / ``exchange_bf16``) and a plain NCCL
  all-gather of the whole subtree (``allgather_fp32`` / ``allgather_bf16``: the one-shot
  exchange's traffic pattern), with NCCL's bf16 all-reduce and, on CUDA, the one-shot exchange
  (``oneshot_fp32``) as references. The one-shot kernel reads fp32 subtrees only (its buffer is
  fp32), so the bf16 payload is timed over NCCL only. Every rank's outputs are checked bitwise
  against the tree over the all-gathered subtrees (fp32 and bf16-rounded), so the bf16 rows time
  exactly the numerics ``benchmarks/tp_node_dtype.py`` measures. ``--node-dtype fp32`` (default):
  the parts above only (unchanged); ``bf16``: this part only (``DIR/tp_exchange_node_dtype.json``:
  the shipped results are not overwritten); ``both``: every part.

Times: CUDA events around ``iters`` back-to-back calls after a barrier, the slowest rank's
median of 5 repeats (microseconds); eager (what a trainer pays, host launch cost included) and
replayed from a CUDA graph (``*_graph_us``: GPU time only, what vLLM's CUDA graphs pay).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from rl_engine.harness.timing import RankTimer  # noqa: E402

HIDDEN = 4096
LAYERS = (("o_proj", 4096), ("down_proj", 14336))  # Llama-3-8B row-parallel layers: (name, K)
SMOKE = {"hidden": 256, "layers": (("o_proj", 256), ("down_proj", 896))}  # --device cpu


def _collective_rows(dist, group, t, rank, dev, timers, tokens, hidden) -> list[dict]:
    from rl_engine.ops.det_gemm.tp import Exchange

    ex = Exchange.over(group)
    return [_collective_case(dist, group, t, rank, dev, timers, m, hidden, ex) for m in tokens]


def _collective_case(dist, group, t, rank, dev, timers, m, hidden, ex) -> dict:
    timed, graphed = timers
    sub = torch.randn(m, hidden, device=dev)  # this rank's fp32 subtree
    part = sub.to(torch.bfloat16)
    rs_out = torch.empty(m // t, hidden, device=dev, dtype=torch.bfloat16)
    mn = m * hidden
    r = {
        "part": "collective",
        "tp": t,
        "tokens": m,
        "hidden": hidden,
        # NCCL reduces in place: each call reduces a fresh copy (the copy's time is clone_us)
        "all_reduce_us": timed(lambda: dist.all_reduce(part.clone(), group=group)),
        "clone_us": timed(lambda: part.clone()),
        "exchange_us": timed(lambda: ex(sub, None, torch.bfloat16)),
        "ring_bytes_per_rank": 2 * (t - 1) / t * 2 * mn,
        "exchange_bytes_per_rank": (t - 1) / t * 6 * mn,
    }
    graph = {
        "all_reduce_graph_us": graphed(lambda: dist.all_reduce(part, group=group)),
        "exchange_graph_us": graphed(lambda: ex(sub, None, torch.bfloat16)),
    }
    r.update(graph)
    if None not in graph.values():
        r["graph_ratio"] = graph["exchange_graph_us"] / graph["all_reduce_graph_us"]
    # the baseline without its copy (the faster of the two readings: conservative for us)
    r["all_reduce_net_us"] = max(r["all_reduce_us"] - r["clone_us"], 1e-3)
    r["ratio"] = r["exchange_us"] / r["all_reduce_net_us"]
    if dev.type == "cuda":  # gloo has no reduce-scatter
        r["reduce_scatter_us"] = timed(
            lambda: dist.reduce_scatter_tensor(rs_out, part, group=group)
        )
        r["exchange_scatter_us"] = timed(lambda: ex.scatter(sub, None, torch.bfloat16))
        r["scatter_ratio"] = r["exchange_scatter_us"] / r["reduce_scatter_us"]
    if rank == 0:
        print(f"TP {t} M={m:5d}: all-reduce {r['all_reduce_net_us']:8.1f} us, exchange "
              f"{r['exchange_us']:8.1f} us ({r['ratio']:.2f}x)"
              + (f"; reduce-scatter {r['reduce_scatter_us']:8.1f} us, exchange.scatter "
                 f"{r['exchange_scatter_us']:8.1f} us ({r['scatter_ratio']:.2f}x)"
                 if "scatter_ratio" in r else "")
              + (f"; graph replay {r['graph_ratio']:.2f}x" if "graph_ratio" in r else ""),
              flush=True)  # fmt: skip
    return r


ONESHOT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _one_shot(group, hidden, tokens):
    """An exchange whose one-shot path takes every message up to ``max(tokens)`` rows."""
    from rl_engine.ops.det_gemm import oneshot
    from rl_engine.ops.det_gemm.tp import Exchange

    ex = Exchange.over(group, one_shot=False)
    ex.one_shot = oneshot.OneShot.over(group, max_bytes=4 * max(tokens) * hidden)
    return ex


def _oneshot_rows(dist, group, t, rank, dev, timers, tokens, hidden) -> list[dict]:
    from rl_engine.ops.det_gemm.tp import Exchange

    one, nccl = _one_shot(group, hidden, tokens), Exchange.over(group, one_shot=False)
    return [_oneshot_case(dist, group, t, rank, dev, timers, m, hidden, one, nccl) for m in tokens]


def _case_row(part: str, t: int, m: int, hidden: int) -> dict:
    """The fields that name a row: its part, TP degree, token count and hidden size."""
    return {"part": part, "tp": t, "tokens": m, "hidden": hidden}


def _every_rank(dist, group, same: bool, dev) -> bool:
    """Whether ``same`` holds on every rank of ``group``."""
    ok = torch.tensor([float(same)], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item())


def _oneshot_case(dist, group, t, rank, dev, timers, m, hidden, one, nccl) -> dict:
    timed, graphed = timers
    sub = torch.randn(m, hidden, device=dev)
    part = sub.to(torch.bfloat16)
    same = torch.equal(one(sub, None, torch.bfloat16), nccl(sub, None, torch.bfloat16))
    r = {
        **_case_row("oneshot", t, m, hidden),
        "fp32_bytes": 4 * m * hidden,
        "bitwise_equal_nccl_exchange": _every_rank(dist, group, same, dev),
        "all_reduce_us": timed(lambda: dist.all_reduce(part, group=group)),
        "exchange_us": timed(lambda: nccl(sub, None, torch.bfloat16)),
        "oneshot_us": timed(lambda: one(sub, None, torch.bfloat16)),
        "all_reduce_graph_us": graphed(lambda: dist.all_reduce(part, group=group)),
        "exchange_graph_us": graphed(lambda: nccl(sub, None, torch.bfloat16)),
        "oneshot_graph_us": graphed(lambda: one(sub, None, torch.bfloat16)),
    }
    if r["oneshot_graph_us"] and r["all_reduce_graph_us"] and r["exchange_graph_us"]:
        r["oneshot_vs_all_reduce_graph"] = r["oneshot_graph_us"] / r["all_reduce_graph_us"]
        r["oneshot_vs_exchange_graph"] = r["oneshot_graph_us"] / r["exchange_graph_us"]
    if rank == 0:
        print(f"TP {t} one-shot M={m:4d}: {r['oneshot_graph_us']} us graph "
              f"(all-reduce {r['all_reduce_graph_us']}, NCCL exchange "
              f"{r['exchange_graph_us']}); == NCCL exchange: "
              f"{r['bitwise_equal_nccl_exchange']}", flush=True)  # fmt: skip
    return r


def _layer_rows(dist, group, t, rank, dev, timers, tokens, hidden, layers) -> list[dict]:
    from rl_engine.ops.det_gemm.tp import Exchange

    ex = Exchange.over(group, one_shot=False)
    small = [m for m in tokens if m <= max(ONESHOT_TOKENS)]
    one = _one_shot(group, hidden, small) if dev.type == "cuda" and small else None
    return [
        _layer_case(dist, group, t, rank, dev, timers, m, hidden, name, k, ex, one)
        for name, k in layers
        for m in tokens
    ]


def _layer_case(dist, group, t, rank, dev, timers, m, hidden, name, k, ex, one=None) -> dict:
    timed, graphed = timers
    from rl_engine.ops.det_gemm import tp as tpm

    dt = torch.bfloat16
    g = torch.Generator().manual_seed(1000 + k + m)  # the same full tensors on every rank
    x = torch.randn(m, k, generator=g).to(dev, dt)
    w = (torch.randn(hidden, k, generator=g) / k**0.5).to(dev, dt)
    lo, hi = rank * k // t, (rank + 1) * k // t
    xs, ws = x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous()

    def stock():
        y = xs @ ws.t()
        dist.all_reduce(y, group=group)
        return y

    def ours():
        return tpm.tp_linear(xs, ws, None, parallel="row", exchange=ex, tp=t)

    def per_group():  # the group products as one launch each (before the one-launch kernel)
        return ex(tpm.subtree_per_group(xs, ws.t(), 8 // t), None, dt)

    def oneshot():
        return tpm.tp_linear(xs, ws, None, parallel="row", exchange=one, tp=t)

    paths = [ours, per_group] + ([oneshot] if one is not None and m <= 256 else [])
    # every rank's output == the TP = 1 grouped product (one device), all ranks agreeing
    want = tpm.det_gemm_tp(x, w.t())
    same = _every_rank(dist, group, all(torch.equal(f(), want) for f in paths), dev)
    r = {
        "part": "layer",
        "layer": name,
        "tp": t,
        "tokens": m,
        "k": k,
        "n": hidden,
        "stock_us": timed(stock),
        "rl_engine_us": timed(ours),
        "bitwise_equal_tp1": same,
    }
    r["ratio"] = r["rl_engine_us"] / r["stock_us"]
    r["stock_graph_us"], r["rl_engine_graph_us"] = graphed(stock), graphed(ours)
    r["rl_engine_per_group_us"] = timed(per_group)
    r["rl_engine_per_group_graph_us"] = graphed(per_group)
    if oneshot in paths:
        r["rl_engine_oneshot_us"] = timed(oneshot)
        r["rl_engine_oneshot_graph_us"] = graphed(oneshot)
    if r["stock_graph_us"] and r["rl_engine_graph_us"]:
        r["graph_ratio"] = r["rl_engine_graph_us"] / r["stock_graph_us"]
    if rank == 0:
        print(f"TP {t} {name} M={m:5d}: cuBLAS + all-reduce {r['stock_us']:8.1f} us, "
              f"grouped + exchange {r['rl_engine_us']:8.1f} us ({r['ratio']:.2f}x), "
              f"== TP 1: {same}"
              + (f"; graph replay {r['graph_ratio']:.2f}x" if "graph_ratio" in r else ""),
              flush=True)  # fmt: skip
    return r


NODE_TOKENS = ONESHOT_TOKENS  # the node-dtype part: decode sizes


def _bf16_exchange(group):
    """The NCCL exchange with bf16 subtrees: the received blocks are widened to fp32 for the
    tree's top levels (bf16 nodes, fp32 adds, one rounding)."""
    from rl_engine.ops.det_gemm.tp import Exchange

    base = Exchange.over(group, one_shot=False)
    return Exchange(lambda x: base.all_to_all(x).float(), base.all_gather, base.rank, base.world)


def _node_rows(dist, group, t, rank, dev, timers, tokens, hidden) -> list[dict]:
    from rl_engine.ops.det_gemm.tp import Exchange

    ex32, ex16 = Exchange.over(group, one_shot=False), _bf16_exchange(group)
    one = _one_shot(group, hidden, tokens) if dev.type == "cuda" else None
    return [
        _node_case(dist, group, t, rank, dev, timers, m, hidden, ex32, ex16, one) for m in tokens
    ]


def _node_case(dist, group, t, rank, dev, timers, m, hidden, ex32, ex16, one) -> dict:
    from rl_engine.ops.det_gemm import tp as tpm

    timed, graphed = timers
    bf16 = torch.bfloat16
    sub = torch.randn(m, hidden, device=dev)  # this rank's fp32 subtree
    sub16 = sub.to(bf16)  # the same subtree as a bf16 node (rounded where it is computed)
    part = sub.to(bf16)
    got32, got16 = sub.new_empty(t * m, hidden), sub16.new_empty(t * m, hidden)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    paths = {
        "all_reduce": lambda: dist.all_reduce(part, group=group),
        "allgather_fp32": lambda: gather_into(got32, sub, group=group),
        "allgather_bf16": lambda: gather_into(got16, sub16, group=group),
        "exchange_fp32": lambda: ex32(sub, None, bf16),
        "exchange_bf16": lambda: ex16(sub16, None, bf16),
    }
    if one is not None:
        paths["oneshot_fp32"] = lambda: one(sub, None, bf16)
    # the bits: every rank's outputs == the tree over every rank's subtree (gathered)
    gather_into(got32, sub, group=group)
    every = got32.view(t, m, hidden)
    want32 = tpm.finish(tpm.combine(list(every)), None, bf16)
    want16 = tpm.finish(tpm.combine(list(every.to(bf16).float())), None, bf16)
    same = torch.equal(ex32(sub, None, bf16), want32)
    same = same and torch.equal(ex16(sub16, None, bf16), want16)
    if one is not None:
        same = same and torch.equal(one(sub, None, bf16), want32)
    r = {
        **_case_row("node_dtype", t, m, hidden),
        "subtree_bytes_fp32": 4 * m * hidden,
        "subtree_bytes_bf16": 2 * m * hidden,
        "bitwise_equal_tree": _every_rank(dist, group, same, dev),
    }
    for name, fn in paths.items():
        r[f"{name}_us"] = timed(fn)
        r[f"{name}_graph_us"] = graphed(fn)

    def best(name):  # graph replay (what vLLM's decode pays) where it ran, else eager
        return r[f"{name}_graph_us"] or r[f"{name}_us"]

    r["exchange_bf16_vs_fp32"] = best("exchange_bf16") / best("exchange_fp32")
    r["allgather_bf16_vs_fp32"] = best("allgather_bf16") / best("allgather_fp32")
    if one is not None:
        r["exchange_bf16_vs_oneshot_fp32"] = best("exchange_bf16") / best("oneshot_fp32")
    if rank == 0:
        print(f"TP {t} nodes M={m:4d}: exchange bf16 / fp32 {r['exchange_bf16_vs_fp32']:.2f}x, "
              f"all-gather bf16 / fp32 {r['allgather_bf16_vs_fp32']:.2f}x"
              + (f", exchange bf16 / one-shot fp32 {r['exchange_bf16_vs_oneshot_fp32']:.2f}x"
                 if one is not None else "")
              + f"; bits: {r['bitwise_equal_tree']}", flush=True)  # fmt: skip
    return r


def _worker(rank: int, world: int, store: str, out: str, quick: bool,
            node_dtype: str = "fp32") -> None:  # fmt: skip
    from rl_engine.harness._spawn import init

    dist = init(rank, world, store)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(rank)
    if cuda:
        tokens = (1024, 8192) if quick else (256, 1024, 4096, 8192, 16384)
        # 1021 rows do not split over the ranks: the exchange's column-block path
        layer_tokens = (1, 64, 1021, 8192) if quick else (1, 16, 64, 256, 1021, 1024, 4096, 8192)
        iters = 10 if quick else 20
        hidden, layers = HIDDEN, LAYERS
    else:
        tokens, layer_tokens, iters = (64,), (16, 13), 2
        hidden, layers = SMOKE["hidden"], SMOKE["layers"]
    small = (1, 16, 64, 256) if quick else NODE_TOKENS
    node_tokens = small if cuda else (1, 16)
    degrees = [d for d in (2, 4, 8) if d <= world]
    rows: list[dict] = []
    for t in degrees:
        group = dist.new_group(list(range(t)))
        if rank < t:
            timer = RankTimer(dist, group, iters, cuda=cuda)
            timers = (timer.eager, timer.graph)
            if node_dtype != "bf16":  # the shipped fp32 nodes' parts
                rows += _collective_rows(dist, group, t, rank, dev, timers, tokens, hidden)
                rows += _layer_rows(dist, group, t, rank, dev, timers, layer_tokens, hidden, layers)
                if cuda:
                    rows += _oneshot_rows(dist, group, t, rank, dev, timers, small, hidden)
            if node_dtype != "fp32":
                rows += _node_rows(dist, group, t, rank, dev, timers, node_tokens, hidden)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def plot(rows: list[dict], path: Path) -> None:
    coll = [r for r in rows if r["part"] == "collective"]
    layer = [r for r in rows if r["part"] == "layer"]

    def draw(axes):
        ax = axes[0]
        for t in sorted({r["tp"] for r in coll}):
            rs = sorted((r for r in coll if r["tp"] == t), key=lambda r: r["tokens"])
            ax.plot([r["tokens"] for r in rs], [r["ratio"] for r in rs], "o-", label=f"TP {t}")
            if all("scatter_ratio" in r for r in rs):
                ax.plot([r["tokens"] for r in rs], [r["scatter_ratio"] for r in rs], "s--",
                        label=f"TP {t}, SP (vs reduce-scatter)")  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.5, color="g", ls="--", lw=0.8, label="bytes ratio 1.5")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (rows of [M, hidden])")
        ax.set_ylabel("time / NCCL bf16 collective")
        ax.set_title("exchange vs NCCL all-reduce")
        ax.legend(fontsize=7)
        ax = axes[1]
        labels = [f"{r['layer']}\nTP{r['tp']} M{r['tokens']}" for r in layer]
        ax.bar(range(len(layer)), [r["ratio"] for r in layer])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(layer)), labels, fontsize=6, rotation=90)
        ax.set_ylabel("time / (cuBLAS + NCCL all-reduce)")
        ax.set_title("row-parallel layer forward")

    common.save_figure(path, draw, ncols=2, figsize=(12, 4.8))


def main() -> int:
    def extra(p):
        p.add_argument("--ranks", type=int, default=None, help="processes (default: every GPU)")
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        p.add_argument(
            "--node-dtype",
            choices=("fp32", "bf16", "both"),
            default="fp32",
            help="fp32: the shipped exchange's parts; bf16: only the fp32-vs-bf16 subtree "
            "payload part (tp_exchange_node_dtype.json); both: every part",
        )

    args = common.parse_args(__doc__.splitlines()[0], extra)
    from rl_engine.harness._spawn import spawn

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = args.ranks or (min(gpus, 8) if args.device == "cuda" else 2)
    if args.device == "cuda" and ranks < 2:
        print(f"tp_exchange: needs 2+ GPUs, {gpus} visible; nothing to measure")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        spawn(_worker, ranks, (out, args.quick, args.node_dtype), args.device)
        rows = json.loads(Path(out).read_text())
    coll = [r for r in rows if r["part"] == "collective"]
    layer = [r for r in rows if r["part"] == "layer"]
    summary = {}
    for t in sorted({r["tp"] for r in coll}):
        big = [r for r in coll if r["tp"] == t and r["tokens"] >= 4096] or [
            r for r in coll if r["tp"] == t
        ]
        summary[f"tp{t}_exchange_vs_all_reduce"] = common.geomean([r["ratio"] for r in big])
        if all("scatter_ratio" in r for r in big):
            summary[f"tp{t}_scatter_vs_reduce_scatter"] = common.geomean(
                [r["scatter_ratio"] for r in big]
            )
        if all("graph_ratio" in r for r in big):
            summary[f"tp{t}_exchange_vs_all_reduce_graph"] = common.geomean(
                [r["graph_ratio"] for r in big]
            )
        lr = [r for r in layer if r["tp"] == t]
        summary[f"tp{t}_layer_vs_stock"] = common.geomean([r["ratio"] for r in lr])
        if lr and all("graph_ratio" in r for r in lr):
            summary[f"tp{t}_layer_vs_stock_graph"] = common.geomean([r["graph_ratio"] for r in lr])
    one = [r for r in rows if r["part"] == "oneshot"]
    for t in sorted({r["tp"] for r in one}):
        rs = [r for r in one if r["tp"] == t and "oneshot_vs_all_reduce_graph" in r]
        if rs:
            summary[f"tp{t}_oneshot_vs_all_reduce_graph"] = common.geomean(
                [r["oneshot_vs_all_reduce_graph"] for r in rs]
            )
            # the largest message where one-shot still beats the NCCL exchange (graph replay)
            wins = [r["fp32_bytes"] for r in rs if r["oneshot_vs_exchange_graph"] < 1.0]
            summary[f"tp{t}_oneshot_wins_up_to_bytes"] = max(wins) if wins else 0
    nodes = [r for r in rows if r["part"] == "node_dtype"]
    for t in sorted({r["tp"] for r in nodes}):
        rs = [r for r in nodes if r["tp"] == t]
        for key in ("exchange_bf16_vs_fp32", "allgather_bf16_vs_fp32",
                    "exchange_bf16_vs_oneshot_fp32"):  # fmt: skip
            if all(key in r for r in rs):
                summary[f"tp{t}_{key}"] = common.geomean([r[key] for r in rs])
    summary["layers_bitwise_equal_tp1"] = all(r["bitwise_equal_tp1"] for r in layer)
    summary["oneshot_bitwise_equal_nccl"] = all(r["bitwise_equal_nccl_exchange"] for r in one)
    if nodes:
        summary["node_dtype_bitwise_equal_tree"] = all(r["bitwise_equal_tree"] for r in nodes)
    fields = {
        "ranks": ranks,
        "backend": "nccl" if args.device == "cuda" else "gloo (smoke run, not a measurement)",
        "baseline": "NCCL all_reduce / reduce_scatter_tensor of the bf16 partials; layer: "
        "cuBLAS bf16 GEMM of the shard + NCCL all_reduce",
        "ratio_definition": "rl_engine time / baseline time (lower is better); the all-reduce's "
        "time without the copy of its input (all_reduce_us - clone_us)",
        "bytes_ratio_on_paper": 1.5,
        "node_dtype": args.node_dtype,
    }
    if nodes:
        fields["node_dtype_definition"] = (
            "time with bf16 subtrees / time with fp32 subtrees (same element count), CUDA-graph "
            "replay where it ran, else eager; the one-shot kernel takes fp32 subtrees only: "
            "bf16 timed over NCCL (exchange, all-gather), one-shot fp32 as the reference"
        )
    bf16_only = args.node_dtype == "bf16"
    op = "tp_exchange_node_dtype" if bf16_only else "tp_exchange"
    common.finish(args.out, op, fields, summary=summary, rows=rows,
                  plot=None if bf16_only else plot)  # fmt: skip
    ok = summary["layers_bitwise_equal_tp1"] and summary["oneshot_bitwise_equal_nccl"]
    ok = ok and summary.get("node_dtype_bitwise_equal_tree", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
