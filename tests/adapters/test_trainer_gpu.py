"""GPU: trainer log-probs (Triton providers) == an HF ``generate()`` rollout with a KV cache.

The rollout runs the patched Hugging Face model through ``generate`` (varlen prefill, then
``paged_attention`` decode steps against the KV cache); the trainer side is the teacher-forced
``token_logprobs`` of the HF adapter and of the Megatron adapter (when megatron-core is
importable) on the generated sequences. Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

transformers = pytest.importorskip("transformers")

from rl_engine import KernelRegistry, ops  # noqa: E402
from rl_engine.adapters import hf as ha  # noqa: E402
from rl_engine.testing.invariance import assert_bitwise  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

PROMPT, NEW = 12, 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "qwen3",
        "qwen3",
        "bfloat16",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        vocab_size=4096,
    )


@pytest.fixture(scope="module")
def model(ckpt):
    m = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda()
    m.eval()
    ha.patch_model(m)
    return m


def _rollout(model, prompts, mask, temperature):
    out = model.generate(
        prompts,
        attention_mask=mask,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    seq = out.sequences
    lp = torch.stack(
        [ops.logp(step, seq[:, PROMPT + i], temperature) for i, step in enumerate(out.logits)], 1
    )
    return seq, lp


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_generate_vs_teacher_forced(model, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 4096, (batch, PROMPT), generator=g).cuda()
    mask = torch.ones_like(prompts)
    seq, roll = _rollout(model, prompts, mask, 0.8)
    full = torch.ones_like(seq)
    with torch.no_grad():
        tf = ha.token_logprobs(model, seq, 0.8, attention_mask=full)
    assert_bitwise(tf[:, PROMPT - 1 :], roll, f"generate vs teacher forcing (batch {batch})")
    providers = {r["op"]: r["provider"] for r in KernelRegistry.report()}
    assert providers.get("attention") == "triton", providers
    assert providers.get("det_gemm") == "triton", providers


def test_generate_left_padded(model):
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(3, 4096, (4, PROMPT), generator=g).cuda()
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    mask[3, :7] = 0
    prompts = prompts * mask
    seq, roll = _rollout(model, prompts, mask, 1.0)
    full = torch.cat([mask, torch.ones_like(seq[:, PROMPT:])], 1)
    with torch.no_grad():
        tf = ha.token_logprobs(model, seq, 1.0, attention_mask=full)
    assert_bitwise(tf[:, PROMPT - 1 :], roll, "generate (left padded) vs teacher forcing")


def test_megatron_matches_rollout(model, ckpt):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rl_engine.adapters import megatron as ma

    if not dist.is_initialized():
        import os

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    meg = ma.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 4096, (5, PROMPT), generator=g).cuda()
    seq, roll = _rollout(model, prompts, torch.ones_like(prompts), 0.8)
    with torch.no_grad():
        lp = ma.token_logprobs(meg, seq, 0.8)
    assert_bitwise(lp[:, PROMPT - 1 :], roll, "megatron trainer vs HF generate rollout")
