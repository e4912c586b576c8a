"""The cached Triton launch path (``rl_engine.ops._triton.Launcher``).

CPU: what the cache key distinguishes. GPU: a kernel launched through the cache with pointers of
either alignment and integers Triton specializes on gives the results of Triton's own launch
path, and the check mode (``RL_ENGINE_CHECK_LAUNCH=1``, on for the whole GPU test run) raises
when a key is too coarse.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import config
from rl_engine.ops import _triton

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_arg_spec_separates_what_triton_specializes_on():
    spec = _triton._arg_spec
    # integers: 1 (and -1 / 0) by value; otherwise divisibility by 16 and width
    assert len({spec(v) for v in (1, 0, -1, 2, 16)}) == 5
    assert spec(32) == spec(4096) and spec(3) == spec(4097)
    assert spec(16) != spec(2**31 + 16) != spec(2**63 + 16)
    assert spec(True) != spec(1) and spec(False) != spec(0)
    assert spec(None) is None and spec(0.5) == spec(2.0)
    # tensors: dtype and 16-byte alignment of the data pointer
    x = torch.zeros(64)
    assert spec(x) == spec(x[4:]) != spec(x[1:])
    assert spec(x) != spec(x.double())


def test_cpu_tensors_take_the_interpreter():
    kern = _toy_kernel()
    assert not isinstance(_triton.launcher(kern, torch.device("cpu")), _triton.Launcher)


def _toy_kernel():
    @triton.jit
    def _scaled_copy(x_ptr, out_ptr, n, stride, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs * stride, mask=mask)
        tl.store(out_ptr + offs, v * scale, mask=mask)

    return _scaled_copy


@pytest.fixture
def check_mode(monkeypatch):
    monkeypatch.setenv("RL_ENGINE_CHECK_LAUNCH", "1")
    config.reload()
    yield
    monkeypatch.undo()
    config.reload()


@gpu
@pytest.mark.parametrize("check", [False, True])
def test_gpu_cached_launch_matches_triton(check, monkeypatch):
    if check:
        monkeypatch.setenv("RL_ENGINE_CHECK_LAUNCH", "1")
    else:
        monkeypatch.delenv("RL_ENGINE_CHECK_LAUNCH", raising=False)
    config.reload()
    try:
        kern = _toy_kernel()
        lau = _triton.launcher(kern, torch.device("cuda"))
        base = torch.randn(4096 + 64, device="cuda")
        cases = [  # (offset, n, stride): aligned / misaligned pointers, n and stride 1 / 16 / odd
            (0, 4096, 1),
            (1, 4096, 1),
            (0, 1, 1),
            (0, 1000, 2),
            (3, 999, 3),
            (0, 256, 16),
        ]
        for _ in range(2):  # second round: every launch is a cache hit
            for off, n, stride in cases:
                x = base[off:]
                out = torch.empty(n, device="cuda")
                lau[(_triton.cdiv(n, 256),)](x, out, n, stride, 0.5, BLOCK=256, num_warps=4)
                want = torch.empty(n, device="cuda")
                kern[(_triton.cdiv(n, 256),)](x, want, n, stride, 0.5, BLOCK=256, num_warps=4)
                assert torch.equal(out, want), (off, n, stride)
                assert torch.equal(out, x[: n * stride : stride] * 0.5), (off, n, stride)
        assert len(lau._kernels) == len(cases)  # each case differs in a specialization
    finally:
        monkeypatch.undo()
        config.reload()


@gpu
def test_gpu_check_mode_catches_a_coarse_key(check_mode, monkeypatch):
    """A key that misses the pointer alignment would launch the aligned kernel on a misaligned
    pointer; the check mode raises instead."""
    kern = _toy_kernel()
    lau = _triton.Launcher(kern)
    monkeypatch.setattr(_triton, "_arg_spec", lambda v: 0)  # a key that distinguishes nothing
    base = torch.randn(1024 + 64, device="cuda")
    out = torch.empty(1024, device="cuda")
    lau[(4,)](base, out, 1024, 1, 1.0, BLOCK=256, num_warps=4)
    with pytest.raises(RuntimeError, match="launch cache"):
        lau[(4,)](base[1:], out, 1024, 1, 1.0, BLOCK=256, num_warps=4)


@gpu
def test_gpu_launch_leaving_a_defaulted_parameter_is_cached(check_mode):
    """A call that leaves a parameter to its default is cached like any other (it went through
    Triton's binding on every call before: tens of microseconds of host time per launch); the
    check mode (on) asks Triton on every call and raises if the cache picked another kernel."""

    @triton.jit
    def _copy_maybe_twice(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n)
        if TWICE:
            v = v * 2.0
        tl.store(out_ptr + offs, v, mask=offs < n)

    lau = _triton.Launcher(_copy_maybe_twice)
    x = torch.randn(1000, device="cuda")
    for twice in (None, None, True, True):
        out = torch.empty_like(x)
        kw = {} if twice is None else {"TWICE": twice}
        used = lau.launch((4,), (x, out, 1000), dict(BLOCK=256, num_warps=4, **kw))
        assert used is not None, "the launch was not cached"
        assert torch.equal(out, x * 2.0 if twice else x)
    assert len(lau._kernels) == 2 and all(e is not None for e in lau._kernels.values())
    step = _triton.Prepared(lau, (4,), (1000,), dict(BLOCK=256, num_warps=4))
    out = torch.empty_like(x)
    step(x, out)
    step(x, out)  # the prepared path, with the default taken from the kernel
    assert step._ck is not None and torch.equal(out, x)
