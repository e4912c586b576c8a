"""GPU end-to-end check of the rl_engine vLLM plugin on real CUDA vLLM (0.24.0), issue 15 item 5.

    python3 scripts/gpu_vllm_e2e.py [--quick | --archs llama] [--det-gemm cuda] [--out DIR]
    (DIR: $OUT or ./out)

Models (bf16, random, written locally): a Qwen2-shaped one (QKV bias, tied embeddings, 4 layers,
hidden 1536, 12/2 heads, FFN 8960, vocab 151936) and, unless ``--quick``, a Llama-shaped one
(untied, 4 layers, hidden 2048, 16/8 heads, FFN 5632, vocab 128256; vLLM 0.24 runs Llama on its
V2 model runner, Qwen2 on V1, so both samplers are exercised).

Workload: 16 prompts (``--quick``: 16 as well) of 1..300 tokens, a quarter of them sharing a
96-token prefix, T = 0.7, 64 sampled tokens each, per-request seeds, ``logprobs=1``,
``logprobs_mode="processed_logprobs"``. Engine: CUDA graphs and torch.compile on (no
``enforce_eager``), prefix caching on, chunked prefill on with ``max_num_batched_tokens=256`` (so
300-token prompts are chunked, alone and in the batch).

Checks (each a % of sampled-token log-probs bitwise equal):
(a) all prompts at once vs each prompt alone;
(b) rollout vs the rl_engine HF trainer (``rl_engine.adapters.hf.token_logprobs``) and vs the
    Megatron trainer (``rl_engine.adapters.megatron``), teacher-forced on the same tokens;
(c) a second all-at-once run (every prompt now a prefix-cache hit) vs the first; chunking is in
    every run (budget 256);
(d) the same with stock vLLM (plugin off), in its own process (patches are process-global);
(e) provenance: ``require_routing`` passes, no unroutable layer, the sampled log-probs went
    through the routed path (executed counter > 0), and the numerics families of the ops both
    sides run are equal (a rollout's ``logp`` and a trainer's ``linear_logp`` by their log-softmax
    family); with ``--det-gemm cuda`` (every side pins det_gemm to the CUDA C++ provider and
    ``linear_logp`` to ``unfused``), det_gemm ran as ``det_gemm/cuda-sm90`` and nothing else on
    both sides.

Each engine runs in its own subprocess (``--mode rollout``), the trainers in another
(``--mode trainer``); this process only orchestrates, writes ``<out>/gpu_vllm_e2e.json`` and prints
a short table last. Exit status 0 when every plugin-on check is 100% and provenance holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from rl_engine.testing.tiny_models import family_config

ROOT = Path(__file__).resolve().parent.parent
TEMPERATURE = 0.7
N_PROMPTS = 16
MAX_TOKENS = 64
BUDGET = 256  # max_num_batched_tokens: forces chunked prefill of the long prompts
PREFIX_LEN = 96
CUDA_GEMM_FAMILY = "det_gemm/cuda-sm90"  # --det-gemm cuda: the family both sides must run

MODELS = {
    "qwen2": family_config("qwen2", layers=4, hidden=1536, heads=12, kv_heads=2, ffn=8960),
    "llama": family_config("llama", layers=4, hidden=2048, heads=16, kv_heads=8, ffn=5632),
    # Qwen3-30B-A3B widths (hidden 2048, 32 / 4 heads, top-8 experts of FFN 768, vocab 151936),
    # 4 layers and 64 experts (issue 43's GPU acceptance: >= 4 layers, >= 64 experts)
    "qwen3_moe": {
        "arch": "qwen3_moe",
        "tie_word_embeddings": False,
        "num_hidden_layers": 4,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 2048,
    },
    # Mixtral's routing (top-k of the logits, softmax over the k), 4 layers, 8 experts, top-2,
    # Mixtral-8x7B's head layout at hidden 2048, Mistral's 32000 vocabulary
    "mixtral": {
        "arch": "mixtral",
        "tie_word_embeddings": False,
        "num_hidden_layers": 4,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 5632,
        "vocab_size": 32000,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 2048,
    },
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B's routing: 60 experts, top-4, not renormalised, a
    # sigmoid-gated shared expert), 4 layers at hidden 2048
    "qwen2_moe": {
        "arch": "qwen2_moe",
        "tie_word_embeddings": False,
        "num_hidden_layers": 4,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 2048,
    },
}


# ----------------------------------------------------------------------------- helpers
def _workload(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(PREFIX_LEN)]
    lens = [1, 300, 7, 150] + [rng.randrange(1, 301) for _ in range(N_PROMPTS - 4)]
    prompts = []
    for i, n in enumerate(lens):
        if i % 4 == 3:  # shared prefix + own tail (prefix-cache hits)
            prompts.append(
                prefix + [rng.randrange(10, vocab) for _ in range(max(1, n - PREFIX_LEN))]
            )
        else:
            prompts.append([rng.randrange(10, vocab) for _ in range(n)])
    return prompts


def _now(timestamp: float | None = None) -> str:
    """UTC ISO time of ``timestamp`` (seconds since the epoch; default now), to the second."""
    import datetime

    t = datetime.datetime.fromtimestamp(
        time.time() if timestamp is None else timestamp, datetime.timezone.utc
    )
    return t.isoformat(timespec="seconds")


def _pct(equal: int, total: int) -> float:
    return round(100.0 * equal / total, 2) if total else float("nan")


def _compare(a: list[list[float]], b: list[list[float]]) -> dict:
    """Bitwise comparison of per-sequence log-prob lists (compared where both have a value)."""
    import math

    eq = tot = 0
    maxd = 0.0
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            tot += 1
            if u == v:
                eq += 1
            elif not (math.isnan(u) or math.isnan(v)):
                maxd = max(maxd, abs(u - v))
    return {"equal_pct": _pct(eq, tot), "equal": eq, "total": tot, "max_abs_diff": maxd}


def _same_tokens(a: list[list[int]], b: list[list[int]]) -> float:
    return _pct(sum(x == y for x, y in zip(a, b)), len(a))


# ----------------------------------------------------------------------------- rollout mode
def _rollout(args) -> dict:
    """One engine (plugin on or off, decided by RL_ENGINE_VLLM in this process's env)."""
    import torch
    from vllm import LLM, SamplingParams

    plugin = os.environ.get("RL_ENGINE_VLLM") == "1"
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = _workload(vocab)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=32,
        max_num_batched_tokens=args.budget,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.45,
        seed=0,
        logprobs_mode="processed_logprobs",
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
    )
    start_s = time.perf_counter() - t0
    res: dict = {"plugin": plugin, "engine_start_s": round(start_s, 1), "prompts": prompts}
    if plugin:
        from rl_engine.adapters import vllm as adapter

        adapter.require_routing(llm)  # raises when a worker runs unrouted
        res["require_routing"] = "ok"

    def params(i):
        return SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
            logprobs=1,
            seed=1000 + i,
            ignore_eos=True,
            detokenize=False,
        )

    def run(idx):
        outs = llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in idx],
            [params(i) for i in idx],
            use_tqdm=False,
        )
        toks, lps = [], []
        for o in outs:
            c = o.outputs[0]
            toks.append(list(c.token_ids))
            lps.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
        return toks, lps

    idx = list(range(len(prompts)))
    batch_t, batch_lp = run(idx)  # all at once (chunked prefill: budget 256)
    alone = [run([i]) for i in idx]  # each alone (prefix cache now warm for the shared prefix)
    again_t, again_lp = run(idx)  # all at once again: every prompt a prefix-cache hit
    res.update(
        batch_tokens=batch_t,
        batch_logprobs=batch_lp,
        alone_tokens=[a[0][0] for a in alone],
        alone_logprobs=[a[1][0] for a in alone],
        again_tokens=again_t,
        again_logprobs=again_lp,
    )
    if plugin:
        from rl_engine.adapters import vllm as adapter

        prov = adapter.provenance(llm)
        res["provenance"] = prov
    res["vllm_version"] = __import__("vllm").__version__
    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    from rl_engine.run_info import environment

    # code hash, versions, date: what --summarize names
    res["environment"] = environment("cuda" if torch.cuda.is_available() else "cpu")
    return res


# ----------------------------------------------------------------------------- trainer mode
def _trainer(args) -> dict:
    """Teacher-forced sampled-token log-probs of the rollouts, HF and Megatron (rl_engine)."""
    import torch
    import transformers

    from rl_engine import KernelRegistry
    from rl_engine.adapters import hf

    rollouts = {k: json.loads(Path(p).read_text()) for k, p in args.rollouts.items()}
    seqs = []  # (key, i, prompt, tokens)
    for key, r in rollouts.items():
        for i, (p, t) in enumerate(zip(r["prompts"], r["batch_tokens"])):
            seqs.append((key, i, p, t))
    out: dict = {"hf": {}, "megatron": {}, "errors": {}}
    dev = torch.device("cuda")

    def teacher(fn):
        res: dict[str, list[list[float]]] = {
            k: [None] * len(r["prompts"]) for k, r in rollouts.items()
        }
        with torch.no_grad():
            for key, i, p, t in seqs:
                ids = torch.tensor([p + t], device=dev)
                lp = fn(ids)[0, len(p) - 1 :].float().cpu().tolist()
                res[key][i] = lp
        return res

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model = model.to(dev).eval()
    hf.patch_model(model)
    out["hf"] = teacher(lambda ids: hf.token_logprobs(model, ids, TEMPERATURE))
    model.to("cpu")  # free the GPU for the Megatron model
    torch.cuda.empty_cache()
    try:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=0, world_size=1)
        from megatron.core import parallel_state

        import rl_engine.adapters.megatron as mg

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        gpt = mg.from_pretrained(args.model, dtype=torch.bfloat16, device=dev)
        out["megatron"] = teacher(lambda ids: mg.token_logprobs(gpt, ids, TEMPERATURE))
    except Exception as exc:  # reported, never silently dropped
        out["errors"]["megatron"] = f"{type(exc).__name__}: {exc}"
    out["registry"] = KernelRegistry.report()
    return out


# ----------------------------------------------------------------------------- driver
def _sub(mode: str, env_extra: dict, argv: list[str], log: Path, timeout: float) -> int:
    env = dict(os.environ)
    env.update(env_extra)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, *argv]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(
        f"  {mode} {' '.join(argv[-2:])}: exit {rc} in {time.perf_counter() - t0:.0f}s (log {log})"
    )
    return rc


def _families(records: list[dict]) -> dict[str, set[str]]:
    fam: dict[str, set[str]] = {}
    for r in records:
        fam.setdefault(r["op"], set()).add(r["numerics"])
    return fam


def _arch_rows(
    files: dict[str, str], trainer: dict | None, want_gemm: str | None, res: dict
) -> bool:
    """The comparison rows of one model into ``res`` (``res[name]`` for each rollout in
    ``files``: "plugin" / "stock" -> its result JSON) against the trainers' ``trainer`` result;
    returns whether every plugin check holds (100% and provenance)."""
    from rl_engine.drift.metrics import provenance_check

    ok = True
    for name, f in files.items():
        r = json.loads(Path(f).read_text())
        row = {
            "engine_start_s": r["engine_start_s"],
            "tokens_equal_alone_pct": _same_tokens(r["batch_tokens"], r["alone_tokens"]),
            "a_batch_vs_alone": _compare(r["batch_logprobs"], r["alone_logprobs"]),
            "c_prefix_hit_rerun": _compare(r["batch_logprobs"], r["again_logprobs"]),
        }
        if trainer is not None:
            for side in ("hf", "megatron"):
                ref = trainer[side].get(name) if trainer.get(side) else None
                if ref is not None:
                    row[f"b_vs_{side}"] = _compare(r["batch_logprobs"], ref)
            if trainer["errors"]:
                row["trainer_errors"] = trainer["errors"]
        if name == "plugin":
            prov = r.get("provenance") or [{}]
            e: dict = {"require_routing": r.get("require_routing"), "workers": len(prov)}
            e["unroutable"] = [
                u for p in prov for m in p.get("models", []) for u in m["unroutable"]
            ]
            e["routed_layers"] = prov[0].get("models", [{}])[-1].get("routed")
            e["model_runner"] = prov[0].get("models", [{}])[-1].get("model_runner")
            e["logp_executed_calls"] = min(p.get("executed", {}).get("logp_calls", 0) for p in prov)
            rollout_fam = _families([x for p in prov for x in p.get("registry", [])])
            trainer_fam = _families(trainer["registry"]) if trainer else {}
            common = sorted(set(rollout_fam) & set(trainer_fam))
            e["families_rollout"] = {k: sorted(v) for k, v in rollout_fam.items()}
            e["families_trainer"] = {k: sorted(v) for k, v in trainer_fam.items()}
            # the ops both resolved, and the reduction of the TP-sharded GEMMs (plain
            # det_gemm on one side, the grouped det_gemm_tp on the other is a mismatch)
            check = provenance_check(
                [x for p in prov for x in p.get("registry", [])],
                trainer["registry"] if trainer else [],
            )
            e["family_problems"] = check["problems"]
            e["same_families"] = (
                bool(common)
                and all(rollout_fam[k] == trainer_fam[k] for k in common)
                and not check["mismatches"]
            )
            if want_gemm:  # the pinned family ran on both sides, and only it
                e["det_gemm_family"] = {
                    "rollout": sorted(rollout_fam.get("det_gemm", ())),
                    "trainer": sorted(trainer_fam.get("det_gemm", ())),
                }
                e["det_gemm_pinned"] = all(v == [want_gemm] for v in e["det_gemm_family"].values())
            e["ok"] = (
                e["require_routing"] == "ok"
                and not e["unroutable"]
                and e["logp_executed_calls"] > 0
                and e["same_families"]
                and e.get("det_gemm_pinned", True)
            )
            row["e_provenance"] = e
            checks = [row["a_batch_vs_alone"], row["c_prefix_hit_rerun"]]
            checks += [row[k] for k in ("b_vs_hf", "b_vs_megatron") if k in row]
            row["all_100"] = all(c["equal_pct"] == 100.0 for c in checks) and e["ok"]
            ok = ok and row["all_100"] and "b_vs_megatron" in row and "b_vs_hf" in row
        res[name] = row
    return ok


def _make_model(arch: str, path: Path) -> None:
    """The random checkpoint of ``MODELS[arch]`` at ``path`` (kept when already there)."""
    from rl_engine.testing.tiny_models import make_tiny_model

    if not (path / "config.json").exists():
        make_tiny_model(path, dtype="bfloat16", seed=1, initializer_range=0.02, **MODELS[arch])


def _drive(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or "out").resolve()
    work = out / "gpu_vllm_e2e"
    work.mkdir(parents=True, exist_ok=True)
    archs = ["qwen2"] if args.quick else args.archs.split(",")
    unknown = sorted(set(archs) - set(MODELS))
    if unknown:
        raise SystemExit(f"--archs: unknown {unknown}; known: {sorted(MODELS)}")
    deadline = time.perf_counter() + args.budget_s
    # the pin reaches every subprocess (engines, their workers, the trainers) through the env
    want_gemm = CUDA_GEMM_FAMILY if args.det_gemm == "cuda" else None
    if want_gemm:
        os.environ["RL_ENGINE_BACKEND_DET_GEMM"] = "cuda"
        # linear_logp's Triton provider computes Triton det_gemm logits and refuses the cuda
        # pin; its unfused provider takes the resolved det_gemm's logits and the Triton
        # log-softmax the rollout's logp runs on its own (the native one would add the native
        # log-softmax: 83.8% equal to a Triton-logp rollout on an H200, 2026-11-28)
        os.environ["RL_ENGINE_BACKEND_LINEAR_LOGP"] = "unfused"
    import torch
    import triton

    summary: dict = {
        "quick": args.quick,
        "temperature": TEMPERATURE,
        "date": _now(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "archs": {},
        "det_gemm": args.det_gemm,
    }
    ok = True
    from rl_engine.run_info import code_hash

    summary["code_hash"] = code_hash()
    summary["complete"] = False  # until every model is done: a cut-off run keeps what finished

    def write_summary() -> None:
        (out / "gpu_vllm_e2e.json").write_text(json.dumps(summary, indent=1, default=str))

    for arch in archs:
        path = work / f"model_{arch}"
        res: dict = {}
        files = {}
        ran = False  # a rollout ran now: an earlier trainer result scored other tokens
        for name, env in (
            ("plugin", {"RL_ENGINE_VLLM": "1"}),
            ("stock", {"RL_ENGINE_VLLM": "0"}),
        ):
            f = work / f"{arch}_{name}.json"
            if (args.reuse or args.summarize) and f.exists():  # left by an earlier (cut-off) run
                print(f"  rollout {name}: reusing {f}")
                files[name] = str(f)
                continue
            if args.summarize:
                res[f"{name}_error"] = f"--summarize: no {f}"
                ok = False
                continue
            _make_model(arch, path)
            ran = True
            left = max(60.0, deadline - time.perf_counter())
            rc = _sub(
                "rollout",
                env,
                ["--model", str(path), "--result", str(f)],
                work / f"{arch}_{name}.log",
                left,
            )
            if rc == 0 and f.exists():
                files[name] = str(f)
            else:
                res[f"{name}_error"] = f"rollout exit {rc}; see {work / f'{arch}_{name}.log'}"
                ok = False
        tf = work / f"{arch}_trainer.json"
        trainer = None
        if files and (args.reuse or args.summarize) and tf.exists() and not ran:
            print(f"  trainer: reusing {tf}")
            trainer = json.loads(tf.read_text())
        elif files and args.summarize:
            res["trainer_error"] = f"--summarize: no {tf}"
            ok = False
        elif files:
            _make_model(arch, path)
            left = max(60.0, deadline - time.perf_counter())
            rc = _sub(
                "trainer",
                {"RL_ENGINE_VLLM": "0"},
                ["--model", str(path), "--rollouts", json.dumps(files), "--result", str(tf)],
                work / f"{arch}_trainer.log",
                left,
            )
            trainer = json.loads(tf.read_text()) if rc == 0 and tf.exists() else None
            if trainer is None:
                res["trainer_error"] = f"trainer exit {rc}; see {work / f'{arch}_trainer.log'}"
                ok = False
        ok = _arch_rows(files, trainer, want_gemm, res) and ok
        summary["archs"][arch] = res
        if "plugin" in files:
            first = json.loads(Path(files["plugin"]).read_text())
            summary["vllm_version"] = first["vllm_version"]
            if args.summarize:  # the machine and code the rollouts ran on, not this one's
                summary["device"] = first.get("device", "unknown")
                env = first.get("environment") or {}  # older rollout files record none
                ver = env.get("versions") or {}
                prov0 = (first.get("provenance") or [{}])[0]
                summary["code_hash"] = env.get("code_hash") or args.code_hash
                # else the file's time (kept by the copy back)
                summary["date"] = env.get("date") or _now(Path(files["plugin"]).stat().st_mtime)
                summary["torch"] = ver.get("torch") or prov0.get("torch_version")
                summary["triton"] = ver.get("triton")  # None: not recorded by an older run
                summary["summarized"] = f"recomputed with --summarize on {_now()}"
        summary["ok"] = ok
        write_summary()
    summary["complete"] = True
    write_summary()
    # short table, last
    print(
        f"\nrl_engine vLLM plugin, GPU end to end (vLLM {summary.get('vllm_version')}), % bitwise equal"
    )
    cols = ["a_batch_vs_alone", "b_vs_hf", "b_vs_megatron", "c_prefix_hit_rerun"]
    print(
        f"{'arch':6} {'vllm':7} "
        + " ".join(f"{c[:16]:>16}" for c in cols)
        + "  start_s  provenance"
    )
    for arch, res in summary["archs"].items():
        for name in ("plugin", "stock"):
            row = res.get(name)
            if row is None:
                print(
                    f"{arch:6} {name:7} error: {res.get(name + '_error') or res.get('trainer_error')}"
                )
                continue
            vals = " ".join(
                f"{row[c]['equal_pct']:>16}" if c in row else f"{'-':>16}" for c in cols
            )
            prov = row.get("e_provenance", {}).get("ok", "-")
            print(f"{arch:6} {name:7} {vals} {row['engine_start_s']:>8}  {prov}")
    print(f"overall: {'PASS' if ok else 'FAIL'}  ({out / 'gpu_vllm_e2e.json'})")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="Qwen2-shaped model only")
    p.add_argument("--archs", default="qwen2,llama", help="models to check, comma separated")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else ./out)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of all steps")
    p.add_argument("--mode", choices=("drive", "rollout", "trainer"), default="drive")
    p.add_argument("--model", default=None)
    p.add_argument("--result", default=None)
    p.add_argument("--rollouts", type=json.loads, default=None)
    p.add_argument(
        "--det-gemm",
        choices=("default", "cuda"),
        default="default",
        help="cuda: every side (rollout engines, trainers) pins det_gemm to the CUDA C++ "
        "provider (RL_ENGINE_BACKEND_DET_GEMM=cuda, family det_gemm/cuda-sm90; needs the built "
        "library) and linear_logp to its unfused provider (that det_gemm's logits, the Triton "
        "log-softmax), and the check requires that family on both sides",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="take the rollout and trainer results an earlier run left in <out>/gpu_vllm_e2e/ "
        "instead of rerunning them (what is missing runs; every comparison runs)",
    )
    p.add_argument(
        "--summarize",
        action="store_true",
        help="run nothing: recompute <out>/gpu_vllm_e2e.json and the table from the result "
        "files in <out>/gpu_vllm_e2e/ (a run cut off by a time limit, its files copied back; "
        "no GPU needed); what is missing is reported as an error",
    )
    p.add_argument(
        "--code-hash",
        default=None,
        help="with --summarize: the code hash of the run whose files are summarized, where its "
        "rollout files do not record one (older runs)",
    )
    p.add_argument("--budget", type=int, default=BUDGET, help=argparse.SUPPRESS)  # CPU smoke
    args = p.parse_args()
    if args.mode == "drive":
        return _drive(args)
    res = _rollout(args) if args.mode == "rollout" else _trainer(args)
    Path(args.result).write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
