"""The engine runner: the rollout engine (vLLM) and the trainers (Hugging Face, Megatron-core),
stock or rl_engine, as the drift audit (:mod:`rl_engine.audit`), the GRPO loop
(:mod:`rl_engine.grpo`) and the harnesses use them; and the one-process-per-configuration runner.
It sits below the audit and the loop, which share it and do not import each other.

vLLM's plugin patches, the registry's sticky resolutions and Megatron's CPU shim are all
process-global, so each configuration (``stock`` / ``rl_engine``) runs in its own process:
:func:`run_worker` starts ``python -m <module> IN.json OUT.json [EVENTS_FD]`` with the
configuration's environment (:func:`worker_env`), sends its output to a log file and, when asked,
streams the JSON-lines events the worker writes to ``EVENTS_FD``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ENGINES",
    "TRAINERS",
    "WorkerError",
    "completion_slices",
    "load_trainer",
    "pad_right",
    "run_worker",
    "sampled_sequences",
    "small_kv_cache_args",
    "trainer_logprobs",
    "vllm_engine",
    "worker_env",
]

ENGINES = ("stock", "rl_engine")
TRAINERS = ("hf", "megatron")


# ------------------------------------------------------------------------------------ rollout
# vLLM on a GPU checks at start that gpu_memory_utilization (0.92 by default) x the GPU's memory
# is free, even when the KV cache is given in bytes: a tiny-model engine beside other processes
# (a trainer, tests in parallel) would be refused. Such engines ask for this share instead.
SMALL_ENGINE_GPU_SHARE = 0.05


def small_kv_cache_args(kv_cache_bytes: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a KV cache of ``kv_cache_bytes`` (tiny models): the bytes, and
    on a CUDA device also :data:`SMALL_ENGINE_GPU_SHARE` as ``gpu_memory_utilization`` (vLLM's
    start-up check of free memory; the cache size is the bytes either way)."""
    args: dict[str, Any] = {"kv_cache_memory_bytes": kv_cache_bytes}
    if torch.cuda.is_available():
        args["gpu_memory_utilization"] = SMALL_ENGINE_GPU_SHARE
    return args


def vllm_engine(
    model: str,
    *,
    dtype: str,
    seed: int,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    kv_cache_bytes: int = 256 * 1024 * 1024,
    eager: bool = True,
    prefix_caching: bool | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
) -> Any:
    """An in-process ``vllm.LLM`` on a local folder (token-id prompts, no tokenizer); eager
    unless ``eager=False`` (CUDA graphs and torch.compile, vLLM's defaults on a GPU).

    ``logprobs_mode="processed_logprobs"``: reported log-probs are those of the distribution
    actually sampled from (after temperature), which is what the trainer recomputes. The KV cache
    is ``kv_cache_bytes`` (tiny models: do not reserve most of the memory), or sized by vLLM
    from ``gpu_memory_utilization`` when that is given. ``prefix_caching``: vLLM's default when
    ``None``.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        kwargs.update(small_kv_cache_args(kv_cache_bytes))
    if prefix_caching is not None:
        kwargs["enable_prefix_caching"] = prefix_caching
    if tensor_parallel_size != 1:
        kwargs["tensor_parallel_size"] = tensor_parallel_size
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=eager,
        max_num_seqs=max_num_seqs,
        seed=seed,
        logprobs_mode="processed_logprobs",
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens or max(max_model_len, 256),
        **kwargs,
    )


def sampled_sequences(prompts: list[list[int]], outputs: list[Any]) -> list[dict[str, Any]]:
    """``[{"prompt", "tokens", "logprobs"}]`` from ``LLM.generate`` outputs (first completion of
    each request; the log-prob vLLM reported for each sampled token)."""
    seqs = []
    for p, o in zip(prompts, outputs, strict=True):
        c = o.outputs[0]
        if c.logprobs is None:
            raise RuntimeError("vLLM returned no log-probs: request them with logprobs=0")
        lps = [float(step[tok].logprob) for tok, step in zip(c.token_ids, c.logprobs)]
        seqs.append({"prompt": list(p), "tokens": list(c.token_ids), "logprobs": lps})
    return seqs


# ------------------------------------------------------------------------------------ trainer
def load_trainer(
    trainer: str, engine: str, model: str, *, dtype: torch.dtype, device: str | None = None
) -> Any:
    """The trainer model: ``hf`` (transformers, patched onto rl_engine ops for ``rl_engine``) or
    ``megatron`` (``GPTModel`` with the rl_engine spec, or the stock local spec), in eval mode
    (no dropout; gradients still flow).

    ``device`` defaults to CUDA when available. Megatron on CPU uses the CPU shim
    (:mod:`rl_engine.adapters.megatron.cpu_shim`), which does nothing when CUDA is present.
    """
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}; expected one of {TRAINERS}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if trainer == "hf":
        import transformers

        net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
        net.eval()
        if engine == "rl_engine":
            from rl_engine.adapters import hf

            hf.patch_model(net)
        return net
    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        raise ValueError(
            "the Megatron trainer runs on CUDA when CUDA is available (megatron-core's own "
            "device choice); pass --device cuda or use --trainer hf"
        )
    from rl_engine.adapters import megatron
    from rl_engine.adapters.megatron import cpu_shim

    cpu_shim.install()  # one-process model-parallel state; CPU stand-ins when no CUDA
    if engine == "rl_engine":
        return megatron.from_pretrained(model, dtype=dtype, device=device)
    return megatron.stock_from_pretrained(model, dtype=dtype)


def pad_right(
    seqs: list[list[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``ids`` [B, T] (pad 0) and ``mask`` [B, T] (1 = token)."""
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for j, x in enumerate(seqs):
        ids[j, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[j, : len(x)] = 1
    return ids.to(device), mask.to(device)


def _stock_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """What a stock trainer computes: materialised logits -> fp32 log-softmax -> gather."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, ids[:, 1:, None].to(lp.device))[..., 0]


def trainer_logprobs(
    net: Any,
    trainer: str,
    engine: str,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Teacher-forced log-probs [B, T-1] of ``ids[:, 1:]`` (right-padded batch), differentiable
    when grad mode is on. ``rl_engine``: the adapter's ``token_logprobs`` (``linear_logp``);
    ``stock``: the model's logits and torch's log-softmax (Megatron: right padding is harmless
    under the causal mask)."""
    if engine == "rl_engine":
        if trainer == "hf":
            from rl_engine.adapters.hf import token_logprobs
        else:
            from rl_engine.adapters.megatron import token_logprobs
        return token_logprobs(net, ids, temperature=temperature, attention_mask=mask)
    if trainer == "hf":
        logits = net(input_ids=ids, attention_mask=mask).logits
    else:
        logits = net(ids.to(next(net.parameters()).device), None, None)
    return _stock_logprobs(logits, ids, temperature)


def completion_slices(seqs: list[dict[str, Any]]) -> list[slice]:
    """Where each sequence's sampled tokens sit in the [B, T-1] output of
    :func:`trainer_logprobs` (the log-prob of token t+1 sits at index t)."""
    out = []
    for s in seqs:
        start = len(s["prompt"]) - 1
        out.append(slice(start, start + len(s["tokens"])))
    return out


# ------------------------------------------------------------------------------ the processes
class WorkerError(RuntimeError):
    """A worker process failed; the message holds the tail of its log, ``event`` the worker's
    last ``{"type": "error", ...}`` event (or ``None``)."""

    def __init__(self, message: str, event: dict[str, Any] | None = None):
        super().__init__(message)
        self.event = event


def worker_env(plugin: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: in-process vLLM, the rl_engine vLLM plugin on or off."""
    env = dict(os.environ)
    env.pop("RL_ENGINE_VLLM", None)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plugin:
        env["RL_ENGINE_VLLM"] = "1"
    env.update(extra or {})
    return env


def run_worker(
    module: str,
    cfg: dict[str, Any],
    workdir: str,
    tag: str,
    env: dict[str, str],
    *,
    show_stderr: bool = False,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``python -m module IN.json OUT.json [EVENTS_FD]`` and return OUT's JSON.

    stdout (and stderr unless ``show_stderr``) go to ``<workdir>/<tag>.log``. With ``on_event``,
    the worker gets the write end of a pipe as a third argument and every JSON line it writes
    there is passed to ``on_event`` as it arrives. A non-zero exit raises :class:`WorkerError`
    with the last event of type ``"error"`` (if any) and the tail of the log.
    """
    in_path = os.path.join(workdir, f"{tag}.in.json")
    out_path = os.path.join(workdir, f"{tag}.out.json")
    log_path = os.path.join(workdir, f"{tag}.log")
    with open(in_path, "w") as f:
        json.dump(cfg, f)
    argv = [sys.executable, "-m", module, in_path, out_path]
    error: dict[str, Any] | None = None
    with open(log_path, "w") as log:
        if on_event is None:
            proc = subprocess.run(argv, env=env, stdout=log, stderr=None if show_stderr else log)
            rc = proc.returncode
        else:
            r, w = os.pipe()
            try:
                p = subprocess.Popen(
                    [*argv, str(w)],
                    env=env,
                    stdout=log,
                    stderr=None if show_stderr else log,
                    pass_fds=(w,),
                )
            finally:
                os.close(w)
            with os.fdopen(r) as events:
                for line in events:
                    event = json.loads(line)
                    if event.get("type") == "error":
                        error = event
                    on_event(event)
            rc = p.wait()
    if rc != 0 or not os.path.isfile(out_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        msg = f"{tag} failed (exit {rc})"
        if error is not None:
            msg += f": {error.get('message')}"
        raise WorkerError(f"{msg}; last output:\n{tail}", error)
    with open(out_path) as f:
        return json.load(f)
