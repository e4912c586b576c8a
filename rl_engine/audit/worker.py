"""One side of one audit configuration, run in its own process.

``python -m rl_engine.audit.worker IN.json OUT.json``. IN holds ``{"role": "rollout"|"trainer",
"engine": "stock"|"rl_engine", ...}``; OUT receives the sampled tokens / log-probs and the
process's registry provenance. A process per side and configuration keeps vLLM's plugin state,
the registry's sticky resolutions and the environment of each side apart; within it, one engine
(or one loaded trainer) serves every rollout concurrency of the configuration: a vLLM start with
torch.compile and CUDA graphs costs far more than the audit's generation. On an exception the
worker also writes its traceback to ``OUT.json.traceback`` (the parent shows it even when the
worker's stderr went to a terminal) and exits non-zero.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from rl_engine._cli_common import write_json_atomic


def _rollout(cfg: dict[str, Any]) -> dict[str, Any]:
    """One engine, every concurrency in ``cfg["batch_sizes"]`` in turn: at concurrency ``bs`` the
    prompts go in groups of ``bs`` requests, a group finishing before the next starts, so no
    decode step holds more than ``bs`` sequences (concurrency 1: each prompt alone). Prefix
    caching is on: a later pass may reuse the prompt blocks an earlier one cached (a prefix-cache
    hit is one more composition the invariance must hold for)."""
    import time

    from vllm import SamplingParams

    from rl_engine.engines import sampled_sequences, vllm_engine

    device = cfg.get("device", "cpu")
    from vllm.platforms import current_platform

    if current_platform.device_type != device:
        raise RuntimeError(
            f"--device {device}: the vLLM installed here runs on {current_platform.device_type!r}"
            " (install the vLLM build for the device you audit)"
        )
    on_gpu = device != "cpu"
    batch_sizes = cfg["batch_sizes"]
    llm = vllm_engine(
        cfg["model"],
        dtype=cfg["dtype"],
        seed=cfg["seed"],
        max_num_seqs=max(batch_sizes),
        max_model_len=cfg["max_model_len"],
        # as rollouts run on a GPU: CUDA graphs + torch.compile, prefix caching, the KV cache
        # sized from the memory fraction
        eager=not on_gpu,
        prefix_caching=True,
        gpu_memory_utilization=cfg.get("gpu_memory_utilization") if on_gpu else None,
        tensor_parallel_size=cfg.get("tensor_parallel_size", 1),
    )
    params = SamplingParams(
        temperature=cfg["temperature"],
        max_tokens=cfg["max_tokens"],
        logprobs=0,
        ignore_eos=True,
    )
    prompts = cfg["prompts"]
    runs = []
    for bs in batch_sizes:
        t0 = time.perf_counter()
        progress = _progress(len(prompts), f"rollout {cfg['engine']} concurrency {bs}", cfg)
        outs = []
        for i in range(0, len(prompts), bs):
            group = [{"prompt_token_ids": p} for p in prompts[i : i + bs]]
            outs += llm.generate(group, params, use_tqdm=False)
            progress(len(group))
        runs.append(
            {
                "batch_size": bs,
                "sequences": sampled_sequences(prompts, outs),
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
    result: dict[str, Any] = {"runs": runs}
    if cfg.get("tensor_parallel_size", 1) > 1 and cfg["engine"] == "rl_engine":
        # the ranks run in vLLM's worker processes: their registries hold the rollout's
        # resolutions (det_gemm_tp among them), not this process's
        from rl_engine.adapters.vllm import provenance

        result["worker_provenance"] = [r for p in provenance(llm) for r in p["registry"]]
    return result


def _trainer(cfg: dict[str, Any]) -> dict[str, Any]:
    """The trainer's log-probs of every run's sampled tokens (one model load), and with
    ``cfg["localize"]`` its activations on that sequence (:mod:`rl_engine.audit.localize`)."""
    import torch

    from rl_engine.engines import completion_slices, load_trainer, pad_right, trainer_logprobs

    mb = cfg.get("micro_batch", 4)
    trainer, engine = cfg["trainer"], cfg["engine"]
    model = load_trainer(
        trainer, engine, cfg["model"], dtype=getattr(torch, cfg["dtype"]), device=cfg.get("device")
    )
    device = next(model.parameters()).device
    runs = []
    for run in cfg["runs"]:
        seqs = run["sequences"]
        full = [s["prompt"] + s["tokens"] for s in seqs]
        progress = _progress(len(full), f"trainer {trainer}/{engine} bs {run['batch_size']}", cfg)
        out: list[list[float]] = []
        for i in range(0, len(full), mb):
            ids, mask = pad_right(full[i : i + mb], device)
            with torch.no_grad():
                lp = trainer_logprobs(model, trainer, engine, ids, mask, cfg["temperature"])
            chunk = seqs[i : i + mb]
            for row, sl in zip(lp.cpu(), completion_slices(chunk)):
                out.append(row[sl].float().tolist())
            progress(len(chunk))
        runs.append({"logprobs": out})
    result: dict[str, Any] = {"runs": runs}
    loc = cfg.get("localize")
    if loc:
        from rl_engine.audit import localize

        capture = localize.capture_hf if trainer == "hf" else localize.capture_megatron
        torch.save(capture(model, loc["sequence"]), loc["capture_path"])
        result["capture_path"] = loc["capture_path"]
    return result


def _localize(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rollout's activations on one sequence (:mod:`rl_engine.audit.localize`), saved to
    ``cfg["capture_path"]``; an eager engine of its own (hooks do not fire inside CUDA graphs).
    The trainer side is captured by the trainer worker (``cfg["localize"]`` of ``_trainer``)."""
    import torch

    from rl_engine.audit import localize
    from rl_engine.engines import vllm_engine

    ids = cfg["sequence"]
    llm = vllm_engine(
        cfg["model"],
        dtype=cfg["dtype"],
        seed=cfg["seed"],
        max_num_seqs=1,
        max_model_len=cfg["max_model_len"],
        max_num_batched_tokens=max(cfg["max_model_len"], len(ids) + 1, 256),
        eager=True,
        prefix_caching=False,
        gpu_memory_utilization=cfg.get("gpu_memory_utilization")
        if cfg.get("device", "cpu") != "cpu"
        else None,
    )
    torch.save(localize.capture_vllm(llm, ids), cfg["capture_path"])
    return {"capture_path": cfg["capture_path"]}


def _progress(total: int, desc: str, cfg: dict[str, Any]):
    if not cfg.get("progress", True):
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, desc=desc, unit="seq", file=sys.stderr, leave=False)
    return bar.update


def main(argv: list[str]) -> int:
    in_path, out_path = argv
    try:
        with open(in_path) as f:
            cfg = json.load(f)
        from rl_engine import KernelRegistry

        roles = {"rollout": _rollout, "trainer": _trainer, "localize": _localize}
        result = roles[cfg["role"]](cfg)
        result["provenance"] = KernelRegistry.report() + result.pop("worker_provenance", [])
    except Exception:
        # for the parent: the traceback even when stderr goes to a terminal, not to the log
        with open(out_path + ".traceback", "w") as f:
            f.write(traceback.format_exc())
        raise
    write_json_atomic(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
