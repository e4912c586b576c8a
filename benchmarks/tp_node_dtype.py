"""Accuracy of bf16 against fp32 tree nodes across tensor-parallel ranks (issue 44, item 4), CPU.

Usage: ``python benchmarks/tp_node_dtype.py [--out DIR] [--quick]`` (``--quick``: 1 and 16
tokens only). Writes ``DIR/tp_node_dtype.json`` (default ``benchmarks/results/cpu``) and prints a
table. The timing half (what the halved bytes save) needs GPUs:
``benchmarks/bench_tp_exchange.py --node-dtype bf16``.

A row-parallel layer's K is cut into ``G = 8`` groups; each group's product is an fp32 partial;
the partials are added by the fixed pair tree of :mod:`rl_engine.ops.det_gemm.tp`; at TP ``t``
rank ``r`` computes the subtree of its ``8 / t`` groups and the ranks exchange these subtrees.
Per row-parallel shape (``shapes.TP_ROW_PARALLEL_SHAPES``), token count and TP degree, with bf16
inputs (activations ``N(0, 1)``, weights ``N(0, 1 / sqrt(K))``):

* ``exact``: ``x @ w.t()`` in float64 (torch on the CPU: a BLAS float64 GEMM, whose own rounding,
  ~1e-16 relative, is far below a bf16 ulp; the figures are host-independent up to it);
* ``fp32`` (shipped): the library's path: the group partials of the ``native`` provider
  (``tp.subtree``, one group each), the ranks' subtrees and the top levels by ``tp.pair_tree`` /
  ``tp.combine``, one rounding (``tp.finish``); checked bitwise against ``tp.subtree`` of every
  rank's shard and against ``tp.det_gemm_tp`` (the TP = 1 bits) on the first rows;
* ``bf16_rank`` (TBIK's choice, what the brief calls (c)): every rank's subtree rounded to bf16
  before the exchange (its own too), the top levels added in fp32 in the same tree order, one
  rounding at the end. Its bits depend on ``t`` (at TP = 1 nothing is rounded): it is not
  TP-invariant;
* ``bf16_levels`` (the TP-invariant form of bf16 nodes): every node that is some degree's rank
  subtree (the 8 groups, the 4 pairs, the 2 halves) rounded to bf16 at every degree, TP = 1
  included; the same bits at every ``t``, the exchange's payload bf16 at every ``t``.

Per case: the share of output elements whose bf16 value differs from the shipped one, the max
and mean ``|out - exact|`` in units of the bf16 ulp of ``exact`` (``2^(floor(log2|exact|) -
7)``), and the bytes a rank sends: all-gather form (the one-shot exchange reads every other
rank's whole subtree) ``(t-1) M N x 4`` (fp32) vs ``x 2`` (bf16); the NCCL ``Exchange``
(all-to-all of the subtrees' blocks, all-gather of the rounded bf16 blocks) ``(t-1)/t M N x (4 +
2)`` vs ``x (2 + 2)``. Elementwise fp32 arithmetic only (no BLAS) outside the float64 reference:
the fp32 / bf16 outputs are the same bits on any host. The native provider's partials differ in
low bits from the Triton / CUDA providers' (other families); the accuracy statistics carry over.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import shapes  # noqa: E402

from rl_engine.ops.det_gemm import tp  # noqa: E402

G = tp.TP_GROUPS
DEGREES = (2, 4, 8)
TOKENS = (1, 16, 256)
QUICK_TOKENS = (1, 16)
BACKEND = "native"  # elementwise fp32 products in a fixed order: no BLAS, the same bits anywhere
CHECK_ROWS = 2  # rows checked bitwise against the library's own subtree / det_gemm_tp
BF16 = torch.bfloat16


def group_partials(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[G, M, N]`` fp32: group ``g``'s product ``a[:, K_g] @ b[K_g]``, the library's leaf (a
    one-group ``tp.subtree``: the provider's fp32 product)."""
    step = a.shape[1] // G
    return torch.stack(
        [
            tp.subtree(a[:, i : i + step], b[i : i + step], 1, backend=BACKEND)
            for i in range(0, a.shape[1], step)
        ]
    )


def rank_subtrees(parts: torch.Tensor, t: int) -> list[torch.Tensor]:
    """Rank ``r``'s fp32 subtree at TP ``t``: the pair tree of its ``G / t`` contiguous groups."""
    per = G // t
    return [tp.pair_tree(parts[r * per : (r + 1) * per]) for r in range(t)]


def fp32_nodes(parts: torch.Tensor, t: int) -> torch.Tensor:
    """Shipped numerics: fp32 subtrees exchanged, combined in tree order, one rounding."""
    return tp.finish(tp.combine(rank_subtrees(parts, t)), None, BF16)


def bf16_rank_nodes(parts: torch.Tensor, t: int) -> torch.Tensor:
    """Every rank's subtree rounded to bf16 before the exchange, fp32 top levels, one rounding."""
    subs = [s.to(BF16).float() for s in rank_subtrees(parts, t)]
    return tp.finish(tp.combine(subs), None, BF16)


def bf16_level_nodes(parts: torch.Tensor) -> torch.Tensor:
    """Every node that is a rank subtree at some degree (8, 4, 2 nodes per level) rounded to
    bf16, each add in fp32, the root rounded: the same at every TP degree."""
    x = parts.to(BF16).float()
    while x.shape[0] > 1:
        x = (x[0::2] + x[1::2]).to(BF16).float()
    return x[0].to(BF16)


def ulp_error(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``|out - exact|`` in units of the bf16 ulp at ``exact`` (8 significant bits)."""
    _, e = torch.frexp(exact)  # |exact| = m 2^e, m in [0.5, 1): ulp = 2^(e - 1 - 7)
    ulp = torch.ldexp(torch.ones_like(exact), e - 8)
    return (out.double() - exact).abs() / ulp


def check_library(a: torch.Tensor, b: torch.Tensor, parts: torch.Tensor) -> bool:
    """The first rows of the shipped path == the library's own ``tp.subtree`` of every rank's
    shard and its ``det_gemm_tp`` (the TP = 1 bits), bitwise, at every degree."""
    a, parts = a[:CHECK_ROWS], parts[:, :CHECK_ROWS]
    k = a.shape[1]
    want = tp.det_gemm_tp(a, b, backend=BACKEND)
    ok = True
    for t in DEGREES:
        step = k // t
        for r, sub in enumerate(rank_subtrees(parts, t)):
            lib = tp.subtree(a[:, r * step : (r + 1) * step], b[r * step : (r + 1) * step],
                             G // t, backend=BACKEND)  # fmt: skip
            ok &= torch.equal(lib, sub)
        ok &= torch.equal(fp32_nodes(parts, t), want)
    return bool(ok)


def share(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x != y).float().mean().item()


def measure(a: torch.Tensor, b: torch.Tensor, name: str, *, check: bool = False) -> list[dict]:
    """The rows of one ``a [M, K] @ b [K, N]`` (bf16): one per TP degree for ``bf16_rank``, one
    for ``bf16_levels``; ``check``: run :func:`check_library` (``library_bitwise``)."""
    m, k = a.shape
    n = b.shape[1]
    exact = a.double() @ b.double()
    parts = group_partials(a, b)
    ref = fp32_nodes(parts, 1)  # the shipped bits (the same at every degree)
    rms = exact.square().mean().sqrt().item()
    base = {"shape": name, "k": k, "n": n, "tokens": m, "elements": m * n, "exact_rms": rms}
    base.update(_errors("fp32", ref, exact, rms))
    if check:
        base["library_bitwise"] = check_library(a, b, parts)
    rows, outs = [], []
    for t in DEGREES:
        assert torch.equal(fp32_nodes(parts, t), ref)  # the shipped numerics: TP-invariant
        out = bf16_rank_nodes(parts, t)
        outs.append(out)
        rows.append({**base, "variant": "bf16_rank", "tp": t, "differ_share": share(out, ref),
                     **_errors("bf16", out, exact, rms), **_bytes(m, n, t)})  # fmt: skip
    # bf16_rank at TP 2, 4, 8 (and TP 1 = the shipped bits) do not agree with each other
    tp_dep = torch.zeros_like(ref, dtype=torch.bool)
    for o in outs[1:]:
        tp_dep |= o != outs[0]
    rows[-1]["tp_dependent_share"] = tp_dep.float().mean().item()
    lv = bf16_level_nodes(parts)
    rows.append({**base, "variant": "bf16_levels", "tp": "any", "differ_share": share(lv, ref),
                 **_errors("bf16", lv, exact, rms), **_bytes(m, n, max(DEGREES))})  # fmt: skip
    return rows


def _errors(tag: str, out: torch.Tensor, exact: torch.Tensor, rms: float) -> dict:
    """Max, mean, median and 99th percentile of the error in bf16 ulps at ``exact`` (the max:
    outputs near 0 after cancellation, where an ulp is tiny), and the max absolute error over
    the output's RMS (the scale an ulp has at a typical output: 2^-8 .. 2^-7 of it)."""
    err = ulp_error(out, exact).flatten()
    q = torch.quantile(err, torch.tensor([0.5, 0.99], dtype=err.dtype)).tolist()
    return {
        f"{tag}_max_ulp": err.max().item(),
        f"{tag}_mean_ulp": err.mean().item(),
        f"{tag}_median_ulp": q[0],
        f"{tag}_p99_ulp": q[1],
        f"{tag}_max_abs_over_rms": (out.double() - exact).abs().max().item() / rms,
    }


def _bytes(m: int, n: int, t: int) -> dict:
    mn = m * n
    return {
        "allgather_bytes_fp32": 4 * mn * (t - 1),
        "allgather_bytes_bf16": 2 * mn * (t - 1),
        "exchange_bytes_fp32": (t - 1) / t * 6 * mn,
        "exchange_bytes_bf16": (t - 1) / t * 4 * mn,
    }


def inputs(shape: shapes.GemmShape, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 activations ``N(0, 1)`` [M, K] and the weight ``N(0, 1/sqrt(K))`` as ``b`` [K, N];
    seeded by the shape and ``m`` (CPU generator: the same draws on every host)."""
    gen = torch.Generator().manual_seed(shape.k * 7919 + shape.n)
    w = (torch.randn(shape.n, shape.k, generator=gen) / shape.k**0.5).to(BF16)
    gen = torch.Generator().manual_seed(shape.k * 7919 + shape.n + 104729 * m)
    x = torch.randn(m, shape.k, generator=gen).to(BF16)
    return x, w.t()


_STATS = ("max_ulp", "mean_ulp", "median_ulp", "p99_ulp", "max_abs_over_rms")


def summarize(rows: list[dict]) -> dict:
    """Worst case over the shapes and token counts of every figure (the largest value; for the
    differ share also the smallest)."""
    out: dict = {"library_bitwise": all(r.get("library_bitwise", True) for r in rows)}
    fp = {(r["shape"], r["tokens"]): r for r in rows}.values()
    for stat in _STATS:
        out[f"fp32_{stat}"] = max(r[f"fp32_{stat}"] for r in fp)
    groups = [(f"bf16_rank_tp{t}", [r for r in rows if r["tp"] == t]) for t in DEGREES]
    groups.append(("bf16_levels", [r for r in rows if r["variant"] == "bf16_levels"]))
    for key, rs in groups:
        out[f"{key}_differ_share_min"] = min(r["differ_share"] for r in rs)
        out[f"{key}_differ_share_max"] = max(r["differ_share"] for r in rs)
        for stat in _STATS:
            out[f"{key}_{stat}"] = max(r[f"bf16_{stat}"] for r in rs)
    dep = [r["tp_dependent_share"] for r in rows if "tp_dependent_share" in r]
    out["bf16_rank_tp_dependent_share_min"] = min(dep)
    return out


def main() -> int:
    args = common.parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    tokens = QUICK_TOKENS if args.quick else TOKENS
    rows: list[dict] = []
    for shape in shapes.TP_ROW_PARALLEL_SHAPES:
        for i, m in enumerate(tokens):
            t0 = time.perf_counter()
            x, b = inputs(shape, m)
            rows += measure(x, b, shape.name, check=i == 0)
            print(f"{shape.name} M={m}: {time.perf_counter() - t0:.0f} s", flush=True)
    cols = ["shape", "tokens", "variant", "tp", "differ_share", "fp32_mean_ulp", "fp32_p99_ulp",
            "fp32_max_ulp", "bf16_mean_ulp", "bf16_median_ulp", "bf16_p99_ulp", "bf16_max_ulp",
            "fp32_max_abs_over_rms", "bf16_max_abs_over_rms", "allgather_bytes_fp32",
            "allgather_bytes_bf16"]  # fmt: skip
    common.print_table(rows, cols)
    fields = {
        "issue": "44 item 4: bf16 tree nodes across TP ranks vs fp32",
        "provider": f"{BACKEND} ({tp.family('cpu', BACKEND)})",
        "groups": G,
        "inputs": "bf16; activations N(0, 1); weights N(0, 1/sqrt(K)); CPU generator seeds",
        "variants": {
            "fp32": "shipped: fp32 rank subtrees, fp32 top levels, one rounding (TP-invariant)",
            "bf16_rank": "each rank's subtree rounded to bf16 before the exchange (its own "
            "too), fp32 top levels in the same order, one rounding; bits depend on TP",
            "bf16_levels": "every node of the 8-, 4- and 2-node levels rounded to bf16 at "
            "every degree (the TP-invariant form of bf16 nodes)",
        },
        "error_unit": "bf16 ulp at the float64 result: 2^(floor(log2|exact|) - 7)",
        "differ_share": "share of output elements whose bf16 value differs from the fp32 "
        "nodes' (= from the TP = 1 bits)",
        "bytes": "per rank sent: allgather_* = (t-1) M N x 4 | 2 (the one-shot / all-gather "
        "form); exchange_* = (t-1)/t M N x (4 + 2) | (2 + 2) (NCCL Exchange: all-to-all of the "
        "subtree blocks + all-gather of the rounded bf16 blocks)",
        "host_independence": "the fp32 / bf16 outputs use elementwise fp32 arithmetic only (no "
        "BLAS): the same bits on any host; the errors are relative to a float64 torch.mm "
        "(BLAS) reference, so they are host-independent only up to its float64 rounding",
    }
    summary = summarize(rows)
    common.finish(args.out, "tp_node_dtype", fields, summary=summary, rows=rows, digits=4)
    return 0 if summary["library_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
