"""Shared inputs and checks of the adapter tests: variable-length sequences in three layouts,
the layout-invariance checks of a trainer adapter, a greedy ``generate`` rollout, tiny models
(shapes, a checkpoint fixture, a patched HF model)."""

from __future__ import annotations

import pytest
import torch

from rl_engine import ops
from rl_engine.testing.tiny_models import make_tiny_model

LENGTHS = (13, 5, 9, 3, 11)  # five sequences of different lengths
VOCAB = 512  # the tiny models' vocabulary


def sequences(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def right_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    return ids, mask


def left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - s.numel() :] = s
        mask[i, t - s.numel() :] = 1
    return ids, mask


def packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([s.numel() for s in seqs]), 0)
    return torch.cat(seqs), cu


def per_seq_from_right(lp: torch.Tensor, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [lp[i, : s.numel() - 1] for i, s in enumerate(seqs)]


def per_seq_from_left(lp: torch.Tensor, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    t = lp.shape[1] + 1
    return [lp[i, t - s.numel() :] for i, s in enumerate(seqs)]


def per_seq_from_packed(lp: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    return [lp[int(cu[i]) : int(cu[i + 1]) - 1] for i in range(cu.numel() - 1)]


def micro_batched(fn, seqs: list[torch.Tensor], mbs: int) -> list[torch.Tensor]:
    """Run ``fn(ids, mask)`` on right-padded micro-batches of ``mbs`` sequences."""
    out: list[torch.Tensor] = []
    for i in range(0, len(seqs), mbs):
        chunk = seqs[i : i + mbs]
        ids, mask = right_padded(chunk)
        out.extend(per_seq_from_right(fn(ids, mask), chunk))
    return out


def assert_lists_bitwise(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    from rl_engine.testing.invariance import assert_bitwise

    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise(x, y, f"{what}: sequence {i}")


def count_mismatches(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b))


def alone_vs_batch_mismatches(model, seqs: list[torch.Tensor]) -> int:
    """How many logits of ``seqs`` differ (not bitwise) between ``model`` run on each sequence
    alone and inside a right-padded batch of them all (a plain transformers forward: the stock
    "before")."""
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        alone = [model(s[None]).logits[0] for s in seqs]
    return count_mismatches(alone, [full[i, : s.numel()] for i, s in enumerate(seqs)])


def check_layouts(
    token_logprobs, model, temperature: float, *, device: str = "cpu", packed_row: bool = False
):
    """An adapter's ``token_logprobs(model, ...)`` of :func:`sequences` (inputs moved to
    ``device``) is bitwise the same in every layout: micro-batches of 1 and 2 sequences equal one
    of 5 (right padded), and so do the packed (``cu_seqlens``; the ids as one ``[1, N]`` row with
    ``packed_row``, else 1-D) and the left-padded batch.

    Returns ``(seqs, ref, lp_packed, lp_left)`` for the caller's further checks (``ref``: the
    per-sequence log-probs of the micro-batch of 5)."""
    seqs = sequences()

    def fn(ids, mask):
        with torch.no_grad():
            return token_logprobs(
                model, ids.to(device), temperature, attention_mask=mask.to(device)
            )

    ref = micro_batched(fn, seqs, 5)
    for mbs in (1, 2):
        assert_lists_bitwise(micro_batched(fn, seqs, mbs), ref, f"mbs={mbs}")
    flat, cu = packed(seqs)
    ids, mask = left_padded(seqs)
    with torch.no_grad():
        if packed_row:
            lp_packed = token_logprobs(
                model, flat[None].to(device), temperature, cu_seqlens=cu.to(device)
            )[0]
        else:
            lp_packed = token_logprobs(
                model, flat.to(device), temperature, cu_seqlens=cu.to(device)
            )
        lp_left = token_logprobs(model, ids.to(device), temperature, attention_mask=mask.to(device))
    assert_lists_bitwise(per_seq_from_packed(lp_packed, cu), ref, "packed vs padded")
    assert_lists_bitwise(per_seq_from_left(lp_left, seqs), ref, "left vs right padding")
    return seqs, ref, lp_packed, lp_left


def check_packed_via_position_ids(model, seqs, ref, temperature: float, device: str = "cpu"):
    """A (patched) Hugging Face ``model`` on ``seqs`` packed into one row, the packing signalled
    by restarting position ids alone (TRL "padding-free" style), gives ``ref`` bitwise."""
    flat, cu = packed(seqs)
    with torch.no_grad():
        pos = torch.cat([torch.arange(s.numel()) for s in seqs])[None].to(device)
        h = model.model(input_ids=flat[None].to(device), position_ids=pos, use_cache=False)
        logits = model.lm_head(h.last_hidden_state[0])
    via_pos = ops.logp(logits[:-1], flat[1:].to(device), temperature)
    assert_lists_bitwise(per_seq_from_packed(via_pos, cu), ref, "packed via position_ids")


def greedy_rollout(model, prompts, mask, new: int, temperature: float = 1.0):
    """Greedy ``generate`` of ``new`` tokens after ``prompts`` (one width, padded by ``mask``)
    with a KV cache: ``(sequences, log-probs)``, the log-probs ``[B, new]`` of the generated
    tokens at ``temperature`` through ``logp`` on each step's logits."""
    out = model.generate(
        prompts,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    seq = out.sequences
    start = prompts.shape[1]
    lp = torch.stack(
        [ops.logp(step, seq[:, start + i], temperature) for i, step in enumerate(out.logits)], 1
    )
    return seq, lp


def grads_twice_bitwise(token_logprobs, model, ids, mask, temperature: float) -> dict:
    """``{name: grad}`` of ``-token_logprobs(model, ids, temperature, attention_mask=mask).sum()``
    in train mode, after asserting that a second backward pass gives every parameter the same
    gradient bitwise; the model is left in eval mode with no gradients."""
    from rl_engine.testing.invariance import assert_bitwise

    model.train()
    try:
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            lp = token_logprobs(model, ids, temperature, attention_mask=mask)
            (-lp.sum()).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    for n in grads[0]:
        assert_bitwise(grads[0][n], grads[1][n], f"grad {n} run-to-run")
    return grads[0]


def tiny_shape(hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int = 256) -> dict:
    """``make_tiny_model`` config fields of a two-layer test model ``hidden`` wide, its MLP twice
    as wide, ``heads`` query and ``kv_heads`` key / value heads of ``head_dim``."""
    return dict(
        num_hidden_layers=2,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
    )


def tiny_model_fixture(arch: str, shape: dict):
    """A module-scoped fixture: the folder of a tiny random fp32 ``arch`` checkpoint (seed 0)
    with the config fields ``shape`` (see :func:`tiny_shape`). In a test module:
    ``model = tiny_model_fixture("qwen2", SHAPE)``."""

    @pytest.fixture(scope="module")
    def model(tmp_path_factory):
        path = tmp_path_factory.mktemp(arch) / arch
        return make_tiny_model(path, arch=arch, dtype="float32", seed=0, **shape)

    return model


def case_id(case) -> str:
    """The test id of an ``(arch, dtype, tied)`` case: ``llama-float32-tied0``."""
    return f"{case[0]}-{case[1]}-tied{int(case[2])}"


def case_ckpts_fixture(cases, *, seed: int, folder: str):
    """A module-scoped fixture: ``{case: folder}`` of a tiny random checkpoint (``seed``) for
    each ``(arch, dtype, tied)`` case of ``cases``, under a temporary ``folder``. In a test
    module: ``ckpts = case_ckpts_fixture(CASES, seed=5, folder="ckpt")``."""

    @pytest.fixture(scope="module")
    def ckpts(tmp_path_factory):
        root = tmp_path_factory.mktemp(folder)
        return {c: make_tiny_model(root / case_id(c), c[0], c[1], c[2], seed=seed) for c in cases}

    return ckpts


def hf_models_fixture(ckpts: str, device: str = "cpu"):
    """A module-scoped fixture: ``{case: model}``, the checkpoints of the fixture named ``ckpts``
    (see :func:`case_ckpts_fixture`) loaded by :func:`load_hf` in the case's dtype on ``device``,
    patched. In a test module: ``models = hf_models_fixture("ckpts")``."""

    @pytest.fixture(scope="module")
    def models(request):
        paths = request.getfixturevalue(ckpts)
        return {c: load_hf(p, c[1], device=device) for c, p in paths.items()}

    return models


def load_hf(path, dtype: str, patch: bool = True, device: str = "cpu"):
    """The checkpoint at ``path`` as a transformers causal LM in ``dtype`` (a name) on
    ``device``, in eval mode, patched by the HF adapter unless ``patch`` is false."""
    import transformers

    from rl_engine.adapters import hf as ha

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device)
    model.eval()
    if patch:
        ha.patch_model(model)
    return model


def moe_config(**kw):
    """A one-layer megatron ``TransformerConfig`` with MoE layers (8 experts, top-2, SiLU GLU,
    no aux loss), ``kw`` on top: for the MoE layer's refusal tests."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        moe_router_load_balancing_type="none", use_cpu_initialization=True,
    )  # fmt: skip
    base.update(kw)
    return TransformerConfig(**base)
