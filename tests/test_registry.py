"""KernelRegistry: resolution rules, no-fallback errors, modes, pins, provenance."""

from __future__ import annotations

import pytest
import torch

from rl_engine import (
    BackendUnavailableError,
    KernelRegistry,
    NoInvariantProviderError,
    UnknownOpError,
    config,
)
from rl_engine.registry import Provider


def test_default_cpu_resolves_native():
    op = KernelRegistry.get_op("det_gemm", device="cpu")
    assert op.provider.name == "native"
    assert op.op_type == "det_gemm"
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert op(a, b).shape == (3, 5)


def test_unknown_op_lists_known_ops():
    with pytest.raises(UnknownOpError) as e:
        KernelRegistry.get_op("no_such_op")
    msg = str(e.value)
    for name in ("det_gemm", "rms_norm", "logp", "grpo_loss", "attention"):
        assert name in msg


def test_unknown_op_is_not_another_op():
    # a bug seen elsewhere: asking for one op returned another
    with pytest.raises(UnknownOpError):
        KernelRegistry.get_op("det_gem")


def test_explicit_unavailable_backend_raises_with_reason():
    with pytest.raises(BackendUnavailableError) as e:
        KernelRegistry.get_op("det_gemm", device="cpu", backend="no_such_provider")
    assert "no_such_provider" in str(e.value)


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config.reload()
    with pytest.raises(BackendUnavailableError) as e:
        KernelRegistry.get_op("det_gemm", device="cpu", backend="triton")
    assert "triton" in str(e.value)


def test_strict_refuses_non_invariant_even_when_named():
    with pytest.raises(BackendUnavailableError, match="not batch invariant"):
        KernelRegistry.get_op("det_gemm", device="cpu", backend="stock")


def test_audit_mode_allows_and_records_stock():
    config.set_mode("audit")
    op = KernelRegistry.get_op("det_gemm", device="cpu", backend="stock")
    assert op.provider.name == "stock"
    rep = KernelRegistry.report()
    assert any(
        r["provider"] == "stock" and not r["invariant"] and r["mode"] == "audit" for r in rep
    )
    # default resolution still never picks a non-invariant provider
    assert KernelRegistry.get_op("det_gemm", device="cpu").provider.invariant


def test_pin_from_environment(monkeypatch):
    monkeypatch.setenv("RL_ENGINE_BACKEND_DET_GEMM", "no_such_provider")
    config.reload()
    with pytest.raises(BackendUnavailableError, match="configuration pin"):
        KernelRegistry.get_op("det_gemm", device="cpu")


def test_pin_of_an_unknown_op_is_refused(monkeypatch):
    # a misspelt op name (DETGEMM for DET_GEMM) must not be ignored without a word
    monkeypatch.setenv("RL_ENGINE_BACKEND_DETGEMM", "triton")
    config.reload()
    with pytest.raises(UnknownOpError, match="RL_ENGINE_BACKEND_DETGEMM.*known ops"):
        KernelRegistry.get_op("logp", device="cpu")


def test_bad_mode_in_environment(monkeypatch):
    monkeypatch.setenv("RL_ENGINE_MODE", "lenient")
    with pytest.raises(ValueError, match="RL_ENGINE_MODE"):
        config.reload()


def test_report_records_resolutions():
    KernelRegistry.get_op("det_gemm", device="cpu")
    KernelRegistry.get_op("det_gemm", device="cpu")
    rep = KernelRegistry.report()
    assert len(rep) == 1
    r = rep[0]
    assert (r["op"], r["device"], r["provider"]) == ("det_gemm", "cpu", "native")
    assert r["numerics"] and r["uses"] == 2


def test_resolution_is_sticky():
    first = KernelRegistry.get_op("det_gemm", device="cpu").provider
    second = KernelRegistry.get_op("det_gemm", device="cpu").provider
    assert first is second


def test_no_invariant_provider_lists_reasons():
    KernelRegistry._spec("det_gemm")  # make sure the op is registered
    with pytest.raises(NoInvariantProviderError) as e:
        KernelRegistry.get_op("det_gemm", device="meta")
    assert "det_gemm" in str(e.value) and "meta" in str(e.value) and "native" in str(e.value)


def test_provider_signature_is_enforced():
    def wrong(a, b):  # missing bias
        return a @ b

    with pytest.raises(TypeError, match="signature"):
        KernelRegistry.register_provider(
            Provider(
                op="det_gemm",
                name="bad",
                devices=("cpu",),
                dtypes=(torch.float32,),
                invariant=True,
                numerics="bad",
                fn=wrong,
            )
        )


def test_signature_of_binds_only_where_needed(monkeypatch):
    """``signature_of``: a positional call gets the omitted trailing defaults appended without
    binding (the hot path); a keyword call is bound as the spec binds it; a wrong call raises
    ``TypeError``; ``lead`` / ``replaces`` put tensors in front of (or in place of) the spec's."""
    import inspect

    from rl_engine.ops._common import signature_of

    def spec(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, residual: object = None):
        raise AssertionError("never called")

    @signature_of(spec)
    def fn(*args, knob: int = 0):
        return args, knob

    assert list(inspect.signature(fn).parameters) == ["x", "w", "eps", "residual", "knob"]
    binds = []
    real_bind = inspect.Signature.bind

    def spy(self, *args, **kwargs):
        binds.append(args)
        return real_bind(self, *args, **kwargs)

    monkeypatch.setattr(inspect.Signature, "bind", spy)
    assert fn(1, 2) == ((1, 2, 1e-6, None), 0)
    assert fn(1, 2, 3) == ((1, 2, 3, None), 0)
    assert fn(1, 2, 3, 4) == ((1, 2, 3, 4), 0)
    assert binds == []  # positional calls: no binding
    assert fn(1, w=2) == ((1, 2, 1e-6, None), 0)
    assert fn(1, 2, residual=4) == ((1, 2, 1e-6, 4), 0)
    assert fn(1, 2, knob=5) == ((1, 2, 1e-6, None), 5)
    assert len(binds) == 3
    for args, kwargs in [((1,), {}), ((1, 2, 3, 4, 5), {}), ((1, 2), {"bogus": 1})]:
        with pytest.raises(TypeError):
            fn(*args, **kwargs)

    @signature_of(spec, "grad", replaces=1)
    def bwd(*args):
        return args

    assert list(inspect.signature(bwd).parameters) == ["grad", "w", "eps", "residual"]
    assert bwd(7, 2) == (7, 2, 1e-6, None)

    @signature_of(spec, "grad")
    def with_lead(*args):
        return args

    assert list(inspect.signature(with_lead).parameters)[:2] == ["grad", "x"]
    assert with_lead(7, 1, 2) == (7, 1, 2, 1e-6, None)


def test_bad_device_argument():
    with pytest.raises(TypeError):
        KernelRegistry.get_op("det_gemm", device=3.5)
