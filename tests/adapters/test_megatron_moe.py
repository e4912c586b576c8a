"""megatron-core adapter, mixture of experts, on CPU: Qwen3-MoE, Mixtral and Qwen2-MoE (shared
expert with a sigmoid gate) built by ``from_pretrained`` with ``RLMoELayer`` (native providers,
real megatron-core 0.16.1, tiny random checkpoints: 8 experts, top-2).

* batch invariance: each sequence alone == in micro-batches of 2 and 5, packed, left padded;
* backward reaches the router and the experts and is bitwise deterministic;
* == a pure-ops reference forward of the Hugging Face checkpoint (embedding, rms_norm,
  det_gemm projections, rope, attention, moe_router / moe_experts / moe_combine, linear_logp);
* the control: megatron's own MoELayer (TopKRouter, SequentialMLP) on the same weights is close
  but not bitwise equal;
* expert parallelism: EP = 2 (two gloo processes, each with its own sequences) == EP = 1;
* refusals: token dropping, experts not dividing over EP, unsupported families / routers.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

import megatron_shim  # noqa: E402  (tests/adapters: CPU shim, documented there)
import trainer_cases as tc  # noqa: E402

from rl_engine import ops  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

# the CPU suite (reference providers, CPU tensors), on a CUDA machine too: CUDA is hidden from
# the module (megatron_shim.module_fixture(force_cpu=True))
pytestmark = pytest.mark.megatron

# (arch, dtype): every family; bf16 and fp32 (the EP check and the control use fp32, where a
# tiny model's sums are not exact in any order)
CASES = [("qwen3_moe", "bfloat16"), ("mixtral", "float32"), ("qwen2_moe", "bfloat16")]
IDS = [c[0] for c in CASES]
TEMP = 0.7


_shim = megatron_shim.module_fixture(force_cpu=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {c: make_tiny_model(root / f"{c[0]}-{c[1]}", c[0], c[1], seed=3) for c in CASES}
    out[("qwen2_moe", "float32")] = make_tiny_model(
        root / "qwen2_moe-float32", "qwen2_moe", "float32", seed=4
    )
    return out


@pytest.fixture(scope="module")
def models(ckpts):
    from rl_engine.adapters import megatron as ma

    return {c: ma.from_pretrained(ckpts[c]) for c in CASES}


# ----------------------------------------------------------------------------- the reference
def _hf_state(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(path, "model.safetensors"))


def reference_logprobs(path: str, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs [S - 1] of one sequence ``ids`` [S] from the checkpoint's tensors through
    rl_engine ops alone (the order of ops the rollout runs; per-expert HF weights stacked)."""
    from rl_engine.adapters.megatron.loader import moe_routing

    cfg, w = _hf_state(path)
    arch = cfg["model_type"]
    nq, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    route = moe_routing(cfg)
    s = ids.numel()
    cu = torch.tensor([0, s], dtype=torch.int32)
    pos = torch.arange(s)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = ops.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (
            ops.det_gemm(h, w[a + f"{n}_proj.weight"].t(), w.get(a + f"{n}_proj.bias"))
            for n in "qkv"
        )
        q, k, v = q.view(s, nq, d), k.view(s, ng, d), v.view(s, ng, d)
        if a + "q_norm.weight" in w:
            q = ops.rms_norm(q, w[a + "q_norm.weight"], eps)
            k = ops.rms_norm(k, w[a + "k_norm.weight"], eps)
        q, k = (ops.rope(t, pos, theta=theta, is_neox=True) for t in (q, k))
        o = ops.attention(q, k, v, cu, scale=d**-0.5, causal=True).reshape(s, nq * d)
        x = x + ops.det_gemm(o, w[a + "o_proj.weight"].t())
        h = ops.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        m = p + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        g, u, dn = (
            ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )
        n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
        w13 = torch.stack(
            [torch.cat([w[f"{m}experts.{e}.{g}.weight"], w[f"{m}experts.{e}.{u}.weight"]])
             for e in range(n_exp)]
        )  # fmt: skip
        w2 = torch.stack([w[f"{m}experts.{e}.{dn}.weight"] for e in range(n_exp)])
        weights, top, _ = ops.moe_router(h, w[m + "gate.weight"], cfg["num_experts_per_tok"],
                                         **route)  # fmt: skip
        y = ops.moe_experts(h, top, w13, w2)
        shared = gate = None
        if m + "shared_expert.gate_proj.weight" in w:
            se = m + "shared_expert."
            fc1 = torch.cat([w[se + "gate_proj.weight"], w[se + "up_proj.weight"]])
            act = ops.silu_and_mul(ops.det_gemm(h, fc1.t()))
            shared = ops.det_gemm(act, w[se + "down_proj.weight"].t())
            gate = ops.det_gemm(h, w[m + "shared_expert_gate.weight"].t())
        x = x + ops.moe_combine(y, weights, shared=shared, shared_gate=gate)
    h = ops.rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return ops.linear_logp(h[:-1], head, ids[1:], temperature)


# ------------------------------------------------------------------------------------ tests
def test_builds_rl_moe_layers(models):
    from rl_engine.adapters.megatron import RLMoELayer

    for (arch, _), model in models.items():
        layers = model.decoder.layers
        assert all(isinstance(layer.mlp, RLMoELayer) for layer in layers), arch
        mlp = layers[0].mlp
        assert tuple(mlp.experts.linear_fc1.weight.shape) == (8, 128, 128)
        assert tuple(mlp.experts.linear_fc2.weight.shape) == (8, 128, 64)
        assert mlp.experts.linear_fc1.weight.allreduce is False
        assert (mlp.shared_experts is not None) == (arch == "qwen2_moe")
        want = {"qwen3_moe": ("softmax", True), "mixtral": ("topk_softmax", False),
                "qwen2_moe": ("softmax", False)}[arch]  # fmt: skip
        assert (mlp.scoring, mlp.renormalize) == want


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_batch_invariance(models, case):
    """Each sequence alone == in micro-batches of 2 and 5, packed and left padded (bitwise)."""
    from rl_engine.adapters import megatron as ma

    tc.check_layouts(ma.token_logprobs, models[case], TEMP)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_equals_pure_ops_reference(models, ckpts, case):
    from rl_engine.adapters import megatron as ma

    for seq in tc.sequences()[:2]:
        with torch.no_grad():
            got = ma.token_logprobs(models[case], seq[None], TEMP)[0]
            want = reference_logprobs(ckpts[case], seq, TEMP)
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_reaches_router_and_experts_deterministic(models, case):
    from rl_engine.adapters import megatron as ma

    model = models[case]
    ids, mask = tc.right_padded(tc.sequences()[:3])

    def grads():
        model.zero_grad(set_to_none=True)
        lp = ma.token_logprobs(model, ids, TEMP, attention_mask=mask)
        (lp * torch.linspace(-1, 2, lp.shape[-1])).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    one, two = grads(), grads()
    model.zero_grad(set_to_none=True)
    assert one.keys() == two.keys()
    for part in ("mlp.router.weight", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2"):
        names = [n for n in one if part in n]
        assert len(names) == 2, (part, sorted(one))
        assert all(one[n].abs().sum() > 0 for n in names), part
    if case[0] == "qwen2_moe":
        assert one["decoder.layers.0.mlp.shared_experts.gate_weight"].abs().sum() > 0
    bad = [n for n in one if not torch.equal(one[n], two[n])]
    assert not bad, bad


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_control_stock_megatron_moe_differs(ckpts, tmp_path, arch):
    """Megatron's own MoELayer (TopKRouter, allgather dispatcher, SequentialMLP) with the same
    weights computes the same model (close) but not the same bits."""
    from rl_engine.adapters import megatron as ma

    path = ckpts.get((arch, "float32")) or make_tiny_model(tmp_path / arch, arch, "float32", seed=3)
    ours, stock = ma.from_pretrained(path), ma.stock_from_pretrained(path)
    assert type(stock.decoder.layers[0].mlp).__name__ == "MoELayer"
    x = torch.randn(33, 1, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours.decoder.layers[0].mlp(x)[0]
        b = stock.decoder.layers[0].mlp(x)[0]
    err = (a - b).abs().max().item()
    assert err < 1e-4, err
    assert not torch.equal(a, b), "stock megatron MoE happened to match rl_engine's bits"


def test_ep2_equals_ep1(ckpts, tmp_path):
    """EP = 2 in two gloo processes, each with its own half of the sequences: log-probs and the
    expert weight gradients (gathered over the ranks) == EP = 1's (this process), bitwise."""
    from rl_engine.adapters import megatron as ma
    from rl_engine.harness import ep_check

    path = ckpts[("qwen2_moe", "float32")]
    gpt = ma.from_pretrained(path)
    ids, cu = ep_check.batch(gpt.rl_engine_vocab_size, ep_check.LENGTHS)
    logp = ma.token_logprobs(gpt, ids, cu_seqlens=cu)
    (logp * torch.linspace(-1.0, 2.0, ids.numel() - 1)).sum().backward()
    grads = {n: p.grad for n, p in gpt.named_parameters() if ".mlp.experts." in n}
    base = [{"logp": logp.detach(), "grads": grads}]
    two = ep_check.run(path, 2, str(tmp_path / "ep2"), "float32")
    assert len(two[0]["grads"]) == 4 and two[0]["grads"][
        "decoder.layers.0.mlp.experts.linear_fc1.weight"
    ].shape == (4, 128, 128)
    assert ep_check.compare(base, two) == []
    # the comparison can fail: a perturbed expert gradient is caught
    two[1]["grads"]["decoder.layers.1.mlp.experts.linear_fc2.weight"][0, 0, 0] += 1.0
    assert ep_check.compare(base, two)


# ---------------------------------------------------------------------------------- refusals
def test_refuses_token_dropping():
    from rl_engine.adapters.megatron import RLMoELayer
    from rl_engine.ops.moe_experts import TokenDroppingError

    with pytest.raises(TokenDroppingError, match="moe_expert_capacity_factor=1.0"):
        RLMoELayer(tc.moe_config(moe_expert_capacity_factor=1.0))
    with pytest.raises(TokenDroppingError, match="pad_expert_input_to_capacity"):
        RLMoELayer(
            tc.moe_config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
        )


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(moe_router_load_balancing_type="aux_loss"), "auxiliary losses"),
        (dict(moe_router_score_function="sigmoid"), "sigmoid"),
        (dict(moe_router_topk_scaling_factor=2.0), "scaling_factor"),
        (dict(moe_router_dtype="fp32"), "moe_router_dtype"),
        (dict(moe_input_jitter_eps=0.1), "jitter"),
    ],
)
def test_refuses_unsupported_router_settings(kw, what):
    from rl_engine.adapters.megatron import RLMoELayer, UnsupportedNumericsError

    with pytest.raises(UnsupportedNumericsError, match=what):
        RLMoELayer(tc.moe_config(**kw))


def test_refuses_experts_not_dividing_over_ep(ckpts):
    from rl_engine.adapters.megatron import UnsupportedNumericsError
    from rl_engine.adapters.megatron.loader import ep_shard_state

    state = {"decoder.layers.0.mlp.experts.linear_fc1.weight": torch.zeros(8, 4, 2)}
    with pytest.raises(UnsupportedNumericsError, match="8 experts do not divide over "
                       "expert_model_parallel_size=3"):  # fmt: skip
        ep_shard_state(state, 3, 0)
    halves = ep_shard_state(state, 2, 1)
    assert halves["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape[0] == 4


def test_unsupported_family_names_the_supported_list(tmp_path):
    from rl_engine.adapters import megatron as ma

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ma.UnsupportedModelError, match="qwen3_moe.*mixtral.*qwen2_moe"):
        ma.from_pretrained(tmp_path)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_round_trip_and_fused_layout(ckpts, case):
    """HF -> Megatron -> HF gives the checkpoint's tensors back (exact); transformers 5's fused
    expert layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) loads to
    the same Megatron tensors as the per-expert one."""
    from rl_engine.adapters.megatron import hf_to_megatron_state, megatron_to_hf_state

    cfg, hf = _hf_state(ckpts[case])
    state = hf_to_megatron_state(hf, cfg, tied=False)
    back = megatron_to_hf_state(state, cfg, tied=False)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    fused = {}
    for k, v in hf.items():
        if ".experts." not in k:
            fused[k.replace(".block_sparse_moe.", ".mlp.")] = v
    for i in range(cfg["num_hidden_layers"]):
        m = f"model.layers.{i}."
        fused[m + "mlp.experts.gate_up_proj"] = state[
            f"decoder.layers.{i}.mlp.experts.linear_fc1.weight"
        ]
        fused[m + "mlp.experts.down_proj"] = state[
            f"decoder.layers.{i}.mlp.experts.linear_fc2.weight"
        ]
    again = hf_to_megatron_state(fused, cfg, tied=False)
    assert again.keys() == state.keys()
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_replace_modules_refuses_stock_moe_and_keeps_rl_moe(models, ckpts):
    """replace_modules does not half-convert megatron's MoELayer (refused, with the way out);
    on a from_pretrained MoE model it is a no-op for the MoE layers."""
    from rl_engine.adapters import megatron as ma

    stock = ma.stock_from_pretrained(ckpts[("qwen2_moe", "float32")])
    with pytest.raises(ma.UnsupportedNumericsError, match="MoELayer.*RLMoELayer"):
        ma.replace_modules(stock)
    report = ma.replace_modules(stock, strict=False)
    assert not any(".mlp." in n for n in report.replaced), report.replaced
    report = ma.replace_modules(models[CASES[0]])
    assert "decoder.layers.0.mlp" in report.already and not report.not_replaced


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_equals_hf_adapter_bitwise(models, ckpts, case):
    """The two trainers agree bit for bit on the same checkpoint: Megatron's RLMoELayer and the
    HF adapter's patched sparse block run the same router rule, experts and combine."""
    import transformers

    from rl_engine.adapters import hf as ha
    from rl_engine.adapters import megatron as ma

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpts[case], dtype=getattr(torch, case[1])
    )
    ha.patch_model(hf.eval())
    for seq in tc.sequences()[:3]:
        with torch.no_grad():
            a = ma.token_logprobs(models[case], seq[None], TEMP)
            b = ha.token_logprobs(hf, seq[None], TEMP)
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize(
    "arch, over",
    [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True}), ("qwen2_moe", {})],
    ids=["mixtral", "qwen3_moe-renormalised", "qwen2_moe"],
)
def test_top1_routing_loads_and_equals_reference(tmp_path, arch, over):
    """Top-1 routing (``num_experts_per_tok=1``): megatron-core's ``TransformerConfig`` demands
    ``moe_router_pre_softmax`` at top-1, which ``RLMoELayer`` does not read (it runs the
    family's rule: weight 1 for Mixtral / renormalised Qwen, the softmax probability
    otherwise). It builds and equals the pure-ops reference; the stock model refuses a rule its
    ``TopKRouter`` cannot express at top-1, naming the config field."""
    from rl_engine.adapters import megatron as ma

    path = make_tiny_model(tmp_path / arch, arch, "float32", seed=3, num_experts_per_tok=1,
                           **over)  # fmt: skip
    model = ma.from_pretrained(path)
    for seq in tc.sequences()[:2]:
        with torch.no_grad():
            got = ma.token_logprobs(model, seq[None], TEMP)[0]
        assert torch.equal(got, reference_logprobs(path, seq, TEMP))
    if arch == "qwen2_moe":  # softmax, not renormalised: megatron's pre-softmax router
        assert type(ma.stock_from_pretrained(path).decoder.layers[0].mlp).__name__ == "MoELayer"
    else:
        with pytest.raises(ma.UnsupportedNumericsError, match="num_experts_per_tok=1"):
            ma.stock_from_pretrained(path)
