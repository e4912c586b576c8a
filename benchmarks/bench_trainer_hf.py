"""Trainer step time against the stacks RL users run: HF + SDPA flash, and HF + SDPA + Liger.

Usage (GPU machine; Liger-Kernel and megatron-core on PYTHONPATH, see PLATFORMS.md):
``python benchmarks/bench_trainer_hf.py [--out DIR] [--quick] [--layers N] [--seq S] [--batch B]
[--rows hf_sdpa,rl_engine_hf,...] [--profile]``.

Model (~1B, Qwen2-shaped, the shape of ``bench_trainer.py``): 16 layers, hidden 2048, 16 query /
8 KV heads (head dim 128), FFN 5632 (SwiGLU), vocab 151936, untied LM head, QKV bias, bf16,
batch 2 x 4096 tokens. One step = forward + backward of the summed token log-probs at T = 1, on
the same weights and tokens for every row:

* ``hf_sdpa``: transformers with ``attn_implementation="sdpa"`` (flash), logits -> fp32
  ``log_softmax`` -> gather;
* ``hf_liger``: the same + Liger's RMSNorm / SwiGLU / RoPE kernels, and the LM head through Liger's
  fused linear cross-entropy (``-sum CE`` = summed log-probs; no [tokens, vocab] logits);
* ``rl_engine_hf``: ``rl_engine.adapters.hf.patch_model`` + ``token_logprobs``
  (``rl_engine_hf_unfused``: the same with ``fuse_projections=False``; ``rl_engine_hf_g8``: the
  same with ``RL_ENGINE_TP_GROUPS=8``, the TP-invariant grouped reduction of ``o_proj`` /
  ``down_proj`` at TP 1 — what making it the default would cost a trainer, issue 44 item 3);
* ``rl_engine_megatron`` / ``megatron_local``: ``bench_trainer.py``'s two Megatron GPT rows (the
  rl_engine spec and Megatron's local spec; same shape, no QKV bias, their own random weights),
  when megatron-core is importable.

Step time: the median of 15 steps, each timed alone with CUDA events (min and max in the JSON).
Peak memory is reported above what stays resident between steps (weights and their gradients,
allocated by the warm-up steps). Also records, per row, whether a sequence's log-probs alone equal the same
sequence inside the batch. Writes ``DIR/trainer_hf.json`` (+ ``trainer_hf.png``; ``--replot
JSON`` redraws a saved JSON's figure on any machine). ``--profile``
also writes ``DIR/trainer_hf_profile.txt``: per row, the GPU kernels of two steps (torch.profiler,
sorted by CUDA time) and the GPU-busy time against the wall time (what host time costs).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from bench_trainer import MODEL, add_shape_arguments  # noqa: E402

ROWS = (
    "hf_sdpa",
    "rl_engine_hf",
    "rl_engine_hf_unfused",
    "rl_engine_hf_g8",
    "hf_liger",
    "rl_engine_megatron",
    "megatron_local",
)


def build_hf(layers: int):
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=MODEL["vocab"],
        hidden_size=MODEL["hidden"],
        intermediate_size=MODEL["ffn"],
        num_hidden_layers=layers,
        num_attention_heads=MODEL["heads"],
        num_key_value_heads=MODEL["kv_heads"],
        max_position_embeddings=MODEL["seq"],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": MODEL["theta"]},
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return model


def hf_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def liger_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Summed log-probs through Liger's fused linear CE: per-token ``-CE`` (reduction none)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    hidden = model.model(ids, use_cache=False).last_hidden_state[:, :-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    ce = liger_fused_linear_cross_entropy(
        h, model.lm_head.weight, ids[:, 1:].reshape(-1), reduction="none"
    )
    return (-ce).view(ids.shape[0], -1)


def rl_hf_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    from rl_engine.adapters.hf import token_logprobs

    return token_logprobs(model, ids, 1.0)


def _profile(name: str, step, path: Path) -> dict:
    """Two profiled steps: kernel table (appended to ``path``) and GPU-busy vs wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 2
    events = prof.key_averages()
    # kernels only: a launching op's row repeats its kernels' time as its own "self" device time
    cuda = torch.autograd.DeviceType.CUDA
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == cuda) / 2
    table = events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90)
    with open(path, "a") as f:
        f.write(
            f"==== {name}: wall {wall * 1e3:.1f} ms / step, GPU kernels {gpu_us / 1e3:.1f} ms / step ====\n"
        )
        f.write(table + "\n\n")
    return {"profile_wall_ms": wall * 1e3, "profile_gpu_kernels_ms": gpu_us / 1e3}


def _step_times(step, n: int) -> list[float]:
    """Milliseconds of ``n`` steps, each timed alone with CUDA events (a step is ~150 ms:
    ``do_bench``'s 100-ms budget would time a single one, and one step's host hiccup then
    decides the row)."""
    return [common.one_call_ms(step) for _ in range(n)]


def _row(
    name: str, model, fn, ids: torch.Tensor, quick: bool, profile_to: Path | None = None
) -> dict:
    model.train()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def step():
        model.zero_grad(set_to_none=False)
        lp = fn(model, ids)
        lp.sum().neg().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = _step_times(step, 5 if quick else 15)
    t_us = statistics.median(times) * 1e3
    peak = torch.cuda.max_memory_allocated()
    with torch.no_grad():
        short = ids[:1, :512]
        both = torch.cat([short, ids[1:2, :512].flip(1)])
        alone = fn(model, short)
        inside = fn(model, both)[:1]
    row = {
        "step_ms": t_us / 1e3,
        "step_ms_min": min(times),
        "step_ms_max": max(times),
        "timed_steps": len(times),
        "tokens_per_s": ids.numel() / (t_us * 1e-6),
        "weights_gib": weights / 2**30,
        "peak_above_resident_gib": (peak - base) / 2**30,
        "alone_vs_batched_bitwise": bool(torch.equal(alone, inside)),
        "alone_vs_batched_max_abs_diff": float((alone - inside).abs().max()),
    }
    if profile_to is not None:
        row.update(_profile(name, step, profile_to))
    print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return row


def main() -> None:
    args = common.parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            add_shape_arguments(p, batch=2),
            p.add_argument("--no-megatron", action="store_true"),
            p.add_argument("--rows", default=None, help="comma separated rows (default: all)"),
            p.add_argument("--profile", action="store_true", help="also profile each row"),
        ),
    )
    if not torch.cuda.is_available():
        raise SystemExit("bench_trainer_hf.py needs a CUDA device")
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, MODEL["vocab"], (args.batch, args.seq), generator=g).cuda()
    results: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    state = None

    def fresh_hf():
        nonlocal state
        model = build_hf(args.layers)
        if state is None:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(state)
        return model

    rows = set(args.rows.split(",")) if args.rows else set(ROWS)
    unknown = rows - set(ROWS)
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; expected some of {list(ROWS)}")
    prof = args.out / "trainer_hf_profile.txt" if args.profile else None
    if prof is not None:
        prof.write_text("")

    def measure(name, model, fn):
        results[name] = _row(name, model, fn, ids, args.quick, prof)

    # stock HF first (no patching in the process yet)
    if "hf_sdpa" in rows:
        model = fresh_hf()
        measure("hf_sdpa", model, hf_logprobs)
        del model
        torch.cuda.empty_cache()
    # rl_engine's HF path (per-instance patches: the next model is unaffected)
    if "rl_engine_hf" in rows:
        from rl_engine.adapters.hf import patch_model

        model = fresh_hf()
        patch_model(model)
        measure("rl_engine_hf", model, rl_hf_logprobs)
        del model
        torch.cuda.empty_cache()
    if "rl_engine_hf_unfused" in rows:  # each q/k/v, gate/up Linear its own GEMM
        from rl_engine.adapters.hf import patch_model

        model = fresh_hf()
        patch_model(model, fuse_projections=False)
        measure("rl_engine_hf_unfused", model, rl_hf_logprobs)
        del model
        torch.cuda.empty_cache()
    if "rl_engine_hf_g8" in rows:  # the grouped numerics of TP > 1, here at TP 1
        from rl_engine import config
        from rl_engine.adapters.hf import patch_model

        with config.override_env({"RL_ENGINE_TP_GROUPS": "8"}):
            model = fresh_hf()
            patch_model(model)
            measure("rl_engine_hf_g8", model, rl_hf_logprobs)
            del model
            torch.cuda.empty_cache()
    # Liger last: its patches replace transformers' classes / functions process-wide
    if "hf_liger" in rows:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2

            model = fresh_hf()
            apply_liger_kernel_to_qwen2(
                rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=False, model=model
            )
            measure("hf_liger", model, liger_logprobs)
            del model
            torch.cuda.empty_cache()
        except ImportError as exc:
            unavailable["hf_liger"] = f"{type(exc).__name__}: {exc}"
            print("hf_liger: not measured:", unavailable["hf_liger"])
    megatron_rows = rows & {"rl_engine_megatron", "megatron_local"}
    if megatron_rows and not args.no_megatron and args.batch * args.seq <= 16384:
        try:
            import bench_trainer as bt

            bt._setup_megatron()
            for kind, fn, name in (
                ("rl", bt.rl_logprobs, "rl_engine_megatron"),
                ("stock", bt.stock_logprobs, "megatron_local"),
            ):
                if name not in megatron_rows:
                    continue
                model = None
                try:  # the local spec materialises the scores: may not fit at 8k tokens
                    model = bt.build(kind, args.layers)
                    measure(name, model, fn)
                except torch.cuda.OutOfMemoryError as exc:
                    unavailable[name] = f"out of memory: {str(exc).splitlines()[0]}"
                    print(name, "not measured:", unavailable[name])
                del model
                torch.cuda.empty_cache()
        except ImportError as exc:
            unavailable["megatron"] = f"{type(exc).__name__}: {exc}"
            print("megatron rows: not measured:", unavailable["megatron"])
    baselines = {k: v for k, v in results.items() if k in ("hf_sdpa", "hf_liger")}
    if not baselines:
        raise SystemExit("no baseline row measured (--rows needs hf_sdpa or hf_liger)")
    fastest = min(baselines, key=lambda k: baselines[k]["step_ms"])
    payload = {
        "model": {**MODEL, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "temperature": 1.0,
        "fastest_baseline": fastest,
        "results": results,
        "unavailable": unavailable,
        "ratio_vs_fastest_baseline": {
            k: v["step_ms"] / baselines[fastest]["step_ms"] for k, v in results.items()
        },
        "peak_ratio_vs_fastest_baseline": {
            k: v["peak_above_resident_gib"] / baselines[fastest]["peak_above_resident_gib"]
            for k, v in results.items()
        },
        "target": "rl_engine <= 1.10x the fastest baseline's step time at <= its peak memory",
    }
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        payload["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001 - version is informational
        pass
    written = common.write_json(args.out, "trainer_hf", payload)
    common.print_table(
        [
            {
                "path": k,
                "ms/step": round(v["step_ms"], 1),
                "x fastest": round(payload["ratio_vs_fastest_baseline"][k], 3),
                "peak GiB": round(v["peak_above_resident_gib"], 2),
                "bitwise alone/batch": v["alone_vs_batched_bitwise"],
            }
            for k, v in results.items()
        ],
        ["path", "ms/step", "x fastest", "peak GiB", "bitwise alone/batch"],
    )
    plot(args.out / "trainer_hf.png", json.loads(written.read_text()))  # with the device


def plot(path: Path, payload: dict) -> None:
    """Step time (median, bars from the fastest to the slowest timed step) and peak memory per
    row, with the target's lines: 1.10x the fastest baseline's time, its peak."""
    results = payload["results"]
    names = list(results)
    fastest = results[payload["fastest_baseline"]]
    colors = ["tab:green" if n.startswith("rl_engine") else "tab:gray" for n in names]

    def draw(axes):
        ms = [results[n]["step_ms"] for n in names]
        lo = [ms[i] - results[n].get("step_ms_min", ms[i]) for i, n in enumerate(names)]
        hi = [results[n].get("step_ms_max", ms[i]) - ms[i] for i, n in enumerate(names)]
        bars = axes[0].barh(names, ms, xerr=[lo, hi], color=colors, capsize=3)
        axes[0].bar_label(bars, labels=[f"{v:.1f}" for v in ms], label_type="center")
        axes[0].axvline(1.10 * fastest["step_ms"], color="k", ls="--", label="1.10x fastest")
        axes[0].set_xlabel("ms / step (median; min-max)")
        axes[0].legend(loc="lower right")
        axes[0].invert_yaxis()
        peaks = [results[n]["peak_above_resident_gib"] for n in names]
        bars = axes[1].barh(names, peaks, color=colors)
        axes[1].bar_label(bars, labels=[f"{v:.3f}" for v in peaks], padding=3)
        axes[1].axvline(fastest["peak_above_resident_gib"], color="k", ls="--",
                        label="fastest baseline's peak")  # fmt: skip
        axes[1].set_xlim(0, max(peaks) * 1.2)
        axes[1].set_xlabel("peak GiB above resident")
        axes[1].legend(loc="lower right")
        axes[1].invert_yaxis()
        m = payload["model"]
        axes[0].set_title(
            f"{payload.get('device', '')}: {m['layers']} layers, H {m['hidden']}, "
            f"{m['batch']} x {m['seq']} tokens"
        )

    common.save_figure(path, draw, ncols=2, figsize=(13, 4.5), dpi=120)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":  # redraw from a saved JSON (no GPU)
        import json

        src = Path(sys.argv[2])
        plot(src.with_suffix(".png"), json.loads(src.read_text()))
    else:
        main()
