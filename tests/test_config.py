"""``rl_engine.config``: the one reader of ``RL_ENGINE_*``, and its setters for child processes."""

from __future__ import annotations

import os

import pytest

from rl_engine import config


def test_override_env_sets_rereads_and_restores(monkeypatch):
    monkeypatch.setenv("RL_ENGINE_TP_GROUPS", "0")
    monkeypatch.delenv("RL_ENGINE_FUZZ_LOCK", raising=False)
    assert config.reload().tp_groups == 0
    with config.override_env({"RL_ENGINE_TP_GROUPS": "8", "RL_ENGINE_FUZZ_LOCK": "/tmp/x"}) as s:
        assert s.tp_groups == 8 and s.fuzz_lock == "/tmp/x"
        assert config.settings() is s
        assert os.environ["RL_ENGINE_TP_GROUPS"] == "8"  # what a spawned process inherits
    assert config.settings().tp_groups == 0 and config.settings().fuzz_lock is None
    assert os.environ["RL_ENGINE_TP_GROUPS"] == "0" and "RL_ENGINE_FUZZ_LOCK" not in os.environ
    with config.override_env({"RL_ENGINE_TP_GROUPS": ""}):  # "" unsets
        assert "RL_ENGINE_TP_GROUPS" not in os.environ and config.settings().tp_groups is None
    assert config.settings().tp_groups == 0
    monkeypatch.setenv("RL_ENGINE_FUZZ_LOCK", "")  # set but empty: restored as it was
    with config.override_env({"RL_ENGINE_FUZZ_LOCK": "/tmp/y"}):
        assert config.settings().fuzz_lock == "/tmp/y"
    assert os.environ["RL_ENGINE_FUZZ_LOCK"] == "" and config.settings().fuzz_lock is None


def test_set_env_takes_only_its_own_variables():
    with pytest.raises(ValueError, match="not an RL_ENGINE_"):
        config.set_env({"CUDA_VISIBLE_DEVICES": ""})
