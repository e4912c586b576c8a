"""``vllm_tp_check``'s engine arguments: a ``--variant``'s ``LLM`` arguments replace the
harness's own (a variant ``ep2:enable_expert_parallel=True`` once failed with "got multiple
values for keyword argument" on 2 x H100). No engine starts: ``vllm.LLM`` is replaced."""

from __future__ import annotations

import json
import sys
import types

from rl_engine.harness import vllm_tp_check as vt


class _Out:
    def __init__(self, token):
        self.outputs = [types.SimpleNamespace(token_ids=[token],
                                              logprobs=[{token: types.SimpleNamespace(logprob=-1.5)}])]  # fmt: skip


def test_variant_engine_arguments_win(monkeypatch, tmp_path):
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def generate(self, prompts, params):
            return [_Out(7) for _ in prompts]

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    variant = vt.Variant.parse("ep2:enable_expert_parallel=True,max_num_seqs=4")
    out = tmp_path / "r.json"
    vt._rollout("m", 2, str(out), "float32", ep=False, extra=variant.engine)
    assert seen["enable_expert_parallel"] is True and seen["max_num_seqs"] == 4
    assert seen["tensor_parallel_size"] == 2 and seen["model"] == "m"
    rows = json.loads(out.read_text())
    assert rows[0] == {"tokens": [7], "logprobs": [-1.5]}
