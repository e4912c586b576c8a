"""Hugging Face transformers adapter on CPU: real transformers, native providers, tiny models."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trainer_cases as tc  # noqa: E402

from rl_engine import ops  # noqa: E402
from rl_engine.adapters import hf as ha  # noqa: E402
from rl_engine.testing.invariance import assert_bitwise  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

CASES = [
    ("llama", "float32", False),
    ("qwen2", "bfloat16", True),
    ("qwen3", "float32", True),
]


ckpts = tc.case_ckpts_fixture(CASES, seed=5, folder="ckpt")
models = tc.hf_models_fixture("ckpts")


def _lp(model, temperature=0.7):
    def fn(ids, mask):
        with torch.no_grad():
            return ha.token_logprobs(model, ids, temperature, attention_mask=mask)

    return fn


def test_patch_idempotent_and_unpatch(ckpts):
    model = tc.load_hf(ckpts[CASES[2]], "float32", patch=False)
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        stock = model(ids).logits
    report = ha.patch_model(model)
    names = set(report["patched"])
    assert {"lm_head", "model.norm", "model.layers.0.self_attn", "model.layers.0.mlp"} <= names
    assert "model.layers.0.self_attn.q_norm" in names and "model.layers.1.mlp.down_proj" in names
    assert set(report["left_alone"]) == {"model.embed_tokens", "model.rotary_emb"}
    attn = model.model.layers[0].self_attn
    assert getattr(attn.forward, "_rl_engine_patched", False)
    assert attn.forward.__wrapped__.__func__ is type(attn).forward
    assert model.config._attn_implementation == "rl_engine"
    again = ha.patch_model(model)
    assert again["patched"] == [] and set(again["already"]) == names
    with torch.no_grad():
        patched = model(ids).logits
    ha.unpatch_model(model)
    assert not ha.is_patched(model) and "forward" not in attn.__dict__
    with torch.no_grad():
        assert_bitwise(model(ids).logits, stock, "unpatched model == stock")
    torch.testing.assert_close(patched, stock, rtol=1e-5, atol=2e-5)


def test_deepcopy_reference_model_uses_its_own_weights(ckpts):
    """TRL-style reference policy: ``copy.deepcopy(patched_policy)``. After an in-place
    (optimizer-like) update of the policy, the copy still computes with the old weights: bitwise
    the log-probs of a freshly loaded and patched model, and not those of the updated policy.
    Pickling (``torch.save`` of the whole model) and ``state_dict`` keep working."""
    path = ckpts[("llama", "float32", False)]
    policy = tc.load_hf(path, "float32")
    reference = copy.deepcopy(policy)
    assert ha.is_patched(reference) and reference.config._attn_implementation == "rl_engine"
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for p in policy.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g))
    fresh = tc.load_hf(path, "float32")
    ids, mask = tc.right_padded(tc.sequences()[:3])
    lp_ref = _lp(reference)(ids, mask)
    assert_bitwise(lp_ref, _lp(fresh)(ids, mask), "deep copy vs freshly patched old weights")
    assert not torch.equal(lp_ref, _lp(policy)(ids, mask)), "the copy followed the policy update"
    for mod in reference.modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None:
            assert fwd.module is mod, "a copied forward still points at the original module"

    buf = io.BytesIO()
    torch.save(policy, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert ha.is_patched(loaded)
    assert_bitwise(_lp(loaded)(ids, mask), _lp(policy)(ids, mask), "torch.save / torch.load")
    assert ha.is_patched(pickle.loads(pickle.dumps(reference)))
    stock = tc.load_hf(path, "float32", patch=False)
    assert list(policy.state_dict()) == list(stock.state_dict())
    reference.load_state_dict(policy.state_dict())
    assert_bitwise(_lp(reference)(ids, mask), _lp(policy)(ids, mask), "load_state_dict")
    ha.unpatch_model(reference)
    assert not ha.is_patched(reference) and ha.is_patched(policy)
    assert "forward" not in reference.model.layers[0].self_attn.__dict__
    assert getattr(policy.model.layers[0].self_attn.forward, "_rl_engine_patched", False)


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_micro_batch_and_layout_invariance(models, case):
    """Bitwise equal across micro-batch sizes {1, 2, 5}, packed, right- and left-padded."""
    model = models[case]
    seqs, ref, _, _ = tc.check_layouts(ha.token_logprobs, model, 0.7, packed_row=True)
    tc.check_packed_via_position_ids(model, seqs, ref, 0.7)


def test_logits_forward_equals_token_logprobs(models):
    """model(ids).logits (patched LM head, model dtype) + logp == token_logprobs bitwise."""
    model = models[("qwen2", "bfloat16", True)]
    ids, _ = tc.right_padded(tc.sequences(2)[:2])
    with torch.no_grad():
        logits = model(ids).logits
        fused = ha.token_logprobs(model, ids, 0.7)
    assert logits.dtype == torch.bfloat16
    b, t = ids.shape
    unfused = ops.logp(logits[:, :-1].reshape(b * (t - 1), -1), ids[:, 1:].reshape(-1), 0.7)
    assert_bitwise(fused.reshape(-1), unfused, "linear_logp vs logits + logp")


def test_stock_hf_mismatches(ckpts):
    """The "before" picture: stock transformers (fp32, this CPU) gives a sequence alone other
    logits than the same sequence inside a padded batch."""
    model = tc.load_hf(ckpts[("llama", "float32", False)], "float32", patch=False)
    mism = tc.alone_vs_batch_mismatches(model, tc.sequences())
    assert mism > 0, "stock transformers happened to be invariant on this machine"


def test_generate_kv_cache_matches_teacher_forcing(models):
    """Greedy ``generate`` with a KV cache (paged decode path) reports, through ``logp`` on its
    step logits, the bits of the teacher-forced ``token_logprobs`` of the generated sequences,
    for several batch sizes and for left-padded prompts."""
    model = models[("qwen3", "float32", True)]
    g = torch.Generator().manual_seed(7)
    prompt_len, new = 6, 4
    prompts = torch.randint(3, 512, (3, prompt_len), generator=g)
    masks = {1: torch.ones(1, prompt_len, dtype=torch.long), 3: torch.ones(3, prompt_len).long()}
    left = torch.ones(3, prompt_len, dtype=torch.long)
    left[1, :2] = 0
    left[2, :4] = 0
    for name, ids, mask in (
        ("bs1", prompts[:1], masks[1]),
        ("bs3", prompts, masks[3]),
        ("left-padded", prompts * left, left),
    ):
        seq, rollout = tc.greedy_rollout(model, ids, mask, new)
        full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype)], 1)
        with torch.no_grad():
            tf = ha.token_logprobs(model, seq, 1.0, attention_mask=full_mask)
        assert_bitwise(tf[:, prompt_len - 1 :], rollout, f"generate vs teacher forcing ({name})")


def test_backward_deterministic(models):
    model = models[("llama", "float32", False)]
    seqs = tc.sequences()[1:4]
    ids, mask = tc.right_padded(seqs)
    grads = tc.grads_twice_bitwise(ha.token_logprobs, model, ids, mask, 0.7)
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_padded_batch_keeps_the_attention_output_once(tmp_path):
    """A right-padded batch: the attention runs on the real tokens, and the output projection
    takes that output itself, not its zero-padded [b, s] scatter, so autograd keeps one
    attention output a layer (the scatter was a second, [b * s, heads x head dim]). Real
    tokens' log-probs are those of the packed layout (the layout test above)."""
    # heads x head dim (64) unlike the hidden size (128), so the shapes tell them apart
    model = tc.load_hf(make_tiny_model(tmp_path / "m", "llama", "float32", head_dim=16), "float32")
    q_width = model.config.num_attention_heads * 16
    assert q_width != model.config.hidden_size
    ids, mask = tc.right_padded(tc.sequences()[1:4])
    b, s = ids.shape
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.is_floating_point():
            shapes.append(tuple(t.shape))
        return t

    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ha.token_logprobs(model, ids, 0.7, attention_mask=mask)
    finally:
        model.eval()
    padded = [sh for sh in shapes if sh in ((b, s, q_width), (b * s, q_width))]
    n_real = int(mask.sum())
    assert n_real < b * s and (n_real, q_width) in shapes, "no projection input of real rows"
    assert not padded, f"a padded attention output is kept for the backward: {padded}"


def test_fused_projections_equal_separate_layers(ckpts, monkeypatch):
    """q/k/v and gate/up as one GEMM each (the default) give the log-probs of separate layers
    bitwise, and the gradients that do not pass through a fused input gradient (last layer's
    gate/up, down, final norm, LM head) bitwise; a Linear with a hook is not fused."""
    case = ("qwen2", "bfloat16", True)  # QKV bias
    seqs = tc.sequences()[1:4]
    ids, mask = tc.right_padded(seqs)
    calls = []
    real = ops.det_gemm_cat
    monkeypatch.setattr(ops, "det_gemm_cat", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for fuse in (True, False):
        model = tc.load_hf(ckpts[case], case[1], patch=False)
        ha.patch_model(model, fuse_projections=fuse)
        model.train()
        calls.clear()
        lp = ha.token_logprobs(model, ids, 0.7, attention_mask=mask)
        (-lp.sum()).backward()
        n_layers = model.config.num_hidden_layers
        assert len(calls) == (2 * n_layers if fuse else 0)
        out[fuse] = (lp.detach(), {n: p.grad for n, p in model.named_parameters()}, model)
    assert_bitwise(out[True][0], out[False][0], "log-probs fused vs separate")
    last = out[True][2].config.num_hidden_layers - 1
    for n in (
        f"model.layers.{last}.mlp.gate_proj.weight",
        f"model.layers.{last}.mlp.up_proj.weight",
        f"model.layers.{last}.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert_bitwise(out[True][1][n], out[False][1][n], f"grad {n} fused vs separate")
    model = out[True][2]
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: None)
    calls.clear()
    with torch.no_grad():
        lp = ha.token_logprobs(model, ids, 0.7, attention_mask=mask)
    handle.remove()
    assert len(calls) == 2 * model.config.num_hidden_layers - 1  # layer 0's q/k/v not fused
    assert_bitwise(lp, out[False][0], "log-probs with one layer unfused")


def test_errors(models, ckpts, tmp_path):
    model = models[("llama", "float32", False)]
    ids = torch.randint(0, 512, (2, 6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ha.token_logprobs(model, ids[0], cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="not both"):
        ha.token_logprobs(model, ids[:1], cu_seqlens=torch.tensor([0, 6]), attention_mask=ids[:1])
    with pytest.raises(TypeError, match="int64"):
        ha.token_logprobs(model, ids.float())
    with pytest.raises(ValueError, match="attention_mask shape"):
        ha.token_logprobs(model, ids, attention_mask=torch.ones(2, 5))
    bad = ids.clone()
    bad[1, 3] = model.get_input_embeddings().weight.shape[0]  # one past the vocabulary
    with pytest.raises(ValueError, match=r"input_ids: token ids must lie in \[0, "):
        ha.token_logprobs(model, bad)
    # int64 cu_seqlens are taken as they are (converted)
    packed = ha.token_logprobs(model, ids.reshape(-1), cu_seqlens=torch.tensor([0, 6, 12]))
    assert packed.shape == (11,)
    stock = tc.load_hf(ckpts[("llama", "float32", False)], "float32", patch=False)
    with pytest.raises(ha.UnsupportedModelError, match="patch_model"):
        ha.token_logprobs(stock, ids)
    gelu = make_tiny_model(tmp_path / "gelu", "llama", hidden_act="gelu")
    with pytest.raises(ha.UnsupportedModelError, match="hidden_act"):
        ha.patch_model(tc.load_hf(gelu, "float32", patch=False))
    # a float64 model: refused at patch time (the ops take fp32 / bf16 / fp16), not at its
    # first forward
    f64 = tc.load_hf(ckpts[("llama", "float32", False)], "float32", patch=False).double()
    with pytest.raises(ha.UnsupportedModelError, match="torch.float64"):
        ha.patch_model(f64)
    assert not ha.is_patched(f64)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    )
    with pytest.raises(ha.UnsupportedModelError, match="model_type"):
        ha.patch_model(gpt2)
    attn = model.model.layers[0].self_attn
    with pytest.raises(ha.UnsupportedModelError, match="2-D padding mask"):
        attn(torch.zeros(1, 4, 128), attention_mask=torch.zeros(1, 1, 4, 4))
