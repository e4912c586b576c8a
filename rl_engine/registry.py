"""``KernelRegistry``: the single point where a kernel is chosen.

Keyed by device type (``cuda``, ``rocm``, ``cpu``) and op type. Each op has an ordered list of
providers; a provider declares its name, devices, dtypes, whether it is batch invariant, its
numerics family (equal ids promise bitwise-equal outputs) and an availability check.

Rules (see ``docs/registry.md``):

* An explicit ``backend=`` (or a pin from configuration) that cannot run raises
  :class:`BackendUnavailableError` with the reason. Nothing is substituted.
* Default resolution takes the first available *invariant* provider for the device. It never
  picks a non-invariant provider nor an ``opt_in`` one (a second family chosen by name), and once an op is resolved for a device in this process it stays
  resolved.
* No provider can run -> :class:`NoInvariantProviderError` naming the op, the device and each
  provider's reason. Unknown op -> :class:`UnknownOpError` listing the known ops.
* ``strict`` mode (default) refuses non-invariant providers even when asked for by name; ``audit``
  mode allows them and records every resolution.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine import config

__all__ = [
    "BackendUnavailableError",
    "KernelRegistry",
    "NoInvariantProviderError",
    "Op",
    "Provider",
    "RLEngineError",
    "UnknownOpError",
]


class RLEngineError(RuntimeError):
    """Base class of rl_engine's errors."""


class UnknownOpError(RLEngineError, KeyError):
    """An op type the registry does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(RLEngineError):
    """A provider asked for by name (argument or configuration pin) cannot run."""


class NoInvariantProviderError(RLEngineError):
    """No invariant provider of an op can run on the device."""


# Op types and the module that defines each (imported on first use).
_OP_MODULES: dict[str, str] = {
    "det_gemm": "rl_engine.ops.det_gemm",
    "det_gemm_tp": "rl_engine.ops.det_gemm.tp",
    "rms_norm": "rl_engine.ops.rms_norm",
    "poly_norm": "rl_engine.ops.poly_norm",
    "silu_and_mul": "rl_engine.ops.silu_and_mul",
    "rope": "rl_engine.ops.rope",
    "logp": "rl_engine.ops.logp",
    "entropy": "rl_engine.ops.entropy",
    "linear_logp": "rl_engine.ops.linear_logp",
    "ratio_kl": "rl_engine.ops.ratio_kl",
    "grpo_loss": "rl_engine.ops.grpo_loss",
    "attention": "rl_engine.ops.attention",
    "moe_router": "rl_engine.ops.moe_router",
    "moe_experts": "rl_engine.ops.moe_experts",
    "moe_experts_tp": "rl_engine.ops.moe_experts.tp",
    "moe_combine": "rl_engine.ops.moe_combine",
    "grouped_poly_norm": "rl_engine.ops.grouped_poly_norm",
}

AvailabilityCheck = Callable[..., "str | None"]


def _always(device: str, *, triton_interpret: bool) -> str | None:
    return None


@dataclass(frozen=True)
class Provider:
    """One implementation of an op.

    Attributes:
        op: op type, e.g. ``"det_gemm"``.
        name: provider name, equal to its file name (``native``, ``triton``, ``cuda``, ``stock``).
        devices: device types it runs on.
        dtypes: floating dtypes it accepts for its main input.
        invariant: whether it keeps the contracts of DESIGN.md section 1.
        numerics: family id; equal ids promise bitwise-equal outputs.
        fn: the forward implementation; its signature equals the reference's.
        version: bumped whenever the numerics change.
        available: ``(device, *, triton_interpret) -> reason or None``; reads no environment.
        extras: further implementations the op's autograd uses (e.g. ``"wgrad"``).
        opt_in: never chosen by default resolution, only by name (``backend=`` or a
            configuration pin such as ``RL_ENGINE_BACKEND_DET_GEMM=cuda``): a second invariant
            family of an op that both engines must select together.
    """

    op: str
    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    invariant: bool
    numerics: str
    fn: Callable[..., Any]
    version: str = "1"
    available: AvailabilityCheck = _always
    extras: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    opt_in: bool = False

    def why_not(self, device: str, *, triton_interpret: bool) -> str | None:
        """Why this provider cannot run on ``device`` (``None`` when it can)."""
        if device not in self.devices:
            return f"{self.name}: runs on {list(self.devices)}, not on {device!r}"
        try:
            reason = self.available(device, triton_interpret=triton_interpret)
        except Exception as exc:  # an availability check must not take the process down
            reason = f"availability check failed: {type(exc).__name__}: {exc}"
        return f"{self.name}: {reason}" if reason else None


@dataclass
class _OpSpec:
    op_type: str
    entry: Callable[..., Any]  # public entry: entry(*args, provider=name, **kwargs)
    reference: Callable[..., Any]
    providers: list[Provider] = field(default_factory=list)


class Op:
    """A resolved op: calling it runs the op through the chosen provider."""

    def __init__(self, spec: _OpSpec, provider: Provider, device: str) -> None:
        self._spec = spec
        self.provider = provider
        self.device = device
        self.__doc__ = spec.reference.__doc__

    @property
    def op_type(self) -> str:
        return self._spec.op_type

    @property
    def numerics(self) -> str:
        return self.provider.numerics

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._spec.entry(*args, provider=self.provider.name, **kwargs)

    def __repr__(self) -> str:
        p = self.provider
        return f"Op({self.op_type!r}, device={self.device!r}, provider={p.name!r}, numerics={p.numerics!r})"


def _signature_key(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _device_key(device: Any) -> str:
    if device is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    elif isinstance(device, torch.device):
        dev = device.type
    elif isinstance(device, str):
        dev = torch.device(device).type if device not in ("rocm",) else "rocm"
    else:
        raise TypeError(
            f"device must be None, a str or a torch.device, got {type(device).__name__}"
        )
    if dev == "cuda" and getattr(torch.version, "hip", None):
        dev = "rocm"
    return dev


class KernelRegistry:
    """Process-wide registry of ops and their providers (class-level; not instantiated)."""

    _lock = threading.RLock()
    _specs: dict[str, _OpSpec] = {}
    _resolved: dict[tuple[str, str], Provider] = {}
    _records: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    # (op, provider) -> provider calls that actually ran (bumped by the custom ops' bodies, which
    # run at execution: never traced by torch.compile, so a compiled graph that does not contain
    # an op leaves its count at 0)
    _executed: dict[tuple[str, str], int] = {}

    # ---------------------------------------------------------------- registration
    @classmethod
    def register_op(
        cls, op_type: str, *, entry: Callable[..., Any], reference: Callable[..., Any]
    ) -> None:
        """Declare an op: its public entry point and its reference (the spec)."""
        with cls._lock:
            if op_type in cls._specs:
                return  # idempotent: module re-import
            cls._specs[op_type] = _OpSpec(op_type, entry, reference)

    @classmethod
    def register_provider(cls, provider: Provider, *, first: bool = False) -> None:
        """Add a provider to its op's ordered list (at the end, or first).

        The provider's ``fn`` must have exactly the reference's signature.
        """
        with cls._lock:
            spec = cls._specs.get(provider.op)
            if spec is None:
                raise UnknownOpError(f"register the op {provider.op!r} before its providers")
            if _signature_key(provider.fn) != _signature_key(spec.reference):
                raise TypeError(
                    f"provider {provider.name!r} of {provider.op!r} has signature "
                    f"{inspect.signature(provider.fn)}, the reference has "
                    f"{inspect.signature(spec.reference)}"
                )
            spec.providers = [p for p in spec.providers if p.name != provider.name]
            if first:
                spec.providers.insert(0, provider)
            else:
                spec.providers.append(provider)

    # ---------------------------------------------------------------- lookup
    @classmethod
    def known_ops(cls) -> list[str]:
        return sorted(_OP_MODULES)

    @classmethod
    def _spec(cls, op_type: str) -> _OpSpec:
        if not isinstance(op_type, str) or op_type not in _OP_MODULES:
            raise UnknownOpError(f"unknown op {op_type!r}; known ops: {', '.join(cls.known_ops())}")
        if op_type not in cls._specs:
            importlib.import_module(_OP_MODULES[op_type])
        return cls._specs[op_type]

    @classmethod
    def providers(cls, op_type: str, device: Any = None) -> list[Provider]:
        """The providers of ``op_type`` in resolution order for ``device`` (all when ``None``)."""
        spec = cls._spec(op_type)
        if device is None:
            return list(spec.providers)
        dev = _device_key(device)
        ordered = [p for p in spec.providers if dev in p.devices]
        # On the CPU the reference comes first; elsewhere compiled providers come first.
        if dev == "cpu":
            ordered.sort(key=lambda p: p.name != "native")
        return ordered

    @classmethod
    def provider(cls, op_type: str, name: str) -> Provider:
        """The provider called ``name`` (no availability check: used by the custom ops, whose
        bodies run at execution, so this also counts executions: :meth:`executed`)."""
        for p in cls._spec(op_type).providers:
            if p.name == name:
                key = (op_type, name)
                cls._executed[key] = cls._executed.get(key, 0) + 1
                return p
        raise BackendUnavailableError(
            f"{op_type}: no provider named {name!r}; providers: "
            f"{[p.name for p in cls._spec(op_type).providers]}"
        )

    @classmethod
    def get_op(cls, op_type: str, device: Any = None, backend: str | None = None) -> Op:
        """Resolve ``op_type`` for ``device`` and return a callable :class:`Op`.

        Args:
            op_type: one of :meth:`known_ops`.
            device: ``None`` (CUDA when available, else CPU), a device type string or a device.
            backend: a provider name; it must be able to run, or this raises.

        Raises:
            UnknownOpError: ``op_type`` is not an op.
            BackendUnavailableError: the requested or pinned provider cannot run.
            NoInvariantProviderError: no invariant provider can run on the device.
        """
        spec = cls._spec(op_type)
        dev = _device_key(device)
        settings = config.settings()
        for name in settings.op_backends:  # a misspelt pin would otherwise be ignored
            if name not in _OP_MODULES:
                raise UnknownOpError(
                    f"RL_ENGINE_BACKEND_{name.upper()} pins {name!r}, which is no op; known "
                    f"ops: {', '.join(cls.known_ops())} (e.g. RL_ENGINE_BACKEND_DET_GEMM)"
                )
        interp = settings.triton_interpret
        with cls._lock:
            pin = backend if backend is not None else settings.pin_for(op_type)
            if pin is not None:
                source = "argument backend=" if backend is not None else "configuration pin "
                names = [p.name for p in spec.providers]
                match = [p for p in spec.providers if p.name == pin]
                if not match:
                    raise BackendUnavailableError(
                        f"{op_type}: {source}{pin!r} names no provider; providers: {names}"
                    )
                prov = match[0]
                reason = prov.why_not(dev, triton_interpret=interp)
                if reason is None and not prov.invariant and settings.mode == "strict":
                    reason = (
                        f"{prov.name}: not batch invariant; allowed only in audit mode "
                        "(RL_ENGINE_MODE=audit)"
                    )
                if reason is not None:
                    raise BackendUnavailableError(
                        f"{op_type} on {dev}: {source}{pin!r} cannot run: {reason}"
                    )
                cls._record(op_type, dev, prov, explicit=True, mode=settings.mode)
                return Op(spec, prov, dev)

            key = (op_type, dev)
            prov = cls._resolved.get(key)
            if prov is None:
                reasons = []
                for cand in cls.providers(op_type, dev):
                    reason = cand.why_not(dev, triton_interpret=interp)
                    if reason is None and not cand.invariant:
                        reason = f"{cand.name}: not batch invariant (never chosen by default)"
                    if reason is None and cand.opt_in:
                        reason = (
                            f"{cand.name}: opt-in only (RL_ENGINE_BACKEND_{op_type.upper()}="
                            f"{cand.name} or backend={cand.name!r})"
                        )
                    if reason is None:
                        prov = cand
                        break
                    reasons.append(reason)
                if prov is None:
                    for cand in spec.providers:
                        if dev not in cand.devices:
                            reasons.append(cand.why_not(dev, triton_interpret=interp) or "")
                    raise NoInvariantProviderError(
                        f"{op_type}: no invariant provider can run on {dev!r}; "
                        + "; ".join(r for r in reasons if r)
                    )
                cls._resolved[key] = prov
            cls._record(op_type, dev, prov, explicit=False, mode=settings.mode)
            return Op(spec, prov, dev)

    @classmethod
    def _record(cls, op_type: str, dev: str, prov: Provider, *, explicit: bool, mode: str) -> None:
        key = (op_type, dev, prov.name, explicit)
        rec = cls._records.get(key)
        if rec is None:
            rec = cls._records[key] = {
                "op": op_type,
                "device": dev,
                "provider": prov.name,
                "numerics": prov.numerics,
                "version": prov.version,
                "invariant": prov.invariant,
                "explicit": explicit,
                "mode": mode,
                "uses": 0,
            }
        rec["uses"] += 1

    @classmethod
    def report(cls) -> list[dict[str, Any]]:
        """Every resolution made so far in this process (op, device, provider, numerics, ...)."""
        with cls._lock:
            return [dict(r) for r in cls._records.values()]

    @classmethod
    def executed(cls) -> dict[str, int]:
        """Op calls that actually ran in this process, per op (all providers together).

        Counted in the custom ops' bodies (real executions, eager or inside a compiled graph;
        a CUDA-graph replay runs no Python and counts nothing, its capture counts once). A
        routed op at 0 after a model ran means the model did not run it (e.g. an engine that
        loaded a compiled graph built without rl_engine's ops)."""
        out: dict[str, int] = {}
        for (op, _), n in list(cls._executed.items()):
            out[op] = out.get(op, 0) + n
        return out

    @classmethod
    def reset(cls) -> None:
        """Forget resolutions, records and execution counts (tests; a new run)."""
        with cls._lock:
            cls._resolved.clear()
            cls._records.clear()
            cls._executed.clear()


@torch._dynamo.assume_constant_result
def resolve_provider(op_type: str, device_type: str, backend: str | None = None) -> str:
    """Name of the provider :meth:`KernelRegistry.get_op` resolves (same rules, same records).

    The functional ops call this; under ``torch.compile`` it runs once at trace time and its
    result is a constant of the graph, so compiled code keeps the provider chosen when it was
    traced.
    """
    return KernelRegistry.get_op(op_type, device=device_type, backend=backend).provider.name
