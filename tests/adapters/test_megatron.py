"""megatron-core adapter on CPU: real megatron-core 0.16.1, native providers, tiny checkpoints."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import megatron_shim  # noqa: E402  (tests/adapters: CPU shim, documented there)
import trainer_cases as tc  # noqa: E402

from rl_engine.testing.invariance import assert_bitwise  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

# This is the CPU suite (native providers, CPU tensors): on a CUDA machine too, with CUDA hidden
# from the module (megatron_shim.module_fixture(force_cpu=True)); the same cases with the Triton
# providers on the GPU: tests/adapters/test_trainer_gpu.py.
pytestmark = pytest.mark.megatron

# (arch, dtype, tied): every architecture, both dtypes, tied and untied embeddings.
CASES = [
    ("llama", "float32", False),
    ("qwen2", "bfloat16", True),
    ("qwen3", "bfloat16", True),
]


_shim = megatron_shim.module_fixture(force_cpu=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        c: make_tiny_model(root / f"{c[0]}-{c[1]}-{int(c[2])}", c[0], c[1], c[2], seed=3)
        for c in CASES + [("qwen3", "float32", False)]
    }


@pytest.fixture(scope="module")
def models(ckpts):
    from rl_engine.adapters import megatron as ma

    return {c: ma.from_pretrained(p) for c, p in ckpts.items()}


def _lp(model, **kw):
    from rl_engine.adapters import megatron as ma

    def fn(ids, mask):
        with torch.no_grad():
            return ma.token_logprobs(model, ids, 0.7, attention_mask=mask, **kw)

    return fn


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-tied{int(c[2])}")
def test_micro_batch_and_layout_invariance(models, case):
    """Bitwise equal across micro-batch sizes {1, 2, 5}, packed, right- and left-padded."""
    from rl_engine.adapters import megatron as ma

    seqs, _, lp_packed, lp_left = tc.check_layouts(ma.token_logprobs, models[case], 0.7)
    assert lp_packed.dtype == torch.float32
    # masked positions are exact zeros
    assert torch.all(lp_left[1:, 0] == 0)  # rows 1.. are left-padded
    assert int((lp_packed == 0).sum()) >= len(seqs) - 1


def test_matches_hf_adapter_bitwise(models, ckpts):
    """Megatron adapter == HF adapter, bitwise, for every case (same checkpoint)."""
    from rl_engine.adapters import hf as ha
    from rl_engine.adapters import megatron as ma

    seqs = tc.sequences(1)
    ids, mask = tc.right_padded(seqs)
    for case, path in ckpts.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, case[1]))
        ha.patch_model(hf)
        with torch.no_grad():
            a = ma.token_logprobs(models[case], ids, 1.0, attention_mask=mask)
            b = ha.token_logprobs(hf, ids, 1.0, attention_mask=mask)
        assert_bitwise(a, b, f"megatron vs hf {case}")


def test_logits_forward_equals_linear_logp(models):
    """GPTModel.forward's logits (rl_engine output layer) + logp == token_logprobs (fused)."""
    from rl_engine import ops
    from rl_engine.adapters import megatron as ma

    model = models[("qwen2", "bfloat16", True)]
    ids, _ = tc.right_padded(tc.sequences(2)[:2])
    with torch.no_grad():
        logits = model(ids, None, None)  # [B, T, V] in the model dtype
        fused = ma.token_logprobs(model, ids, 0.7)
    # GPTModel builds its LM head outside the layer spec: from_pretrained makes it rl_engine's
    # too (it was the stock GEMM once, and this test passed or failed with the host's BLAS)
    from rl_engine.adapters.megatron.modules import RLColumnParallelLinear

    assert type(model.output_layer) is RLColumnParallelLinear
    assert logits.dtype == torch.bfloat16
    b, t = ids.shape
    unfused = ops.logp(logits[:, :-1].reshape(b * (t - 1), -1), ids[:, 1:].reshape(-1), 0.7)
    assert_bitwise(fused.reshape(-1), unfused, "linear_logp vs logits + logp")


def test_accuracy_vs_stock_hf(models, ckpts):
    """Close to the stock transformers forward (fp32): the adapter computes the same model."""
    case = ("qwen3", "float32", False)
    from rl_engine.adapters import megatron as ma

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts[case], dtype=torch.float32)
    ids, _ = tc.right_padded(tc.sequences(3)[:1])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.double(), -1)[:, :-1]
        ref = ref.gather(-1, ids[:, 1:, None])[..., 0]
        lp = ma.token_logprobs(models[case], ids)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=2e-5)


def _stock_model(path, dtype):
    from rl_engine.adapters import megatron as ma

    return ma.stock_from_pretrained(path, dtype=dtype)


def test_stock_megatron_mismatches(ckpts):
    """The "before" picture: stock Megatron logits of a sequence alone differ from the same
    sequence inside a padded batch (fp32 on this CPU)."""
    model = _stock_model(ckpts[("llama", "float32", False)], torch.float32)
    seqs = tc.sequences()
    ids, _ = tc.right_padded(seqs)
    with torch.no_grad():
        full = model(ids, None, None)
        alone = [model(s[None], None, None)[0] for s in seqs]
    mism = tc.count_mismatches(alone, [full[i, : s.numel()] for i, s in enumerate(seqs)])
    assert mism > 0, "stock megatron-core happened to be invariant on this machine"


def test_replace_modules(models, ckpts):
    """replace_modules on a stock GPTModel: keeps parameters, equals the spec model bitwise,
    idempotent, reports what it left alone."""
    from rl_engine.adapters import megatron as ma

    case = ("qwen3", "float32", False)
    model = _stock_model(ckpts[case], torch.float32)
    params = {n: p for n, p in model.named_parameters()}
    report = ma.replace_modules(model)
    assert report.replaced and not report.not_replaced
    assert "embedding" in report.left_alone and "rotary_pos_emb" in report.left_alone
    for n, p in model.named_parameters():
        assert params[n] is p, f"{n} is a new Parameter"
    seqs = tc.sequences()
    ref = tc.micro_batched(_lp(models[case]), seqs, 5)
    tc.assert_lists_bitwise(tc.micro_batched(_lp(model), seqs, 2), ref, "replaced vs spec model")
    again = ma.replace_modules(model)
    assert again.replaced == [] and again.already


class _Wrapper(torch.nn.Module):
    """DDP / ``Float16Module`` style wrapper: the model under ``.module``, its config exposed."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_replace_modules_on_wrapped_model(models, ckpts):
    """replace_modules on a wrapped model converts the GPTModel inside, RoPE included: bitwise
    the spec model; RoPE is never dropped silently (rope=None on a RoPE model is reported)."""
    from rl_engine.adapters import megatron as ma

    case = ("qwen3", "float32", False)
    wrapped = _Wrapper(_stock_model(ckpts[case], torch.float32))
    report = ma.replace_modules(wrapped)
    ids, mask = tc.right_padded(tc.sequences()[:3])
    assert_bitwise(_lp(wrapped)(ids, mask), _lp(models[case])(ids, mask), "wrapped vs spec")
    assert not report.not_replaced and "rotary_pos_emb" in report.left_alone
    assert "decoder.layers.0.self_attention.core_attention" in report.replaced
    with pytest.raises(ma.UnsupportedNumericsError, match="applies RoPE"):
        ma.replace_modules(_stock_model(ckpts[case], torch.float32), rope=None)
    lax = ma.replace_modules(_stock_model(ckpts[case], torch.float32), rope=None, strict=False)
    assert [n for n, _ in lax.not_replaced] == ["rotary_pos_emb"]


def test_replace_modules_reports_every_skipped_module(ckpts):
    """A module holding parameters that rl_engine does not route is never skipped silently."""
    from rl_engine.adapters import megatron as ma

    model = _stock_model(ckpts[("llama", "float32", False)], torch.float32)
    extra = torch.nn.Module()
    extra.scale = torch.nn.Parameter(torch.ones(4))
    model.decoder.layers[0].mystery = extra
    with pytest.raises(ma.UnsupportedNumericsError, match="decoder.layers.0.mystery"):
        ma.replace_modules(model)
    report = ma.replace_modules(model, strict=False)
    assert [n for n, _ in report.not_replaced] == ["decoder.layers.0.mystery"]


def test_replace_modules_eps_from_config(tmp_path):
    """RMSNorm eps comes from the config (layernorm_epsilon), never from a hard-coded default:
    a norm with eps=None gets the config's; a conflicting or missing eps is refused."""
    from rl_engine.adapters import megatron as ma

    path = make_tiny_model(tmp_path / "eps", "qwen3", "float32", False, seed=3, rms_norm_eps=1e-3)

    def stock_without_eps():
        model = _stock_model(path, torch.float32)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
        assert len(norms) > 4
        for m in norms:
            m.eps = None
        return model, norms

    model, _ = stock_without_eps()
    ma.replace_modules(model)
    eps = {m.eps for m in model.modules() if type(m).__name__ == "RLRMSNorm"}
    assert eps == {1e-3}
    ids, mask = tc.right_padded(tc.sequences()[:3])
    assert_bitwise(_lp(model)(ids, mask), _lp(ma.from_pretrained(path))(ids, mask), "eps")
    model, norms = stock_without_eps()
    norms[2].eps = 1e-5
    with pytest.raises(ma.UnsupportedNumericsError, match="differs from config.layernorm_eps"):
        ma.replace_modules(model)
    model, _ = stock_without_eps()
    model.config.layernorm_epsilon = None
    with pytest.raises(ma.UnsupportedNumericsError, match="eps=None"):
        ma.replace_modules(model)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padded_vocabulary_takes_no_mass(tmp_path, tied):
    """Megatron pads the vocabulary; the rollout truncates its logits to the checkpoint's. The
    padded LM-head rows (here large random values) never take probability mass: log-probs and
    entropies equal the unpadded model's bitwise, the padded rows get no gradient, and an
    undeclared true vocabulary size is an error, not a guess."""
    from megatron.core.models.gpt import GPTModel

    from rl_engine.adapters import megatron as ma
    from rl_engine.adapters.megatron import loader

    path = make_tiny_model(tmp_path / "m", "qwen2", "float32", tied, seed=4)
    ref = ma.from_pretrained(path)
    cfg = loader._read_config(str(path))
    vocab, padded = cfg["vocab_size"], cfg["vocab_size"] + 128
    tcfg = loader.hf_config_to_megatron(cfg, torch.float32)
    rope = loader.rope_from_hf_config(cfg)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=ma.get_gpt_block_rl_spec(tcfg.num_layers, rope=rope),
        vocab_size=padded,
        max_sequence_length=cfg["max_position_embeddings"],
        share_embeddings_and_output_weights=tied,
        position_embedding_type="none",
    )
    state = dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in state:
            pad = 5 * torch.randn(padded - vocab, state[k].shape[1], generator=g)
            state[k] = torch.cat([state[k], pad])
    model.load_state_dict(state, strict=False)
    model.eval()
    ids, mask = tc.right_padded(tc.sequences()[:3])
    with pytest.raises(ValueError, match="true vocabulary size"):
        ma.token_logprobs(model, ids, 0.7, attention_mask=mask)
    with torch.no_grad():
        lp_ref, ent_ref = ma.token_logprobs(ref, ids, 0.7, attention_mask=mask, return_entropy=True)
        lp, ent = ma.token_logprobs(
            model, ids, 0.7, attention_mask=mask, return_entropy=True, vocab_size=vocab
        )
    assert_bitwise(lp, lp_ref, "padded vocab log-probs")
    assert_bitwise(ent, ent_ref, "padded vocab entropies")
    ma.replace_modules(_Wrapper(model), vocab_size=vocab)  # declared once, on the model
    lp = ma.token_logprobs(model, ids, 0.7, attention_mask=mask)
    assert_bitwise(lp.detach(), lp_ref, "declared through replace_modules")
    lp.sum().backward()
    head = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
    assert head.grad[vocab:].abs().max() == 0 and head.grad[:vocab].abs().max() > 0
    bad = ids.clone()
    bad[0, 2] = vocab + 3
    with pytest.raises(ValueError, match="token ids must lie in"):
        ma.token_logprobs(model, bad, 0.7)
    with pytest.raises(ValueError, match="vocab_size must be an int"):
        ma.token_logprobs(model, ids, 0.7, vocab_size=padded + 1)


def test_replace_modules_strict_refuses_layernorm(ckpts):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rl_engine.adapters import megatron as ma

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        use_cpu_initialization=True,
        normalization="LayerNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=32)
    with pytest.raises(ma.UnsupportedNumericsError, match="LayerNorm"):
        ma.replace_modules(model, rope=None)
    report = ma.replace_modules(model, rope=None, strict=False)
    assert any("LayerNorm" in r for _, r in report.not_replaced)


def test_backward_deterministic(models):
    """Gradients are bitwise equal run to run; the forward ignores extra right padding.

    Weight gradients sum over rows, so they depend on the batch layout (Megatron's layers see
    rows in [s, b] order, the LM head in [b, s] order); they are not claimed invariant to
    padding at the model level, only deterministic.
    """
    from rl_engine.adapters import megatron as ma

    model = models[("qwen2", "bfloat16", True)]
    model.train()
    seqs = tc.sequences()[1:4]
    ids, mask = tc.right_padded(seqs)
    try:
        grads, lps = [], []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            lp = ma.token_logprobs(model, ids, 0.7, attention_mask=mask)
            (-lp.sum()).backward()
            lps.append(lp.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n in grads[0]:
            assert_bitwise(grads[0][n], grads[1][n], f"grad {n} run-to-run")
        assert grads[0]["decoder.layers.0.self_attention.linear_qkv.weight"].abs().sum() > 0
        pad_ids = torch.cat([ids, torch.zeros(ids.shape[0], 3, dtype=ids.dtype)], dim=1)
        pad_mask = torch.cat([mask, torch.zeros(ids.shape[0], 3, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            lp_pad = ma.token_logprobs(model, pad_ids, 0.7, attention_mask=pad_mask)
        assert_bitwise(lp_pad[:, : ids.shape[1] - 1], lps[0], "forward with extra right padding")
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def _saved_activation_bytes(model, fn) -> int:
    """Bytes of the distinct floating-point storages autograd saves for the backward of
    ``fn()``, parameters left out: the activations a training step keeps alive between forward
    and backward (integer index tensors left out too: Megatron's layers each keep their own
    [tokens] int64 rotary positions, 8 bytes a token and layer)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.is_floating_point():
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saved_activations_equal_the_hf_adapter(models, ckpts):
    """A batch in the [s, b] layout keeps no more activations for the backward than the HF
    adapter on the same checkpoint. Before the attention output went to the output projection as
    a view, its [s, b] copy was kept next to the attention's own output: one [tokens, heads x head
    dim] tensor a layer more (0.5 GiB of the 1B benchmark model's 8.9 GiB step)."""
    from rl_engine.adapters import hf as ha
    from rl_engine.adapters import megatron as ma

    case = ("qwen2", "bfloat16", True)
    # full rows: the HF adapter runs attention on the real tokens only, Megatron's padded layout
    # on every position, so padding would count against Megatron here for another reason
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts[case], dtype=torch.bfloat16)
    ha.patch_model(hf)
    model = models[case]
    hf.train()
    model.train()
    try:
        mg = _saved_activation_bytes(
            model, lambda: ma.token_logprobs(model, ids, 0.7, attention_mask=mask)
        )
        ref = _saved_activation_bytes(
            hf, lambda: ha.token_logprobs(hf, ids, 0.7, attention_mask=mask)
        )
    finally:
        model.eval()
    assert 0 < mg <= ref, f"megatron keeps {mg} bytes for the backward, the HF adapter {ref}"


def test_errors(models):
    from rl_engine.adapters import megatron as ma

    model = models[("llama", "float32", False)]
    ids = torch.randint(0, 512, (2, 6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ma.token_logprobs(model, ids[0], cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="not both"):
        ma.token_logprobs(
            model, ids[:1], cu_seqlens=torch.tensor([0, 6]), attention_mask=torch.ones(1, 6)
        )
    with pytest.raises(TypeError, match="int64"):
        ma.token_logprobs(model, ids.float())
    with pytest.raises(ValueError, match="attention_mask shape"):
        ma.token_logprobs(model, ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="GPTModel"):
        ma.token_logprobs(torch.nn.Linear(2, 2), ids)
    with pytest.raises(ma.UnsupportedNumericsError, match="causal"):
        h = torch.zeros(6, 2, 4, 32)
        bad = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
        model.decoder.layers[0].self_attention.core_attention(h, h[:, :, :2], h[:, :, :2], bad)


def test_unsupported_config_refused(tmp_path):
    from rl_engine.adapters import megatron as ma

    path = make_tiny_model(tmp_path / "m", "llama", hidden_act="gelu")
    with pytest.raises(ma.UnsupportedNumericsError, match="hidden_act"):
        ma.from_pretrained(path)


def test_checkpoint_tensor_without_a_place_refused(tmp_path):
    """A checkpoint tensor the Megatron model has no place for is refused, named, never
    dropped: Qwen3 with ``attention_bias=True`` has an ``o_proj`` bias (transformers adds it to
    the attention output), which the GPT model built without linear biases would ignore."""
    from rl_engine.adapters import megatron as ma

    path = make_tiny_model(tmp_path / "m", "qwen3", attention_bias=True)
    with pytest.raises(ma.UnsupportedNumericsError, match=r"layers\.0\.self_attn\.o_proj\.bias"):
        ma.from_pretrained(path)
    with pytest.raises(ma.UnsupportedNumericsError, match="attention_bias"):
        ma.stock_from_pretrained(path)


def test_stock_model_refuses_rope_scaling(tmp_path):
    """megatron's stock rotary embedding takes ``rope_theta`` alone: the stock model of a
    checkpoint with RoPE scaling is refused (it would compute another model), naming the type;
    rl_engine's model runs the scaling."""
    from rl_engine.adapters import megatron as ma

    scaling = {"rope_type": "linear", "factor": 2.0}
    path = make_tiny_model(tmp_path / "m", "llama", rope_parameters=scaling)
    with pytest.raises(ma.UnsupportedNumericsError, match="rope_type 'linear'"):
        ma.stock_from_pretrained(path)
    assert ma.from_pretrained(path).rl_engine_rope.scaling["rope_type"] == "linear"


def test_token_ids_outside_the_vocabulary_are_an_error(tmp_path):
    """An id outside ``[0, vocab)`` anywhere (the first token is embedded, never scored) is a
    ValueError naming the range, as in the HF adapter: not an ``IndexError`` from inside the
    embedding (at TP > 1 a vocab-parallel embedding would give it a silent zero row)."""
    from rl_engine.adapters import megatron as ma

    model = ma.from_pretrained(make_tiny_model(tmp_path / "m", "llama", num_hidden_layers=1))
    for bad in ([512, 5, 6], [-1, 5, 6]):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
            ma.token_logprobs(model, torch.tensor([bad]), 1.0)
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
            ma.token_logprobs(model, torch.tensor(bad), 1.0, cu_seqlens=torch.tensor([0, 3]))
