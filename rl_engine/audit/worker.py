"""One side of one audit configuration, run in its own process.

``python -m rl_engine.audit.worker IN.json OUT.json``. IN holds ``{"role": "rollout"|"trainer",
"engine": "stock"|"rl_engine", ...}``; OUT receives the sampled tokens / log-probs and the
process's registry provenance. A process per side and configuration keeps vLLM's plugin state,
the registry's sticky resolutions and the environment of each side apart.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _rollout(cfg: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        dtype=cfg["dtype"],
        enforce_eager=True,
        max_num_seqs=cfg["batch_size"],
        seed=cfg["seed"],
        logprobs_mode="processed_logprobs",
        max_model_len=cfg["max_model_len"],
        max_num_batched_tokens=max(cfg["max_model_len"], 256),
        kv_cache_memory_bytes=256 * 1024 * 1024,  # tiny models: do not reserve most of the RAM
    )
    params = SamplingParams(
        temperature=cfg["temperature"],
        max_tokens=cfg["max_tokens"],
        logprobs=0,
        ignore_eos=True,
    )
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=cfg.get("progress", True))
    seqs = []
    for p, o in zip(cfg["prompts"], outs):
        c = o.outputs[0]
        lps = [float(step[tok].logprob) for tok, step in zip(c.token_ids, c.logprobs)]
        seqs.append({"prompt": list(p), "tokens": list(c.token_ids), "logprobs": lps})
    return {"sequences": seqs}


def _hf_stock_logprobs(model, input_ids, attention_mask, temperature: float):
    import torch

    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, input_ids[:, 1:, None])[..., 0]


def _megatron_stock_logprobs(model, input_ids, temperature: float):
    """Stock Megatron: materialised logits, then torch's log-softmax (right padding is harmless
    under the causal mask)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids.to(next(model.parameters()).device), None, None)
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, input_ids[:, 1:, None].to(lp.device))[..., 0].cpu()


def _trainer(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, cfg["dtype"])
    temperature = cfg["temperature"]
    seqs = cfg["sequences"]
    full = [s["prompt"] + s["tokens"] for s in seqs]
    mb = cfg.get("micro_batch", 4)
    progress = _progress(len(full), f"trainer {cfg['trainer']}/{cfg['engine']}", cfg)
    if cfg["trainer"] == "hf":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype)
        model.eval()
        if cfg["engine"] == "rl_engine":
            from rl_engine.adapters import hf as adapter

            adapter.patch_model(model)
    elif cfg["trainer"] == "megatron":
        from rl_engine.adapters import megatron as adapter
        from rl_engine.adapters.megatron import cpu_shim

        cpu_shim.install()  # one-process model-parallel state; CPU stand-ins when no CUDA
        if cfg["engine"] == "rl_engine":
            model = adapter.from_pretrained(cfg["model"], dtype=dtype)
        else:
            model = adapter.stock_from_pretrained(cfg["model"], dtype=dtype)
    else:
        raise ValueError(f"unknown trainer {cfg['trainer']!r}")

    out: list[list[float]] = []
    for i in range(0, len(full), mb):
        chunk = full[i : i + mb]
        width = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, x in enumerate(chunk):
            ids[j, : len(x)] = torch.tensor(x)
            mask[j, : len(x)] = 1
        if cfg["engine"] == "stock" and cfg["trainer"] == "hf":
            lp = _hf_stock_logprobs(model, ids, mask, temperature)
        elif cfg["engine"] == "stock":
            lp = _megatron_stock_logprobs(model, ids, temperature)
        else:
            with torch.no_grad():
                lp = adapter.token_logprobs(
                    model, ids, temperature=temperature, attention_mask=mask
                )
        for j, s in enumerate(seqs[i : i + mb]):
            start = len(s["prompt"]) - 1  # log-prob of token t+1 sits at index t
            out.append(lp[j, start : start + len(s["tokens"])].float().tolist())
        progress(len(chunk))
    return {"logprobs": out}


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
    with open(in_path) as f:
        cfg = json.load(f)
    from rl_engine import KernelRegistry

    result = _rollout(cfg) if cfg["role"] == "rollout" else _trainer(cfg)
    result["provenance"] = KernelRegistry.report()
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
