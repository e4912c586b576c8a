"""Built-in prompts and prompt files for the audit."""

from __future__ import annotations

import json
import os
import random


class AuditInputError(ValueError):
    """Bad input to the audit (reported as a message and a non-zero exit)."""


def builtin_prompts(vocab_size: int, num: int, seed: int = 0) -> list[list[int]]:
    """``num`` token-id prompts of mixed lengths (4..40), two pairs sharing a prefix."""
    rng = random.Random(seed)
    lo, hi = 3, vocab_size - 1  # skip the first ids (pad / bos / eos in the tiny models)
    prompts = [[rng.randint(lo, hi) for _ in range(rng.randint(4, 40))] for _ in range(num)]
    if num >= 4:  # shared prefixes exercise prefix caching where it is on
        prompts[1] = prompts[0][:16] + prompts[1][:8]
        prompts[3] = prompts[2][:12] + prompts[3][:5]
    return prompts


def load_prompts(path: str, model_path: str, vocab_size: int, num: int | None) -> list[list[int]]:
    """Read a JSONL file: one prompt per line, a list of token ids, ``{"prompt_token_ids": [...]}``
    or ``{"text": "..."}`` / a JSON string (needs a tokenizer in the model folder)."""
    if not os.path.isfile(path):
        raise AuditInputError(f"prompt file not found: {path}")
    prompts: list[list[int]] = []
    tokenizer = None
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AuditInputError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if isinstance(item, dict) and "prompt_token_ids" in item:
                item = item["prompt_token_ids"]
            elif isinstance(item, dict) and "text" in item:
                item = item["text"]
            if isinstance(item, str):
                if tokenizer is None:
                    tokenizer = _tokenizer(model_path, path)
                item = tokenizer(item)["input_ids"]
            if not (isinstance(item, list) and item and all(isinstance(t, int) for t in item)):
                raise AuditInputError(
                    f"{path}:{lineno}: expected a non-empty list of token ids, "
                    '{"prompt_token_ids": [...]} or {"text": "..."}'
                )
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise AuditInputError(
                    f"{path}:{lineno}: token id {bad[0]} outside the vocabulary [0, {vocab_size})"
                )
            prompts.append(item)
    if not prompts:
        raise AuditInputError(f"prompt file {path} holds no prompts")
    return prompts[:num] if num else prompts


def _tokenizer(model_path: str, prompt_path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:
        raise AuditInputError(
            f"{prompt_path} holds text prompts but the model folder {model_path} has no usable "
            f"tokenizer ({type(exc).__name__}); give token ids instead"
        ) from None
