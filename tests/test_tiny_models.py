"""``rl_engine.testing.tiny_models``: config overrides reach the written checkpoint."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402


def test_rope_parameters_override_is_kept(tmp_path):
    """A ``rope_parameters`` override (RoPE scaling) is written as given, ``rope_theta``
    filling in when it names none; it was replaced by the default RoPE."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    path = make_tiny_model(tmp_path / "m", "llama", rope_parameters=scaling, rope_theta=5e5,
                           num_hidden_layers=1)  # fmt: skip
    with open(os.path.join(path, "config.json")) as f:
        rope = json.load(f)["rope_parameters"]
    assert rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, rope
