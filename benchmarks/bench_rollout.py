"""Rollout throughput: vLLM with the rl_engine plugin vs stock vLLM vs ``VLLM_BATCH_INVARIANT=1``.

    python3 benchmarks/bench_rollout.py [--quick] [--out DIR]

A ~1B Qwen2-shaped bf16 model (16 layers, hidden 2048, 16/8 heads, FFN 5632, vocab 151936, tied,
random weights written locally), 64 and 256 concurrent prompts of 128 tokens x 512 new tokens
(``--quick``: 64 prompts x 256 tokens), T = 0.7, ``logprobs=0`` (the RL rollout asks for the
sampled token's log-prob), ``logprobs_mode="processed_logprobs"``, CUDA graphs and torch.compile
on for every configuration. Each configuration runs in its own subprocess (the plugin's patches
are process-global): engine start-up time (load + compile + graph capture), one warm-up
generate, then the timed generates. Writes ``<out>/rollout.json`` (tokens/s, ratios vs stock,
start-up seconds, versions) and prints a table.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "stock": {"RL_ENGINE_VLLM": "0"},
    "rl_engine": {"RL_ENGINE_VLLM": "1"},
    "vllm_batch_invariant": {"RL_ENGINE_VLLM": "0", "VLLM_BATCH_INVARIANT": "1"},
}
MODEL = dict(
    arch="qwen2",
    tie_word_embeddings=True,
    num_hidden_layers=16,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=5632,
    vocab_size=151936,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
)
PROMPT_LEN = 128


def _worker(model: str, sizes: list[int], new_tokens: int, result: str) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
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
    rng = random.Random(0)
    vocab = MODEL["vocab_size"]

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
        dt = run(n, new_tokens)
        rows.append(
            {
                "prompts": n,
                "prompt_len": PROMPT_LEN,
                "new_tokens": new_tokens,
                "seconds": round(dt, 3),
                "tokens_per_s": round(n * new_tokens / dt, 1),
            }
        )
    res = {"engine_start_s": round(start_s, 1), "rows": rows}
    import vllm

    res["vllm_version"] = vllm.__version__
    if plugin:
        from rl_engine.adapters import vllm as adapter

        prov = adapter.provenance(llm)[0]
        res["logp_executed_calls"] = prov["executed"]["logp_calls"]
        res["families"] = {r["op"]: r["numerics"] for r in prov["registry"]}
    Path(result).write_text(json.dumps(res))


def main() -> int:
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        model, sizes, tokens, result = sys.argv[i + 1 : i + 5]
        _worker(model, [int(s) for s in sizes.split(",")], int(tokens), result)
        return 0
    import common

    args = common.parse_args(__doc__.split("\n")[0])
    sizes = [64] if args.quick else [64, 256]
    new_tokens = 256 if args.quick else 512
    from rl_engine.testing.tiny_models import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    model = make_tiny_model(
        work / "qwen2_1b", dtype="bfloat16", seed=0, initializer_range=0.02, **MODEL
    )
    results = {}
    for name, env_extra in CONFIGS.items():
        env = dict(os.environ)
        env.update(env_extra)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        out = work / f"{name}.json"
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
        log = work / f"{name}.log"
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        print(f"{name}: exit {rc} in {time.perf_counter() - t:.0f}s (log {log})")
        if rc == 0 and out.exists():
            results[name] = json.loads(out.read_text())
        else:
            results[name] = {"error": f"exit {rc}", "log_tail": log.read_text()[-3000:]}
    rows = []
    stock = {r["prompts"]: r["tokens_per_s"] for r in results.get("stock", {}).get("rows", [])}
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
    payload = {"model": MODEL, "quick": args.quick, "rows": rows, "runs": results}
    common.write_json(args.out, "rollout", payload)
    common.print_table(
        rows,
        ["config", "prompts", "new_tokens", "tokens_per_s", "vs_stock", "engine_start_s"],
    )
    return 0 if all("rows" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
