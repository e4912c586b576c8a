"""Layer-wise localisation: finds a one-ulp perturbation at its sub-block, finds nothing between
rl_engine's two trainers, and the full-vocabulary KL against a float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rl_engine.audit import localize as lz  # noqa: E402
from rl_engine.engines import load_trainer  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

IDS = [3, 17, 250, 9, 77, 401, 5, 123, 64, 2, 311, 8]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("loc") / "qwen2", "qwen2", "bfloat16", True, seed=3
    )


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_trainer("hf", "rl_engine", str(ckpt), dtype=torch.bfloat16, device="cpu")


def test_points_in_compute_order(hf):
    cap = lz.capture_hf(hf, IDS)
    names = list(cap)
    n_layers = len(hf.model.layers)
    assert names[0] == "embed" and names[-2:] == ["final_norm", "logits"]
    assert len(names) == 3 + 4 * n_layers
    for name, t in cap.items():
        assert t.shape[0] == len(IDS) and t.dtype == torch.float32, name


def test_one_ulp_perturbation_is_found_at_its_sub_block(hf):
    other = copy.deepcopy(hf)
    w = other.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():  # one ulp on one weight: only layer 1's MLP computes anything new
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf"), dtype=w.dtype))
    res = lz.compare_captures(lz.capture_hf(hf, IDS), lz.capture_hf(other, IDS))
    assert res["first_divergence"] == "L1.mlp"
    before = [p for p in res["points"]][: [p["point"] for p in res["points"]].index("L1.mlp")]
    assert all(p["bitwise_equal"] for p in before)
    assert "L1" in lz.layer_table(res)


def test_same_model_and_the_two_rl_engine_trainers_agree(hf, ckpt):
    a = lz.capture_hf(hf, IDS)
    res = lz.compare_captures(a, lz.capture_hf(hf, IDS))
    assert res["first_divergence"] is None and res["kl_full_max"] == 0.0
    mg = load_trainer("megatron", "rl_engine", str(ckpt), dtype=torch.bfloat16, device="cpu")
    res = lz.compare_captures(a, lz.capture_megatron(mg, IDS))
    assert res["first_divergence"] is None, lz.layer_table(res)


def test_stock_hf_vs_rl_engine_diverges(hf, ckpt):
    stock = load_trainer("hf", "stock", str(ckpt), dtype=torch.bfloat16, device="cpu")
    res = lz.compare_captures(lz.capture_hf(hf, IDS), lz.capture_hf(stock, IDS))
    assert res["first_divergence"] is not None
    assert res["kl_full_max"] > 0


def test_full_vocab_kl_vs_float64():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 33, generator=g), torch.randn(5, 33, generator=g)
    got = lz.full_vocab_kl(a, b, 0.7)
    p, q = torch.softmax(a.double() / 0.7, -1), torch.softmax(b.double() / 0.7, -1)
    want = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    assert float(lz.full_vocab_kl(a, a, 1.0).max()) == 0.0


# ----------------------------------------------------------------------- mixture of experts
@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("loc_moe") / "qwen3_moe", "qwen3_moe", "bfloat16", seed=3,
        hidden_size=64, moe_intermediate_size=32, num_attention_heads=2, head_dim=32,
    )  # fmt: skip


def _routing(a, b):
    return lz.routing_agreement(a, b, top_k=2, scoring="softmax", renormalize=True)


def test_moe_router_points_and_full_agreement_between_rl_engine_trainers(moe_ckpt):
    hf = load_trainer("hf", "rl_engine", str(moe_ckpt), dtype=torch.bfloat16, device="cpu")
    mg = load_trainer("megatron", "rl_engine", str(moe_ckpt), dtype=torch.bfloat16, device="cpu")
    a, b = lz.capture_hf(hf, IDS), lz.capture_megatron(mg, IDS)
    n_layers = len(hf.model.layers)
    assert [f"L{i}.router" for i in range(n_layers)] == [n for n in a if n.endswith(".router")]
    assert a["L0.router"].shape == (len(IDS), 8)  # the router logits [T, E]
    res = lz.compare_captures(a, b)
    assert res["first_divergence"] is None, lz.layer_table(res)
    r = _routing(a, b)
    assert r["layers"] == {f"L{i}": 1.0 for i in range(n_layers)} and r["mean"] == 1.0
    assert all(r["logits_bitwise"].values()) and r["tokens"] == len(IDS)
    assert "router" in lz.layer_table(res)


def test_moe_swapped_router_rows_show_as_routing_disagreement(moe_ckpt):
    hf = load_trainer("hf", "rl_engine", str(moe_ckpt), dtype=torch.bfloat16, device="cpu")
    other = copy.deepcopy(hf)
    w = other.model.layers[1].mlp.gate.weight
    with torch.no_grad():  # experts 0 and 1 trade their router rows in layer 1
        w[[0, 1]] = w[[1, 0]].clone()
    a, b = lz.capture_hf(hf, IDS), lz.capture_hf(other, IDS)
    res = lz.compare_captures(a, b)
    assert res["first_divergence"] == "L1.router"
    r = _routing(a, b)
    assert r["layers"]["L0"] == 1.0 and r["layers"]["L1"] < 1.0
    assert not r["logits_bitwise"]["L1"]


def test_moe_stock_megatron_router_is_captured(moe_ckpt):
    """Megatron's own TopKRouter returns its top-k probabilities over [T, E]: the hook fires
    and the routing agreement is computed from them (a fraction of the tokens)."""
    hf = load_trainer("hf", "rl_engine", str(moe_ckpt), dtype=torch.bfloat16, device="cpu")
    stock = load_trainer("megatron", "stock", str(moe_ckpt), dtype=torch.bfloat16, device="cpu")
    a, b = lz.capture_hf(hf, IDS), lz.capture_megatron(stock, IDS)
    r = _routing(a, b)
    assert set(r["layers"]) == {"L0", "L1"}
    assert all(0.0 <= v <= 1.0 for v in r["layers"].values())


def test_vllm_mixtral_layers_hook_their_block_sparse_moe():
    """vLLM's Mixtral decoder layer holds its MoE block as ``block_sparse_moe`` (no ``mlp``):
    the hook points are its router (``gate``) and the block, as for the other families."""
    mod = torch.nn.Module

    def layer():
        lay = mod()
        lay.input_layernorm, lay.self_attn, lay.post_attention_layernorm = mod(), mod(), mod()
        lay.block_sparse_moe = mod()
        lay.block_sparse_moe.gate, lay.block_sparse_moe.experts = mod(), mod()
        return lay

    model = mod()
    model.model = mod()
    model.model.embed_tokens, model.model.norm = mod(), mod()
    model.model.layers = torch.nn.ModuleList([layer(), layer()])
    pts = dict(lz.hook_points(model, "vllm"))
    for i, lay in enumerate(model.model.layers):
        assert pts[f"L{i}.router"] is lay.block_sparse_moe.gate
        assert pts[f"L{i}.mlp"] is lay.block_sparse_moe
    del model.model.layers[1].block_sparse_moe
    with pytest.raises(AttributeError, match="neither an 'mlp' nor a 'block_sparse_moe'"):
        lz.hook_points(model, "vllm")
