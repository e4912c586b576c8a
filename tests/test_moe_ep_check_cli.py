"""``python -m rl_engine.harness.moe_ep_check``: the EP slot-sum check as a command (it ran
nothing before it had one), and its refusal of a degree that does not divide the experts."""

from __future__ import annotations

import pytest

from rl_engine.harness import moe_ep_check


def test_command_runs_the_check_and_reports(capsys):
    assert moe_ep_check.main(["--ep", "2", "--device", "cpu"]) == 0
    assert "EP 2 vs EP 1: bitwise equal" in capsys.readouterr().out


@pytest.mark.parametrize("ep", ["3", "0", "2,x"])
def test_command_refuses_bad_degrees(ep, capsys):
    with pytest.raises(SystemExit) as e:
        moe_ep_check.main(["--ep", ep])
    assert e.value.code == 2
    assert "--ep" in capsys.readouterr().err


def test_run_refuses_a_degree_that_does_not_divide_the_experts():
    with pytest.raises(ValueError, match="must divide the case's 8 experts"):
        moe_ep_check.run(3)
