"""The norms on DTensors (issue 23): sharded on rows or on the sequence dim over 2 gloo ranks,
forward and every gradient bitwise equal to the unsharded op; the row-wise results stay
sharded; the negative control (a Partial-style all-reduced weight gradient) differs."""

from __future__ import annotations

import pytest
import torch

from rl_engine.harness import dtensor_check
from rl_engine.ops import _dtensor, rms_norm

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built"
)


def test_sharded_norms_equal_unsharded_two_ranks():
    dtensor_check.run(2, "native")


def test_plain_tensors_do_not_touch_dtensor():
    x, w = torch.randn(5, 8), torch.ones(8)
    assert not _dtensor.any_dtensor(x, w, None, torch.nn.Parameter(w))
    assert torch.equal(rms_norm(x, w), rms_norm(x.clone(), w))


def test_sharded_norms_equal_unsharded_triton_interpreter():
    """The same with the Triton providers (the interpreter on the CPU: the first case, [70, 64]
    fp32 on rows, and the sequence-parallel style; CI time)."""
    from tests.conftest import interpreter_on

    if not interpreter_on():
        pytest.skip("the Triton providers on the CPU: TRITON_INTERPRET=1 (scripts/test.sh)")
    dtensor_check.run(2, "triton", cases=1)
