"""Rollout throughput: vLLM with the rl_engine plugin vs stock vLLM vs ``VLLM_BATCH_INVARIANT=1``.

    python3 benchmarks/bench_rollout.py [--quick] [--out DIR] [--configs stock,rl_engine]
        [--sizes 64,256] [--new-tokens N] [--repeats N] [--rounds N] [--profile DIR]
        [--model qwen2_1b|llama8b_width|qwen3_moe] [--tp N]

``--model`` (default ``qwen2_1b``, below): ``llama8b_width``: Llama-3-8B widths (hidden 4096, FFN
14336, 32 / 8 heads, vocab 128256), 16 layers; ``qwen3_moe``: Qwen3-30B-A3B widths (hidden 2048,
32 / 4 heads, 128 experts, top-8, expert FFN 768, vocab 151936), 8 layers. ``--tp N``: tensor
parallel over N GPUs (an MoE model also with vLLM's expert parallelism: the plugin's MoE
configuration at TP > 1). Results go to ``rollout.json`` for the default model at TP 1, else
``rollout_<model>_tp<N>.json``.

A ~1B Qwen2-shaped bf16 model (16 layers, hidden 2048, 16/8 heads, FFN 5632, vocab 151936, tied,
random weights written locally), 64 and 256 concurrent prompts of 128 tokens x 512 new tokens
(``--quick``: 64 prompts x 256 tokens), T = 0.7, ``logprobs=0`` (the RL rollout asks for the
sampled token's log-prob), ``logprobs_mode="processed_logprobs"``, CUDA graphs and torch.compile
on for every configuration, vLLM's engine core in its own process (its default). Each configuration runs in its own subprocess (the plugin's patches
are process-global): engine start-up time (load + compile + graph capture), one warm-up
generate, then the timed generates (``--repeats``, default 3: the median is reported, every
time kept in ``all_seconds``). ``--rounds N`` starts every configuration's engine N times,
alternating the order (A B, B A, ...): on the lent machines the same engine varied by up to
+-15% between processes, so one process per configuration can misstate a ratio; a row then
reports the median over every timed generate of every round, and each round's tokens/s in
``round_tokens_per_s``.
``--step-times``: the engine's model-runner calls timed inside its process, per timed generate
(``steps``: call count, the five slowest calls, decode median / p99, the time spent outside
the worker, the Triton kernels compiled or loaded meanwhile, GPU clocks before and after), to
tell a stall (a few slow calls) from a slower device or host (every call slower). Writes
``<out>/rollout.json`` (tokens/s, ratios vs stock, start-up seconds, versions), beside it a
PNG of every timed generate per round (``--plot FILE.json ...`` redraws it from a saved result),
and prints a table. ``--profile DIR``: each configuration also runs
64 prompts x 64 tokens under ``torch.profiler`` and writes its top kernels / host ops there.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_engine.testing.tiny_models import family_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent

from shapes import LLAMA3_8B_WIDTH, QWEN2_1B, QWEN3_30B_A3B_MOE  # noqa: E402

CONFIGS = {
    "stock": {"RL_ENGINE_VLLM": "0"},
    "rl_engine": {"RL_ENGINE_VLLM": "1"},
    "vllm_batch_invariant": {"RL_ENGINE_VLLM": "0", "VLLM_BATCH_INVARIANT": "1"},
    # the plugin with the split-KV attention family (opt-in until measured; not in the default
    # list: --configs stock,rl_engine,rl_engine_split)
    "rl_engine_split": {"RL_ENGINE_VLLM": "1", "RL_ENGINE_BACKEND_ATTENTION": "triton_split"},
    # TP > 1: the one-shot symmetric-memory exchange for small messages (opt-in until measured)
    "rl_engine_oneshot": {"RL_ENGINE_VLLM": "1", "RL_ENGINE_TP_ONESHOT": "1"},
    # TP 1 with the TP-invariant grouped reduction (the numerics of TP > 1): what making it the
    # default would cost at TP 1 (issue 44, item 3: the switch needs <= 2% vs rl_engine)
    "rl_engine_g8": {"RL_ENGINE_VLLM": "1", "RL_ENGINE_TP_GROUPS": "8"},
}
MODELS = {
    "qwen2_1b": family_config("qwen2", **QWEN2_1B, max_positions=4096),
    "llama8b_width": family_config("llama", **LLAMA3_8B_WIDTH, max_positions=4096),
    "qwen3_moe": {
        "arch": "qwen3_moe",
        "tie_word_embeddings": False,
        "num_hidden_layers": 8,
        "hidden_size": QWEN3_30B_A3B_MOE["hidden"],
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": QWEN3_30B_A3B_MOE["ffn"],
        "num_experts": QWEN3_30B_A3B_MOE["experts"],
        "num_experts_per_tok": QWEN3_30B_A3B_MOE["top_k"],
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
    },  # fmt: skip
}
MODEL = MODELS[os.environ.get("ROLLOUT_MODEL", "qwen2_1b")]
PROMPT_LEN = 128


# what users run instead: stock vLLM (the ratio's denominator) and vLLM's own batch-invariant mode
BASELINE = (
    "stock vLLM 0.24 with CUDA graphs + torch.compile (vs_stock = tokens/s over its "
    "tokens/s); the vllm_batch_invariant row: the same engine with VLLM_BATCH_INVARIANT=1"
)


def _install_step_timer(worker) -> bool:
    """Inside the vLLM worker (``collective_rpc``): time every ``execute_model`` and
    ``sample_tokens`` call (host wall clock, the step's scheduled token count)."""
    if getattr(worker, "_bench_steps", None) is not None:
        return True
    worker._bench_steps = []

    def wrap(name: str) -> None:
        orig = getattr(worker, name, None)
        if orig is None:
            return

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = orig(*args, **kwargs)
            so = args[0] if args else None
            tokens = int(getattr(so, "total_num_scheduled_tokens", -1) or -1)
            worker._bench_steps.append((name, t, time.perf_counter() - t, tokens))
            return out

        setattr(worker, name, timed)

    wrap("execute_model")
    wrap("sample_tokens")
    # Triton kernels compiled or loaded in this process (a new specialization of a kernel):
    # inside a timed generate that is a stall of its own
    worker._bench_compiles = []
    try:
        from triton import knobs

        prev = knobs.runtime.jit_post_compile_hook

        def on_compile(*args, **kwargs):
            fn = kwargs.get("fn")  # Triton's JitFunctionInfo (.name)
            name = getattr(fn, "name", None) or getattr(fn, "__name__", "?")
            worker._bench_compiles.append((time.perf_counter(), name))
            return prev(*args, **kwargs) if prev is not None else None

        knobs.runtime.jit_post_compile_hook = on_compile
    except (ImportError, AttributeError):  # a Triton without the hook: no count
        worker._bench_compiles = None
    return True


def _take_step_times(worker) -> dict:
    """Inside the vLLM worker: the calls timed and the kernels compiled since the last take
    (and forget them)."""
    steps, worker._bench_steps = list(worker._bench_steps or []), []
    compiles = worker._bench_compiles
    if compiles is not None:
        compiles, worker._bench_compiles = list(compiles), []
    return {"steps": steps, "compiles": compiles}


def _step_summary(taken: dict, wall: float) -> dict:
    """Where one generate's wall time went, from the worker's timed calls: a stall shows as a
    few slow calls (a compile, a collection) or as every call slower (the device, the host)."""
    steps, compiles = taken["steps"], taken["compiles"]
    ex = [s for s in steps if s[0] == "execute_model"]
    sa = [s for s in steps if s[0] == "sample_tokens"]
    decode = sorted(s[2] for s in ex if 0 < s[3] <= 512)
    slow = sorted(steps, key=lambda s: -s[2])[:5]
    busy = sum(s[2] for s in steps)
    return {
        "execute_calls": len(ex),
        "execute_s": round(sum(s[2] for s in ex), 3),
        "sample_s": round(sum(s[2] for s in sa), 3),
        "outside_worker_s": round(wall - busy, 3),  # scheduler, IPC, output processing
        "decode_median_ms": round(1e3 * statistics.median(decode), 3) if decode else None,
        "decode_p99_ms": round(1e3 * decode[int(0.99 * (len(decode) - 1))], 3) if decode else None,
        # Triton kernels compiled / loaded during the generate (None: not countable)
        "kernels_compiled": None if compiles is None else len(compiles),
        "compiled_names": None if compiles is None else sorted({c[1] for c in compiles}),
        "slowest": [
            {
                "call": s[0],
                "ms": round(1e3 * s[2], 2),
                "tokens": s[3],
                "at_s": round(s[1] - steps[0][1], 3),
            }
            for s in slow
        ],
    }


def _worker(model: str, sizes: list[int], new_tokens: int, result: str) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    tp = int(os.environ.get("ROLLOUT_TP", "1"))
    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        # MoE at TP > 1: experts sharded by expert parallelism (the plugin's MoE configuration)
        enable_expert_parallel=tp > 1 and MODEL["arch"] in ("qwen3_moe", "mixtral", "qwen2_moe"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=PROMPT_LEN + new_tokens + 16,
        max_num_seqs=max(sizes),
        enable_prefix_caching=False,  # distinct prompts; keep the comparison about compute
        gpu_memory_utilization=0.8,
        seed=0,
        logprobs_mode="processed_logprobs",
    )
    start_s = time.perf_counter() - t0
    plugin = os.environ.get("RL_ENGINE_VLLM") == "1"
    if plugin:
        from rl_engine.adapters import vllm as adapter

        adapter.require_routing(llm)
    step_times = os.environ.get("ROLLOUT_STEP_TIMES") == "1"
    if step_times:
        llm.collective_rpc(_install_step_timer)
    rng = random.Random(0)
    vocab = MODEL["vocab_size"]

    def clocks() -> dict:
        """The GPU's SM clock (MHz), power (W) and temperature (C) now (NVML; {} without it)."""
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return {
                "sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "power_w": round(pynvml.nvmlDeviceGetPowerUsage(h) / 1e3),
                "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            }
        except Exception:
            return {}

    def run(n: int, tokens: int) -> float:
        prompts = [
            {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(PROMPT_LEN)]}
            for _ in range(n)
        ]
        params = SamplingParams(
            max_tokens=tokens, temperature=0.7, logprobs=0, ignore_eos=True, detokenize=False
        )
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return dt

    run(8, 32)  # warm-up
    rows = []
    for n in sizes:
        run(n, 16)  # this batch shape once untimed: one-time JIT specialisations (both stacks)
        # repeated: a host-bound decode moves with the host's load; the median is reported
        times, diag = [], []
        for _ in range(int(os.environ.get("ROLLOUT_REPEATS", "1"))):
            if step_times:
                llm.collective_rpc(_take_step_times)
                c0 = clocks()
            times.append(run(n, new_tokens))
            if step_times:
                taken = llm.collective_rpc(_take_step_times)[0]
                diag.append({**_step_summary(taken, times[-1]), "clocks_before": c0,
                             "clocks_after": clocks()})  # fmt: skip
        dt = statistics.median(times)
        rows.append(
            {
                "prompts": n,
                "prompt_len": PROMPT_LEN,
                "new_tokens": new_tokens,
                "seconds": round(dt, 3),
                "tokens_per_s": round(n * new_tokens / dt, 1),
                "all_seconds": [round(t, 3) for t in times],
                **({"steps": diag} if step_times else {}),
            }
        )
    res = {"engine_start_s": round(start_s, 1), "rows": rows}
    prof_dir = os.environ.get("ROLLOUT_PROFILE")
    if prof_dir:  # where the step time goes: kernels (incl. graph replays) and host ops
        res["profile"] = _profile(lambda: run(64, 64), Path(prof_dir) / f"{Path(result).stem}")
    import vllm

    res["vllm_version"] = vllm.__version__
    res["engine_core_in_own_process"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
    if plugin:
        from rl_engine.adapters import vllm as adapter

        prov = adapter.provenance(llm)[0]
        res["logp_executed_calls"] = prov["executed"]["logp_calls"]
        res["families"] = {r["op"]: r["numerics"] for r in prov["registry"]}
    Path(result).write_text(json.dumps(res))


def _profile(fn, stem: Path) -> dict:
    """Profile one ``fn()`` (CPU + CUDA); writes ``<stem>.prof.txt`` with the top kernels by
    device time and the top host ops by self time; returns wall / kernel-time totals (ms)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    ka = prof.key_averages()
    dev = sum(e.self_device_time_total for e in ka) / 1e3
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{stem}.prof.txt", "w") as f:
        f.write(f"wall {wall:.1f} ms, device self time {dev:.1f} ms\n\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
        f.write("\n\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
    print(f"profile: wall {wall:.1f} ms, device self time {dev:.1f} ms -> {stem}.prof.txt")
    return {"wall_ms": round(wall, 1), "device_ms": round(dev, 1)}


def _merge_rounds(runs: list[dict]) -> dict:
    """One configuration's engine processes as one result: per size the median over every
    timed generate of every process, each process's tokens/s kept."""
    if len(runs) == 1:
        return runs[0]
    merged = {**runs[-1], "engine_start_s": statistics.median(r["engine_start_s"] for r in runs)}
    merged["rounds"] = runs
    rows = []
    for i, row in enumerate(runs[0]["rows"]):
        times = [t for r in runs for t in r["rows"][i]["all_seconds"]]
        dt = statistics.median(times)
        n, tokens = row["prompts"], row["new_tokens"]
        rows.append(
            {
                **row,
                "seconds": round(dt, 3),
                "tokens_per_s": round(n * tokens / dt, 1),
                "all_seconds": times,
                "round_tokens_per_s": [r["rows"][i]["tokens_per_s"] for r in runs],
                **(
                    {"steps": [st for r in runs for st in r["rows"][i]["steps"]]}
                    if "steps" in row
                    else {}
                ),
            }
        )
    merged["rows"] = rows
    return merged


def _rows(results: dict[str, dict]) -> list[dict]:
    """One row per configuration and size, with its ratio to stock vLLM's tokens/s."""
    stock = {r["prompts"]: r["tokens_per_s"] for r in results.get("stock", {}).get("rows", [])}
    rows = []
    for name, res in results.items():
        for r in res.get("rows", []):
            base = stock.get(r["prompts"])
            rows.append(
                {
                    "config": name,
                    **r,
                    "vs_stock": round(r["tokens_per_s"] / base, 3) if base else None,
                    "engine_start_s": res["engine_start_s"],
                }
            )
    return rows


def plot(path: Path, payload: dict) -> None:
    """``path``: every timed generate's tokens/s per configuration (one panel per batch size),
    round by round (x: round, the repeats side by side), with each configuration's median (the
    reported figure) as a line: the spread a median hides."""
    import common

    runs = {n: r for n, r in payload.get("runs", {}).items() if "rows" in r}
    if not runs:
        return
    sizes = [r["prompts"] for r in next(iter(runs.values()))["rows"]]

    def draw(axes):
        for ax, (i, n) in zip(axes if len(sizes) > 1 else [axes], enumerate(sizes)):
            for c, (name, res) in enumerate(runs.items()):
                row = res["rows"][i]
                tokens = row["prompts"] * row["new_tokens"]
                for k, rnd in enumerate(res.get("rounds", [res])):
                    secs = rnd["rows"][i]["all_seconds"]
                    xs = [
                        k + 1 + (c - (len(runs) - 1) / 2) * 0.18 + j * 0.05
                        for j in range(len(secs))
                    ]
                    ax.plot(xs, [tokens / t for t in secs], "o", color=f"C{c}",
                            label=name if k == 0 else None)  # fmt: skip
                ax.axhline(row["tokens_per_s"], color=f"C{c}", lw=1, ls="--")
            ax.set_xlabel("engine round (each point a timed generate; dashed: median)")
            ax.set_ylabel("tokens / s")
            ax.set_title(f"{payload.get('model_name')} TP {payload.get('tp')}: {n} prompts "
                         f"({payload.get('gpu', '')})")  # fmt: skip
            ax.set_xticks(range(1, max(len(r.get("rounds", [r])) for r in runs.values()) + 1))
            ax.set_ylim(bottom=0)
            ax.legend(loc="lower right")

    common.save_figure(path, draw, ncols=len(sizes), figsize=(6 * len(sizes), 4.5))


def main() -> int:
    if "--plot" in sys.argv:  # redraw the figure of a saved result: --plot FILE.json ...
        for f in sys.argv[sys.argv.index("--plot") + 1 :]:
            plot(Path(f).with_suffix(".png"), json.loads(Path(f).read_text()))
        return 0
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        model, sizes, tokens, result = sys.argv[i + 1 : i + 5]
        _worker(model, [int(s) for s in sizes.split(",")], int(tokens), result)
        return 0
    import common

    def extra(p):
        p.add_argument(
            "--configs",
            default="stock,rl_engine,vllm_batch_invariant",
            help=f"comma-separated subset of {', '.join(CONFIGS)}",
        )
        p.add_argument("--sizes", default=None, help="concurrent prompts, comma-separated")
        p.add_argument("--new-tokens", type=int, default=None)
        p.add_argument("--profile", type=Path, default=None, help="write torch.profiler tables")
        p.add_argument(
            "--step-times",
            action="store_true",
            help="time every model-runner call in the engine (per timed generate: calls, "
            "slowest calls, decode median / p99, time outside the worker, GPU clocks)",
        )
        p.add_argument(
            "--rounds",
            type=int,
            default=1,
            help="engine processes per configuration, in alternating order (default 1)",
        )
        p.add_argument("--model", default="qwen2_1b", choices=sorted(MODELS))
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
        p.add_argument(
            "--repeats",
            type=int,
            default=None,
            help="timed generates per configuration and size, median reported (default 3, "
            "--quick 1)",
        )

    args = common.parse_args(__doc__.split("\n")[0], extra)
    sizes = [64] if args.quick else [64, 256]
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    new_tokens = args.new_tokens or (256 if args.quick else 512)
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {sorted(CONFIGS)}")
    from rl_engine.testing.tiny_models import make_tiny_model

    global MODEL
    MODEL = MODELS[args.model]
    name_json = (
        "rollout"
        if (args.model, args.tp) == ("qwen2_1b", 1)
        else (f"rollout_{args.model}_tp{args.tp}")
    )
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    model = make_tiny_model(
        work / args.model, dtype="bfloat16", seed=0, initializer_range=0.02, **MODEL
    )
    results: dict[str, dict] = {}
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    order = [
        (k, name) for k in range(args.rounds) for name in (configs if k % 2 == 0 else configs[::-1])
    ]
    for k, name in order:
        env = dict(os.environ)
        env.update(CONFIGS[name])
        # vLLM's default: the engine core in its own process (scheduling and the model runner
        # there, request handling here), as users run it. A profile needs it in this process.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if args.profile is not None:
            env["ROLLOUT_PROFILE"] = str(args.profile)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        env["ROLLOUT_REPEATS"] = str(args.repeats or (1 if args.quick else 3))
        env["ROLLOUT_MODEL"] = args.model
        env["ROLLOUT_TP"] = str(args.tp)
        if args.step_times:
            env["ROLLOUT_STEP_TIMES"] = "1"
            # the timer is a function sent to the engine-core process (a bench-only switch)
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        out = work / f"{name}.r{k}.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            model,
            ",".join(map(str, sizes)),
            str(new_tokens),
            str(out),
        ]
        t = time.perf_counter()
        log = work / f"{name}.r{k}.log"
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        print(f"{name} (round {k + 1}/{args.rounds}): exit {rc} in "
              f"{time.perf_counter() - t:.0f}s (log {log})")  # fmt: skip
        if rc == 0 and out.exists():
            rounds[name].append(json.loads(out.read_text()))
            results[name] = _merge_rounds(rounds[name])
        else:
            results[name] = {"error": f"exit {rc}", "log_tail": log.read_text()[-3000:]}
        # written after every engine: a run cut short (a device call's time limit) keeps what
        # finished, marked incomplete
        rows = _rows(results)
        done = all(len(rounds[n]) == args.rounds for n in configs)
        payload = {"model_name": args.model, "model": MODEL, "tp": args.tp, "quick": args.quick,
                   "complete": done, "configs": configs, "rounds": args.rounds,
                   "baseline": BASELINE}  # fmt: skip
        path = common.write_json(args.out, name_json, {**payload, "rows": rows, "runs": results})
        plot(path.with_suffix(".png"), json.loads(path.read_text()))
    common.print_table(
        rows,
        ["config", "prompts", "new_tokens", "tokens_per_s", "vs_stock", "engine_start_s"],
    )
    return 0 if all("rows" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
