"""Layer-wise localisation: finds a one-ulp perturbation at its sub-block, finds nothing between
rl_engine's two trainers, and the full-vocabulary KL against a float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rl_engine.audit import localize as lz  # noqa: E402
from rl_engine.rl.engines import load_trainer  # noqa: E402
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
