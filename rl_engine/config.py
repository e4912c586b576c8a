"""The one place that reads ``RL_ENGINE_*`` environment variables.

Every other module asks this one. Availability checks of providers never read the environment
(they get the device and nothing else), so a provider's answer does not change behind the
registry's back.

Variables:
    RL_ENGINE_MODE: ``strict`` (default) or ``audit``.
    RL_ENGINE_BACKEND: pin every op to one provider name (e.g. ``native`` or ``triton``).
    RL_ENGINE_BACKEND_<OP>: pin one op (e.g. ``RL_ENGINE_BACKEND_DET_GEMM=triton``); wins over
        ``RL_ENGINE_BACKEND``.
    RL_ENGINE_VLLM: ``1`` switches the vLLM plugin on inside vLLM's processes. vLLM's Ray
        executor does not forward ``RL_ENGINE_*`` variables to its workers: set it in the Ray
        runtime env (``runtime_env={"env_vars": {"RL_ENGINE_VLLM": "1"}}``) and check with
        ``rl_engine.adapters.vllm.require_routing(llm)``.
    RL_ENGINE_VLLM_ALLOW_UNTESTED: ``1`` lets the vLLM plugin run on a vLLM version it was not
        tested with (refused otherwise).
    RL_ENGINE_PROVENANCE_DIR: folder where adapters write the registry report of their process.
    RL_ENGINE_CHECK_LAUNCH: ``1`` makes every cached Triton launch also ask Triton which compiled
        kernel its own argument binding picks and raise if the cache picked another (tests).
    RL_ENGINE_DEVICE_CHECKS: ``1`` queues device-side asserts on index inputs whose check on
        the host would synchronise the stream (``write_kv_cache`` slots on a GPU); off by
        default (a few launches per call); the GPU test script turns it on. The Triton kernel
        never writes outside the cache either way.
    RL_ENGINE_TP_GROUPS: the TP-invariant reduction of the GEMMs that tensor parallelism shards
        (``rl_engine.ops.det_gemm.tp``): unset = on with 8 groups at TP > 1, off at TP = 1;
        ``8`` = on at every degree, TP = 1 included (set it on every side: the
        rollout and the trainers at TP 1, 2, 4, 8 then agree bitwise); ``0`` = off (TP > 1 is
        refused). Unset, a TP 1 side and a TP > 1 side differ; provenance tells them apart
        (``det_gemm_tp`` resolved or not) and ``rl_engine.drift.metrics.provenance_check``
        reports the pair as a mismatch.
    RL_ENGINE_CSRC_LIB: path of the CUDA C++ library (``librl_engine_sm90.so``, built by
        ``scripts/build_csrc.sh``) that the ``cuda`` providers load; unset: ``rl_engine/_lib/``
        (a wheel built with it) then ``build/csrc/`` of the source checkout. The ``cuda``
        provider of ``det_gemm`` (family ``det_gemm/cuda-sm90``) is opt-in: pin it on every
        side with ``RL_ENGINE_BACKEND_DET_GEMM=cuda``, and ``linear_logp`` in the trainers with
        ``RL_ENGINE_BACKEND_LINEAR_LOGP=unfused`` (those logits, the Triton log-softmax).
    RL_ENGINE_TP_ONESHOT: ``1`` gives every TP exchange the adapters build over a CUDA process
        group the one-shot path for small messages (``rl_engine.ops.det_gemm.oneshot``: the
        ranks' fp32 subtrees through symmetric memory, one kernel; NCCL above
        ``ONESHOT_MAX_BYTES``; the same bits either way). Where it cannot run the exchange's
        construction raises with the reason. Unset / ``0``: NCCL only (the default until the
        one-shot path is measured on GPUs).
    RL_ENGINE_TP_SUBTREE: how a rank computes its subtree of the TP reduction: ``launch``
        (default; one kernel where the provider has one) or ``per-group`` (one launch per
        group, ``tp.subtree_per_group``). The same bits either way (tests check it): a
        bisection aid when a TP run differs, not a numerics choice.
    RL_ENGINE_FUZZ_LOCK: set by ``python -m rl_engine.harness.fuzz --workers N`` in its shard
        processes: the lock file the shards on one GPU share (not for users).
    TRITON_INTERPRET: read (not owned) to know whether Triton kernels may run on the CPU.

Code that needs one of these in another process sets it in that process's environment (a
child's ``env``, or :func:`set_env` / :func:`override_env` here before spawning); only this
module reads them (``tests/test_layers.py`` checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

_PREFIX = "RL_ENGINE_"
_MODES = ("strict", "audit")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """A snapshot of the configuration."""

    mode: str = "strict"
    backend: str | None = None
    op_backends: dict[str, str] = field(default_factory=dict)
    vllm_plugin: bool = False
    vllm_allow_untested: bool = False
    provenance_dir: str | None = None
    triton_interpret: bool = False
    check_launch: bool = False
    device_checks: bool = False
    tp_oneshot: bool = False
    tp_subtree_per_group: bool = False
    tp_groups: int | None = None
    csrc_lib: str | None = None
    fuzz_lock: str | None = None

    def pin_for(self, op_type: str) -> str | None:
        """The provider pinned for ``op_type`` by configuration, or ``None``."""
        return self.op_backends.get(op_type, self.backend)


def _read(environ: dict[str, str] | os._Environ) -> Settings:
    mode = environ.get(_PREFIX + "MODE", "strict").strip().lower() or "strict"
    if mode not in _MODES:
        raise ValueError(f"{_PREFIX}MODE={mode!r}: expected one of {_MODES}")
    op_backends = {}
    for key, value in environ.items():
        if key.startswith(_PREFIX + "BACKEND_") and value.strip():
            op_backends[key[len(_PREFIX + "BACKEND_") :].lower()] = value.strip().lower()
    backend = environ.get(_PREFIX + "BACKEND", "").strip().lower() or None
    raw_groups = environ.get(_PREFIX + "TP_GROUPS", "").strip()
    tp_groups = None
    if raw_groups:
        if raw_groups not in ("0", "8"):
            raise ValueError(
                f"{_PREFIX}TP_GROUPS={raw_groups!r}: expected 0 (off) or 8 (the group count of "
                "the TP-invariant reduction, a fixed part of its numerics)"
            )
        tp_groups = int(raw_groups)
    return Settings(
        mode=mode,
        backend=backend,
        op_backends=op_backends,
        vllm_plugin=environ.get(_PREFIX + "VLLM", "0").strip().lower() in _TRUE,
        vllm_allow_untested=environ.get(_PREFIX + "VLLM_ALLOW_UNTESTED", "0").strip().lower()
        in _TRUE,
        provenance_dir=environ.get(_PREFIX + "PROVENANCE_DIR") or None,
        triton_interpret=environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE,
        check_launch=environ.get(_PREFIX + "CHECK_LAUNCH", "0").strip().lower() in _TRUE,
        device_checks=environ.get(_PREFIX + "DEVICE_CHECKS", "0").strip().lower() in _TRUE,
        tp_groups=tp_groups,
        csrc_lib=environ.get(_PREFIX + "CSRC_LIB", "").strip() or None,
        tp_oneshot=environ.get(_PREFIX + "TP_ONESHOT", "0").strip().lower() in _TRUE,
        tp_subtree_per_group=_subtree(environ.get(_PREFIX + "TP_SUBTREE", "")),
        fuzz_lock=environ.get(_PREFIX + "FUZZ_LOCK") or None,
    )


def _subtree(raw: str) -> bool:
    """``RL_ENGINE_TP_SUBTREE``: ``launch`` (default) or ``per-group``."""
    raw = raw.strip().lower() or "launch"
    if raw not in ("launch", "per-group"):
        raise ValueError(f"{_PREFIX}TP_SUBTREE={raw!r}: expected 'launch' or 'per-group'")
    return raw == "per-group"


_settings: Settings | None = None


def settings() -> Settings:
    """The current configuration (read from the environment once, then cached)."""
    global _settings
    if _settings is None:
        _settings = _read(os.environ)
    return _settings


def reload() -> Settings:
    """Re-read the environment (tests and CLIs that change variables call this)."""
    global _settings
    _settings = None
    return settings()


def set_mode(mode: str) -> None:
    """Switch between ``strict`` and ``audit`` for this process."""
    global _settings
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}: expected one of {_MODES}")
    current = settings()
    _settings = dataclasses.replace(current, mode=mode, op_backends=dict(current.op_backends))


def set_env(variables: Mapping[str, str | None]) -> Settings:
    """Set (a string) or unset (``None`` or ``""``) ``RL_ENGINE_*`` variables in this process's
    environment, so that processes it starts inherit them, and re-read the configuration."""
    for name, value in variables.items():
        if not name.startswith(_PREFIX):
            raise ValueError(f"{name!r}: not an {_PREFIX}* variable")
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    return reload()


@contextlib.contextmanager
def override_env(variables: Mapping[str, str | None]) -> Iterator[Settings]:
    """:func:`set_env` for the block: the previous values restored exactly (and the
    configuration re-read) on exit."""
    saved = {name: os.environ.get(name) for name in variables}
    try:
        yield set_env(variables)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload()
