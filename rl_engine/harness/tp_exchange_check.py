"""GPU self-check and timing of the TP reduction's fast paths (issue 44 items 1, 2), one
process per GPU under torchrun (NCCL, symmetric memory)::

    torchrun --nproc-per-node 2 -m rl_engine.harness.tp_exchange_check --out "$OUT"
    torchrun --nproc-per-node 4 -m rl_engine.harness.tp_exchange_check --out "$OUT"

Checks, every rank, bitwise (``torch.equal``; any failure: exit status 1):

1. ``subtree``: the one-launch subtree kernel == the per-group launches
   (``tp.subtree_per_group``), bf16 and fp32, the Llama-3-8B row-parallel shards of this TP
   degree (``o_proj`` K 4096 / t, ``down_proj`` K 14336 / t; N 4096) and the GLU column-parallel
   input gradient (gate/up, N 2 x 14336 / t -> K 4096), rows 1 .. 8192 (odd counts included),
   every config of the launch table;
2. ``oneshot``: the one-shot exchange == the NCCL exchange == the TP = 1 bits (every rank's
   subtree regenerated locally, ``finish(combine(...))``), whole result and sequence
   parallelism's row blocks, 1 .. 256 tokens x hidden 4096, bf16 with a bias; then the same
   exchange captured in a CUDA graph and replayed on fresh subtrees (the epochs advance inside
   the graph);
3. ``layer``: a row-parallel layer through ``tp_linear`` (one-launch subtree written straight
   into the symmetric buffer, one-shot exchange) == ``det_gemm_tp`` of the whole layer on one
   GPU (TP = 1).

Timing (CUDA events, the slowest rank's median; eager and CUDA-graph replay), by message size:
NCCL ``all_reduce`` of bf16 partials (the stock baseline), the NCCL exchange (all-to-all +
all-gather of fp32 subtrees), the one-shot exchange; and the ``down_proj`` layer: cuBLAS +
all-reduce, per-group launches + NCCL exchange (the path before issue 44), one launch + NCCL
exchange, one launch + one-shot. A table on stdout; ``OUT/tp_exchange_check_tp<t>.json``
(date, code hash, versions, device, every row). ``--quick``: fewer sizes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch

from rl_engine.harness.timing import RankTimer

HIDDEN = 4096
FFN = 14336
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _agree(dist, group, ok: bool) -> bool:
    t = torch.tensor([1.0 if ok else 0.0], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _rank_subtree(rank: int, m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return (torch.randn(m, n, generator=g) * 4.0 ** (rank - 1)).cuda()


def check_subtree(t: int, rank: int, quick: bool) -> list[dict]:
    """Item 1: the one-launch kernel == the per-group launches (each rank checks its shard)."""
    from rl_engine.ops.det_gemm import config as cfgs
    from rl_engine.ops.det_gemm import tp
    from rl_engine.ops.det_gemm import triton as dtr

    rows = []
    ms = (1, 7, 16, 17, 64, 255, 1021, 4096) if quick else (
        1, 2, 7, 16, 17, 33, 64, 65, 128, 255, 256, 257, 1021, 2048, 4096, 8192)  # fmt: skip
    shapes = [("o_proj", HIDDEN // t, HIDDEN, False), ("down_proj", FFN // t, HIDDEN, False),
              ("gate_up.dx", 2 * FFN // t, HIDDEN, True)]  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        for name, k, n, glu in shapes:
            for m in ms if dtype == torch.bfloat16 else ms[:6]:
                g = torch.Generator().manual_seed(m * 31 + k + rank)
                a = torch.randn(m, k, generator=g).to("cuda", dtype)
                w = (torch.randn(n if not glu else k, k if not glu else n, generator=g)
                     / k**0.5).to("cuda", dtype)  # fmt: skip
                b = w.t() if not glu else w  # row: weight.t(); column dx: the weight itself
                ref = tp.subtree_per_group(a, b, tp.TP_GROUPS // t, glu=glu, backend="triton")
                got = dtr.det_gemm_tp_subtree(a, b, tp.TP_GROUPS // t, glu=glu)
                same = torch.equal(got, ref)
                cfg_same = True
                if m in (17, 255):
                    for cfg in cfgs.all_tp_subtree_configs(dtype):
                        out = dtr.det_gemm_tp_subtree(a, b, tp.TP_GROUPS // t, glu=glu, cfg=cfg)
                        cfg_same &= torch.equal(out, ref)
                rows.append({"check": "subtree", "tp": t, "shape": name, "dtype": str(dtype),
                             "tokens": m, "equal": same and cfg_same})  # fmt: skip
                if not (same and cfg_same):
                    print(f"rank {rank}: subtree MISMATCH {name} {dtype} M={m} "
                          f"(kernel {same}, every config {cfg_same})", flush=True)  # fmt: skip
    return rows


def check_oneshot(dist, group, t, rank, timer, tokens, one, nccl) -> list[dict]:
    """Item 2: one-shot == NCCL exchange == TP 1, eager and replayed; times by message size."""
    bias = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)).to(
        "cuda", torch.bfloat16
    )
    return [_oneshot_case(dist, group, t, rank, timer, m, one, nccl, bias) for m in tokens]


def _oneshot_case(dist, group, t, rank, timer, m, one, nccl, bias) -> dict:
    from rl_engine.ops.det_gemm import tp

    n = HIDDEN
    subs = [_rank_subtree(r, m, n, seed=m) for r in range(t)]
    want = tp.finish(tp.combine(subs), bias, torch.bfloat16)  # TP = 1 bits
    sub = subs[rank]
    got_one = one(sub, bias, torch.bfloat16)
    got_nccl = nccl(sub, bias, torch.bfloat16)
    ok = torch.equal(got_one, want) and torch.equal(got_nccl, want)
    if m % t == 0:
        h = m // t
        mine = want[rank * h : (rank + 1) * h]
        ok &= torch.equal(one.scatter(sub, bias, torch.bfloat16), mine)
        ok &= torch.equal(nccl.scatter(sub, bias, torch.bfloat16), mine)
    # CUDA graph: capture one exchange of a static input, replay it on fresh subtrees
    static = sub.clone()
    holder = {}
    torch.cuda.synchronize()
    dist.barrier(group=group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        holder["out"] = one(static, bias, torch.bfloat16)
    for rep in range(3):
        fresh = [_rank_subtree(r, m, n, seed=m + 7 + rep) for r in range(t)]
        static.copy_(fresh[rank])
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(holder["out"], tp.finish(tp.combine(fresh), bias, torch.bfloat16))
    del graph
    ok = _agree(dist, group, ok)
    part = sub.to(torch.bfloat16)
    r = {
        "check": "oneshot",
        "tp": t,
        "tokens": m,
        "hidden": n,
        "fp32_bytes": 4 * m * n,
        "equal_nccl_tp1_graph": ok,
        "all_reduce_us": timer.eager(lambda: dist.all_reduce(part, group=group)),
        "nccl_exchange_us": timer.eager(lambda: nccl(sub, bias, torch.bfloat16)),
        "oneshot_us": timer.eager(lambda: one(sub, bias, torch.bfloat16)),
        "all_reduce_graph_us": timer.graph(lambda: dist.all_reduce(part, group=group)),
        "nccl_exchange_graph_us": timer.graph(lambda: nccl(sub, bias, torch.bfloat16)),
        "oneshot_graph_us": timer.graph(lambda: one(sub, bias, torch.bfloat16)),
    }
    r["oneshot_vs_all_reduce_graph"] = r["oneshot_graph_us"] / r["all_reduce_graph_us"]
    r["nccl_exchange_vs_all_reduce_graph"] = r["nccl_exchange_graph_us"] / r["all_reduce_graph_us"]
    _log(rank, f"TP {t} {m:5d} x {n} ({4 * m * n / 1024:7.0f} KiB fp32): bits "
               f"{'ok' if ok else 'MISMATCH'}; graph replay: all-reduce "
               f"{r['all_reduce_graph_us']:7.1f} us, NCCL exchange "
               f"{r['nccl_exchange_graph_us']:7.1f} us, one-shot {r['oneshot_graph_us']:7.1f}"
               f" us ({r['oneshot_vs_all_reduce_graph']:.2f}x); eager one-shot "
               f"{r['oneshot_us']:7.1f} us vs all-reduce {r['all_reduce_us']:7.1f} us")  # fmt: skip
    return r


def check_layer(dist, group, t, rank, timer, tokens, one, nccl) -> list[dict]:
    """Item 1 + 2 end to end: the ``down_proj`` row-parallel layer, four ways; bits vs TP 1."""
    return [_layer_case(dist, group, t, rank, timer, m, one, nccl) for m in tokens]


def _layer_case(dist, group, t, rank, timer, m, one, nccl) -> dict:
    from rl_engine.ops.det_gemm import tp

    k, n, dt = FFN, HIDDEN, torch.bfloat16
    g = torch.Generator().manual_seed(1000 + m)
    x = torch.randn(m, k, generator=g).to("cuda", dt)
    w = (torch.randn(n, k, generator=g) / k**0.5).to("cuda", dt)
    lo, hi = rank * k // t, (rank + 1) * k // t
    xs, ws = x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous()
    groups = tp.TP_GROUPS // t

    def stock():
        y = xs @ ws.t()
        dist.all_reduce(y, group=group)
        return y

    def per_group():  # the path before the one-launch kernel: a launch per group
        sub = tp.subtree_per_group(xs, ws.t(), groups, backend="triton")
        return nccl(sub, None, dt)

    def fused_nccl():
        return tp.tp_linear(xs, ws, None, parallel="row", exchange=nccl, tp=t)

    def fused_one():  # the subtree kernel writes into the symmetric buffer directly
        return tp.tp_linear(xs, ws, None, parallel="row", exchange=one, tp=t)

    want = tp.det_gemm_tp(x, w.t())
    ok = all(torch.equal(f(), want) for f in (per_group, fused_nccl, fused_one))
    ok = _agree(dist, group, ok)
    r = {"check": "layer", "layer": "down_proj", "tp": t, "tokens": m, "k": k, "n": n,
         "equal_tp1": ok}  # fmt: skip
    for name, f in (("stock", stock), ("per_group_nccl", per_group),
                    ("fused_nccl", fused_nccl), ("fused_oneshot", fused_one)):  # fmt: skip
        r[f"{name}_us"] = timer.eager(f)
        r[f"{name}_graph_us"] = timer.graph(f)
    for name in ("per_group_nccl", "fused_nccl", "fused_oneshot"):
        r[f"{name}_vs_stock_graph"] = r[f"{name}_graph_us"] / r["stock_graph_us"]
    _log(rank, f"TP {t} down_proj M={m:5d}: bits {'ok' if ok else 'MISMATCH'}; graph: "
               f"cuBLAS+all-reduce {r['stock_graph_us']:7.1f} us, per-group+NCCL "
               f"{r['per_group_nccl_graph_us']:7.1f}, one-launch+NCCL "
               f"{r['fused_nccl_graph_us']:7.1f}, one-launch+one-shot "
               f"{r['fused_oneshot_graph_us']:7.1f} "
               f"({r['fused_oneshot_vs_stock_graph']:.2f}x stock)")  # fmt: skip
    return r


def _info() -> dict:
    from rl_engine.run_info import code_hash

    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "code_hash": code_hash(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": tv,
        "device": torch.cuda.get_device_name(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].rstrip(":"))
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--skip", default="", help="comma list of parts to skip: subtree,oneshot,layer")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print("tp_exchange_check: run under torchrun on 2+ GPUs (see the module doc)")
        return 2
    import torch.distributed as dist

    from rl_engine.ops.det_gemm import oneshot, tp

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    group = dist.group.WORLD
    t, rank = dist.get_world_size(), dist.get_rank()
    skip = set(filter(None, args.skip.split(",")))
    tokens = (1, 16, 64, 256) if args.quick else DECODE_TOKENS
    timer = RankTimer(dist, group, 10 if args.quick else 50, require_graph=True)
    # one-shot for every size measured here (1 - 256 tokens x 4096: up to 4 MiB of fp32)
    one = tp.Exchange.over(group, one_shot=False)
    one.one_shot = oneshot.OneShot.over(group, max_bytes=4 * max(tokens) * HIDDEN)
    nccl = tp.Exchange.over(group, one_shot=False)
    rows: list[dict] = []
    if "subtree" not in skip:
        rows += check_subtree(t, rank, args.quick)
        _log(rank, f"subtree: {sum(r['equal'] for r in rows)} / {len(rows)} equal (rank 0)")
    if "oneshot" not in skip:
        rows += check_oneshot(dist, group, t, rank, timer, tokens, one, nccl)
    if "layer" not in skip:
        rows += check_layer(dist, group, t, rank, timer, tokens + (1021, 4096), one, nccl)
    ok = _agree(dist, group, all(r.get("equal", r.get("equal_tp1", True)) for r in rows)
                and all(r.get("equal_nccl_tp1_graph", True) for r in rows))  # fmt: skip
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {**_info(), "tp": t, "switch_bytes": oneshot.ONESHOT_MAX_BYTES,
               "all_bitwise_equal": ok, "rows": rows}  # fmt: skip
        path = out / f"tp_exchange_check_tp{t}.json"
        path.write_text(json.dumps(doc, indent=1))
        print(f"{'PASS' if ok else 'FAIL'}: every check bitwise equal: {ok}; wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
