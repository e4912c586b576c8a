"""Benchmark of ``linear_logp`` (Triton provider) against cuBLAS and materialised torch.

Usage: ``python benchmarks/bench_linear_logp.py [--out DIR] [--quick]`` (needs a CUDA device; on
a machine without one it prints why and exits 0 without writing anything).

Shape: T = 8192 tokens, H = 4096 (Llama-3-8B / Qwen3-8B), V = 151936 (Qwen), bf16. Figures
(``triton.testing.do_bench`` median; peak memory = ``torch.cuda.max_memory_allocated`` above
what is live before the call):

* forward: ``linear_logp(backend="triton")`` vs the bare cuBLAS LM-head GEMM ``h @ W.t()``
  (target <= 1.2x) and vs the Triton ``det_gemm`` of the same product; peak extra memory of
  the forward vs the fp32 [T, V] logits (target <= 5%).
* forward + backward (grads wrt hidden and weight): vs the three cuBLAS GEMMs of an LM head
  (``h @ W.t()``, ``dlogits @ W``, ``dlogits.t() @ h``; target <= 1.3x; the fused op
  recomputes the logits, i.e. four GEMMs) and vs materialised torch (``h @ W.t()`` -> fp32
  ``log_softmax`` -> gather, autograd).

Writes ``DIR/linear_logp.json`` (device, versions, every figure, ratios) and
``DIR/linear_logp.png`` when matplotlib is importable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import HIDDEN_SIZES, VOCAB_SIZES  # noqa: E402

from rl_engine.ops import linear_logp  # noqa: E402
from rl_engine.ops.det_gemm import triton as det_gemm_triton  # noqa: E402
from rl_engine.ops.linear_logp import triton as ll_triton  # noqa: E402

T_TOKENS = 8192
H = HIDDEN_SIZES[1]  # 4096
V = VOCAB_SIZES[1]  # 151936
TEMPERATURE = 1.0
TARGETS = {"fwd_vs_cublas": 1.2, "fwd_peak_frac_of_fp32_logits": 0.05, "fwdbwd_vs_cublas": 1.3}


def _inputs(t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return dict(
        h=torch.randn(t, H, device="cuda", generator=g).bfloat16(),
        w=(torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16(),
        tok=torch.randint(0, V, (t,), device="cuda", generator=g),
        g=torch.randn(t, device="cuda", generator=g),
        dlogits=(torch.randn(t, V, device="cuda", generator=g) * 1e-3).bfloat16(),
    )


def _torch_logp(h: torch.Tensor, w: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    logits = (h @ w.t()).float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(1, tok[:, None])[:, 0]


def _measure(name: str, fn: Callable[[], Any], quick: bool) -> dict[str, Any]:
    try:
        fn()  # compile / warm up
        torch.cuda.synchronize()
        row = {"path": name, "us": common.bench(fn, quick=quick), "peak_mib": common.peak_mib(fn)}
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        row = {"path": name, "error": f"OOM: {exc}"[:200]}
    print(row)
    return row


def _liger_row(hr: torch.Tensor, wr: torch.Tensor, tok: torch.Tensor, quick: bool) -> dict:
    """Liger's fused linear cross-entropy (the fastest LM-head loss users pick; gradients formed
    in its forward, bf16 weight-gradient accumulation), reduction "sum": the same three GEMMs of
    work as the summed token log-probs (no temperature: Liger has none; the work is the same)."""
    name = "fwd+bwd liger fused linear CE"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as exc:
        row = {"path": name, "error": f"liger-kernel not importable: {exc}"}
        print(row)
        return row

    def liger() -> None:
        loss = liger_fused_linear_cross_entropy(hr, wr, tok, reduction="sum")
        torch.autograd.grad(loss, (hr, wr))

    return _measure(name, liger, quick)


def _rows(t: int, quick: bool) -> list[dict[str, Any]]:
    x = _inputs(t)
    h, w, tok, g = x["h"], x["w"], x["tok"], x["g"]
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rows = [
        _measure("fwd cublas h@W.t()", lambda: h @ w.t(), quick),
        _measure("fwd triton det_gemm", lambda: det_gemm_triton.det_gemm(h, w.t()), quick),
        _measure(
            "fwd rl_engine linear_logp",
            lambda: linear_logp(h, w, tok, TEMPERATURE, backend="triton"),
            quick,
        ),
        _measure(
            "fwd rl_engine linear_logp+entropy",
            lambda: linear_logp(h, w, tok, TEMPERATURE, True, backend="triton"),
            quick,
        ),
    ]

    def three_gemms() -> None:
        h @ w.t()
        x["dlogits"] @ w
        x["dlogits"].t() @ h

    def fused() -> None:
        lp = linear_logp(hr, wr, tok, TEMPERATURE, backend="triton")
        torch.autograd.grad(lp, (hr, wr), g)

    def materialised() -> None:
        torch.autograd.grad(_torch_logp(hr, wr, tok), (hr, wr), g)

    rows.append(_measure("fwd+bwd cublas 3 GEMMs", three_gemms, quick))
    del x["dlogits"]  # [T, V] bf16: not live while the others are measured
    torch.cuda.empty_cache()
    rows.append(_measure("fwd+bwd rl_engine linear_logp", fused, quick))
    rows.append(_measure("fwd+bwd torch materialised", materialised, quick))
    rows.append(_liger_row(hr, wr, tok, quick))
    for r in rows:
        r.update(T=t, H=H, V=V, dtype="bfloat16")
    return rows


def _summary(rows: list[dict[str, Any]], t: int) -> dict[str, Any]:
    us = {r["path"]: r.get("us") for r in rows}
    peak = {r["path"]: r.get("peak_mib") for r in rows}
    fp32_logits_mib = t * V * 4 / 2**20
    s: dict[str, Any] = {"fp32_logits_mib": fp32_logits_mib, "targets": TARGETS}

    def ratio(a: str, b: str) -> float | None:
        return us[a] / us[b] if us.get(a) and us.get(b) else None

    s["fwd_vs_cublas"] = ratio("fwd rl_engine linear_logp", "fwd cublas h@W.t()")
    s["fwd_vs_triton_det_gemm"] = ratio("fwd rl_engine linear_logp", "fwd triton det_gemm")
    s["triton_det_gemm_vs_cublas"] = ratio("fwd triton det_gemm", "fwd cublas h@W.t()")
    out_mib = t * 4 * 3 / 2**20  # logp, lse (and entropy) outputs are not "extra"
    fwd_peak = peak.get("fwd rl_engine linear_logp")
    if fwd_peak is not None:
        s["fwd_peak_extra_mib"] = fwd_peak
        s["fwd_peak_frac_of_fp32_logits"] = max(fwd_peak - out_mib, 0.0) / fp32_logits_mib
    s["fwdbwd_vs_cublas"] = ratio("fwd+bwd rl_engine linear_logp", "fwd+bwd cublas 3 GEMMs")
    s["fwdbwd_vs_torch_materialised"] = ratio(
        "fwd+bwd rl_engine linear_logp", "fwd+bwd torch materialised"
    )
    s["fwdbwd_vs_liger"] = ratio("fwd+bwd rl_engine linear_logp", "fwd+bwd liger fused linear CE")
    liger_peak = peak.get("fwd+bwd liger fused linear CE")
    if liger_peak and peak.get("fwd+bwd rl_engine linear_logp"):
        s["fwdbwd_peak_vs_liger"] = peak["fwd+bwd rl_engine linear_logp"] / liger_peak
    bwd_peak = peak.get("fwd+bwd rl_engine linear_logp")
    if bwd_peak is not None:
        grads_mib = (t * H + V * H) * 2 / 2**20  # dhidden and dweight themselves (bf16)
        s["fwdbwd_peak_extra_mib"] = bwd_peak
        s["fwdbwd_peak_frac_of_fp32_logits_excl_grads"] = (
            max(bwd_peak - grads_mib, 0.0) / fp32_logits_mib
        )
    s["chunks"] = {
        "TOKEN_CHUNK": ll_triton.TOKEN_CHUNK,
        "BWD_TOKEN_CHUNK": ll_triton.BWD_TOKEN_CHUNK,
        "VOCAB_SLICE": ll_triton._vocab_slice(H),
        "DH_CHUNK": ll_triton.DH_CHUNK,
    }
    return s


def _plot(out: Path, rows: list[dict[str, Any]], t: int) -> None:
    ok = [r for r in rows if "us" in r]

    def draw(axes):
        names = [r["path"].replace(" ", "\n", 1) for r in ok]
        axes[0].barh(names, [r["us"] / 1e3 for r in ok])
        axes[0].set_xlabel("ms (median)")
        axes[0].set_title(f"linear_logp, T={t}, H={H}, V={V}, bf16")
        axes[1].barh(names, [r["peak_mib"] / 1024 for r in ok], color="tab:red")
        axes[1].axvline(t * V * 4 / 2**30, color="k", ls="--", label="fp32 [T, V] logits")
        axes[1].set_xlabel("peak extra GiB")
        axes[1].legend()

    common.save_figure(out / "linear_logp.png", draw, ncols=2, figsize=(13, 4.5), dpi=120)


def main() -> None:
    args = common.cuda_args(__doc__, "bench_linear_logp: needs a CUDA device; nothing measured")
    if args is None:
        return
    t = T_TOKENS
    rows = _rows(t, args.quick)
    common.print_table(rows, ["path", "us", "peak_mib", "error"])
    summary = _summary(rows, t)
    for k, v in summary.items():
        print(f"{k}: {v}")
    common.write_json(args.out, "linear_logp", {"summary": summary, "rows": rows})
    _plot(args.out, rows, t)


if __name__ == "__main__":
    main()
