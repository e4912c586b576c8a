"""Hugging Face adapter, mixture-of-experts families on CPU: Qwen3-MoE, Mixtral, Qwen2-MoE
(real transformers, native providers, tiny 8-expert top-2 models)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trainer_cases as tc  # noqa: E402

from rl_engine import ops  # noqa: E402
from rl_engine.adapters import hf as ha  # noqa: E402
from rl_engine.adapters.hf import patch as hp  # noqa: E402
from rl_engine.testing.invariance import assert_bitwise  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
CASES = [(a, d, False) for a in ARCHS for d in ("float32", "bfloat16")]

# Patched vs stock transformers log-probs (same weights), on the tokens whose experts are the
# same in every layer, and not preceded in their sequence by one whose experts differ (its
# attention mixes them in). Not bitwise: stock transformers accumulates in other orders (BLAS
# GEMMs, SDPA) and, in bf16, rounds Qwen's routing weights to bf16 and adds each expert's
# weighted output into a bf16 buffer (k roundings) where moe_combine adds the k slots in fp32
# and rounds once.
TOL = {
    # fp32: reduction-order differences only (~2^-24 relative per add, K <= 128, two layers);
    # the dense adapter's logits tolerance (test_hf.py). Measured max 9.5e-7.
    "float32": 2e-5,
    # bf16: the logits (|logit| < 4 here, ulp <= 2^-7) are rounded to bf16 on both sides; the
    # target logit and the log-sum-exp one ulp apart each is 2^-6; x2 for the bf16-rounded
    # hidden states that feed them. Measured max 0.0125, mean 0.004.
    "bfloat16": 2**-5,
}
# Fraction of real tokens whose (set of) top-k experts must equal stock transformers' in each
# layer. A near-tie flipped by the differences above changes a token's experts: measured, one
# token of 27 in one layer of qwen3_moe-bf16 and of mixtral-bf16, none in fp32.
ROUTING_AGREEMENT = 0.9
# the bf16 cases' logits stay below this (the TOL row above assumes it)
LOGIT_BOUND = 4.0


# smaller than make_tiny_model's defaults: the native (CPU) providers' fixed-order GEMMs cost
# O(M N K) elementwise work, and the experts run one GEMM pair per expert
SHAPE = tc.tiny_shape(64, 2, 1, 32, vocab=tc.VOCAB)  # dense MLP (mlp_only_layers) 128 wide
ARCH_SHAPE = {
    "qwen3_moe": dict(SHAPE, moe_intermediate_size=32),
    "mixtral": dict(SHAPE, intermediate_size=32),  # Mixtral's experts use intermediate_size
    "qwen2_moe": dict(SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


def _make(path, arch, dtype="float32", **kw):
    return make_tiny_model(path, arch, dtype, seed=3, **{**ARCH_SHAPE[arch], **kw})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {c: _make(root / tc.case_id(c), c[0], c[1]) for c in CASES}


models = tc.hf_models_fixture("ckpts")
SEQS = tc.sequences()[:3]  # lengths 13, 5, 9


def _routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _routes(model, ids, mask):
    """``(per-layer expert ids [B*T, k], logits)`` of ``model(ids, attention_mask=mask)``."""
    got = []
    hooks = [
        r.register_forward_hook(lambda mod, args, out: got.append(out[2].detach().clone()))
        for r in _routers(model)
    ]
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    return got, logits


def _lp(model, ids, mask, temperature=1.0):
    with torch.no_grad():
        return ha.token_logprobs(model, ids, temperature, attention_mask=mask)


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_batch_invariance(models, case):
    """Each sequence alone == inside a right-padded batch, bitwise."""
    model = models[case]
    fn = functools.partial(_lp, model)
    tc.assert_lists_bitwise(tc.micro_batched(fn, SEQS, 1), tc.micro_batched(fn, SEQS, 3), "mbs")


def test_layouts(models):
    """Micro-batches of 1, 2 and 5 sequences, left padded, packed (``cu_seqlens`` and restarting
    position ids): the same log-probs bitwise (one family; the layouts reach the MoE block as
    the same rows)."""
    model = models[("qwen2_moe", "bfloat16", False)]
    seqs, ref, _, _ = tc.check_layouts(ha.token_logprobs, model, 0.7, packed_row=True)
    tc.check_packed_via_position_ids(model, seqs, ref, 0.7)


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_backward_deterministic(models, case):
    """Two backward passes of a padded batch give the same gradients bitwise, and they reach
    the router, the experts and (Qwen2-MoE) the shared expert and its gate."""
    model = models[case]
    ids, mask = tc.right_padded(SEQS)
    grads = tc.grads_twice_bitwise(ha.token_logprobs, model, ids, mask, 0.7)
    must = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    if case[0] == "qwen2_moe":
        must += ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert_gate.weight"]
    for layer in range(model.config.num_hidden_layers):
        for n in must:
            g = grads[f"model.layers.{layer}.{n}"]
            assert g.float().abs().sum() > 0, f"no gradient reaches layer {layer} {n}"


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_close_to_stock_transformers(models, ckpts, case):
    """Same experts as stock transformers for (almost) every token and layer, and log-probs
    within :data:`TOL`; and the control: stock transformers is not batch invariant here (a
    sequence alone vs inside the padded batch) or not bitwise the patched model."""
    model = models[case]
    stock = tc.load_hf(ckpts[case], case[1], patch=False)
    ids, mask = tc.right_padded(SEQS)
    r_stock, l_stock = _routes(stock, ids, mask)
    r_ours, l_ours = _routes(model, ids, mask)
    real = mask.bool().reshape(-1)
    b, t = ids.shape
    assert len(r_stock) == len(r_ours) == model.config.num_hidden_layers
    flipped = torch.zeros(b * t, dtype=torch.bool)
    for layer, (x, y) in enumerate(zip(r_stock, r_ours)):
        same = (x.sort(-1).values == y.sort(-1).values).all(-1)
        share = same[real].float().mean().item()
        assert share >= ROUTING_AGREEMENT, f"layer {layer}: experts agree on {share:.3f} of tokens"
        flipped |= ~same & real
    after_flip = torch.cumsum(flipped.view(b, t).long(), 1) > 0
    assert l_stock.abs().max() < LOGIT_BOUND
    # the patched logits (model dtype) through the same log-softmax as stock's: bitwise what
    # token_logprobs gives up to that last fp32 step (test_hf.py checks linear_logp == logits)
    lp, ref = (
        torch.log_softmax(lg.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        for lg in (l_ours, l_stock)
    )
    keep = (mask[:, 1:] & mask[:, :-1]).bool() & ~after_flip[:, :-1]
    assert keep.sum() >= 0.8 * (mask[:, 1:] & mask[:, :-1]).sum()
    err = (lp - ref)[keep].abs()
    tol = TOL[case[1]]
    assert err.max() <= tol, f"max {err.max():.3g} mean {err.mean():.3g} > {tol} vs stock"

    # control (stock is cheap: all five sequences): stock transformers is not batch invariant
    # here, or at least not bitwise the patched model, so the bitwise checks above can fail
    differs = int((l_ours != l_stock)[mask.bool()].sum())
    mism = tc.alone_vs_batch_mismatches(stock, tc.sequences())
    assert mism > 0 or differs > 0, "stock transformers is batch invariant and equals rl_engine"


def test_patch_idempotent_unpatch_and_router_logits(ckpts):
    """The report names the MoE modules; a second patch patches nothing; HF's router logits
    (``output_router_logits``) are the patched router's, with the aux loss differentiable to
    the router; unpatching restores stock transformers bitwise."""
    model = tc.load_hf(ckpts[("qwen2_moe", "float32", False)], "float32", patch=False)
    ids = torch.randint(0, tc.VOCAB, (2, 7))
    with torch.no_grad():
        stock = model(ids).logits
    report = ha.patch_model(model)
    names = set(report["patched"])
    for n in ("mlp", "mlp.gate", "mlp.experts", "mlp.shared_expert", "mlp.shared_expert_gate"):
        assert f"model.layers.1.{n}" in names, n
    assert set(report["left_alone"]) == {"model.embed_tokens", "model.rotary_emb"}
    block = model.model.layers[0].mlp
    assert block.forward.__wrapped__.__func__ is type(block).forward
    again = ha.patch_model(model)
    assert again["patched"] == [] and set(again["already"]) == names

    seen = []
    hook = block.gate.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    model.train()
    try:
        out = model(ids, output_router_logits=True)
        assert len(out.router_logits) == model.config.num_hidden_layers
        want = ops.det_gemm(seen[0], block.gate.weight.t())
        assert_bitwise(out.router_logits[0], want, "router_logits of layer 0")
        assert out.router_logits[0].shape == (ids.numel(), model.config.num_experts)
        out.aux_loss.backward()
        assert block.gate.weight.grad.abs().sum() > 0
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
        model.eval()
    ha.unpatch_model(model)
    assert "forward" not in block.__dict__ and "forward" not in block.gate.__dict__
    with torch.no_grad():
        assert_bitwise(model(ids).logits, stock, "unpatched model == stock")


def test_deepcopy_reference_model(ckpts):
    """TRL-style reference policy (``copy.deepcopy``): after an in-place update of the policy,
    the copy still computes with the old weights (bitwise a fresh patched model's log-probs)
    and every copied forward holds the copy's module."""
    path = ckpts[("qwen3_moe", "bfloat16", False)]
    policy = tc.load_hf(path, "bfloat16")
    reference = copy.deepcopy(policy)
    assert ha.is_patched(reference)
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for p in policy.parameters():
            p.add_((1e-2 * torch.randn(p.shape, generator=g)).to(p.dtype))
    ids, mask = tc.right_padded(SEQS)
    lp_ref = _lp(reference, ids, mask)
    assert_bitwise(lp_ref, _lp(tc.load_hf(path, "bfloat16"), ids, mask), "copy vs fresh")
    assert not torch.equal(lp_ref, _lp(policy, ids, mask)), "the copy followed the update"
    for mod in reference.modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None:
            assert fwd.module is mod, "a copied forward still points at the original module"


def test_dense_layers_in_moe_models(tmp_path):
    """``mlp_only_layers`` (Qwen3-MoE) and ``decoder_sparse_step`` (Qwen2-MoE) make some
    layers dense ``*MLP``s: patched as dense MLPs, and the model stays batch invariant."""
    for arch, kw in (
        ("qwen3_moe", {"mlp_only_layers": [0]}),
        ("qwen2_moe", {"decoder_sparse_step": 2}),
    ):
        model = tc.load_hf(_make(tmp_path / arch, arch, **kw), "float32")
        layers = model.model.layers
        assert type(layers[0].mlp).__name__.endswith("MLP"), arch
        assert type(layers[1].mlp).__name__.endswith("SparseMoeBlock"), arch
        assert isinstance(layers[0].mlp.forward, hp._MLPForward)
        assert isinstance(layers[1].mlp.forward, hp._SparseMoeForward)
        fn = functools.partial(_lp, model)
        tc.assert_lists_bitwise(tc.micro_batched(fn, SEQS, 1), tc.micro_batched(fn, SEQS, 3), arch)


def test_experts_module_called_directly(models):
    """The ``*Experts`` module's own (patched) forward gives the sparse block's output."""
    model = models[("qwen3_moe", "float32", False)]
    block = model.model.layers[0].mlp
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, w, ids = block.gate(x)
        assert w.dtype == torch.float32 and ids.shape == (9, 2)
        assert_bitwise(block.experts(x, ids, w), block(x[None])[0], "experts() vs the block")


def test_generate_matches_teacher_forcing(models):
    """Greedy ``generate`` (KV cache) log-probs == teacher-forced ``token_logprobs`` bitwise."""
    model = models[("qwen2_moe", "bfloat16", False)]
    prompts = torch.randint(3, tc.VOCAB, (3, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    seq, rollout = tc.greedy_rollout(model, prompts * mask, mask, 4)
    full = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], 1)
    tf = _lp(model, seq, full)
    assert_bitwise(tf[:, 5:], rollout, "generate vs teacher forcing")


def test_unsupported_moe_configs(ckpts, tmp_path, monkeypatch):
    jitter = _make(tmp_path / "jitter", "mixtral", router_jitter_noise=0.1)
    with pytest.raises(ha.UnsupportedModelError, match="router_jitter_noise=0.1"):
        ha.patch_model(tc.load_hf(jitter, "float32", patch=False))
    model = tc.load_hf(ckpts[("qwen3_moe", "float32", False)], "float32", patch=False)
    model.config.capacity_factor = 1.25
    with pytest.raises(ha.UnsupportedModelError, match="capacity_factor=1.25.*token dropping"):
        ha.patch_model(model)
    del model.config.capacity_factor
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(ha.UnsupportedModelError, match="expert biases"):
        ha.patch_model(model)
    model.model.layers[1].mlp.experts.has_bias = False
    ha.patch_model(model)
    # with the TP-invariant reduction on, the experts run its grouped form (the bits of a
    # rollout whose experts are TP-sharded); off, the plain one
    ids = torch.randint(0, tc.VOCAB, (1, 5))
    calls = []
    real = hp.ops.moe_experts
    monkeypatch.setattr(hp.ops, "moe_experts",
                        lambda *a, **k: calls.append(k.get("groups")) or real(*a, **k))  # fmt: skip
    plain = ha.token_logprobs(model, ids)
    assert calls and set(calls) == {None}, calls
    calls.clear()
    monkeypatch.setattr(hp.tpm, "groups_for", lambda tp: 8)
    grouped = ha.token_logprobs(model, ids)
    assert calls and set(calls) == {8}, "the experts ran through moe_experts(groups=8)"
    assert grouped.shape == plain.shape
    with pytest.raises(ha.UnsupportedModelError, match="mixtral"):
        ha.patch_model(
            transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
            )
        )


# the routing rule each family must get (moe_topk keyword arguments), written out here
RULE = {
    "qwen3_moe": lambda cfg: {"scoring": "softmax", "renormalize": cfg.norm_topk_prob},
    "mixtral": lambda cfg: {"scoring": "topk_softmax", "renormalize": False},
    "qwen2_moe": lambda cfg: {"scoring": "softmax", "renormalize": cfg.norm_topk_prob},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_block_is_the_ops_composition(models, arch):
    """The patched sparse block is bitwise ``moe_router`` (the family's rule) ->
    ``moe_experts`` on the experts' own parameters -> ``moe_combine`` (Qwen2-MoE: the shared
    expert and ``shared_expert_gate`` logits joining inside it); the stock block is not."""
    model = models[(arch, "bfloat16", False)]
    block = model.model.layers[1].mlp
    cfg = model.config
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 11, cfg.hidden_size, generator=g).to(torch.bfloat16)
    x2 = x[0]
    with torch.no_grad():
        w, ids, _ = ops.moe_router(
            x2, block.gate.weight, cfg.num_experts_per_tok, **RULE[arch](cfg)
        )
        y = ops.moe_experts(x2, ids, block.experts.gate_up_proj, block.experts.down_proj)
        shared = gate = None
        if arch == "qwen2_moe":
            gu = ops.det_gemm_cat(
                x2, [block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight]
            )
            shared = ops.det_gemm(ops.silu_and_mul(gu), block.shared_expert.down_proj.weight.t())
            gate = ops.det_gemm(x2, block.shared_expert_gate.weight.t())
        want = ops.moe_combine(y, w, shared=shared, shared_gate=gate)
        assert_bitwise(block(x)[0], want, f"{arch} block vs ops")
        stock = [block, block.gate, block.experts]
        stock += [m for m in block.modules() if m not in stock]
        saved = {m: m.__dict__.pop("forward") for m in stock if "forward" in m.__dict__}
        try:
            assert not torch.equal(block(x)[0], want), "stock block == rl_engine (control)"
        finally:
            for m, f in saved.items():
                m.forward = f


def test_transposed_expert_layout(ckpts):
    """An experts class that stores ``[E, H, 2I]`` / ``[E, I, H]`` (``is_transposed``) gets
    transposed views: the same log-probs bitwise, and the gradients land in its parameters."""
    path = ckpts[("mixtral", "float32", False)]
    ids, mask = tc.right_padded(SEQS)
    ref = _lp(tc.load_hf(path, "float32"), ids, mask)
    model = tc.load_hf(path, "float32", patch=False)
    for layer in model.model.layers:
        ex = layer.mlp.experts
        ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.detach().transpose(1, 2).contiguous())
        ex.down_proj = torch.nn.Parameter(ex.down_proj.detach().transpose(1, 2).contiguous())
        ex.is_transposed = True
    ha.patch_model(model)
    assert_bitwise(_lp(model, ids, mask), ref, "transposed layout")
    ha.token_logprobs(model, ids, 1.0, attention_mask=mask).sum().backward()
    ex = model.model.layers[0].mlp.experts
    assert (
        ex.gate_up_proj.grad.shape == ex.gate_up_proj.shape and ex.gate_up_proj.grad.abs().sum() > 0
    )


def test_mixtral_sliding_window_refused(tmp_path):
    """transformers' Mixtral applies ``sliding_window`` whenever it is set (no
    ``use_sliding_window`` switch): the patched full-causal attention would silently differ
    from the model past the window, so patching refuses, naming the field."""
    path = _make(tmp_path / "sw", "mixtral", sliding_window=8)
    with pytest.raises(ha.UnsupportedModelError, match="mixtral sliding_window=8"):
        ha.patch_model(tc.load_hf(path, "float32", patch=False))
