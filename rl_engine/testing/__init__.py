"""Test utilities shipped with the package: the tolerance table, the invariance checkers and the
tiny-model factory. They import no adapter and no engine; the engine harnesses (TP / FSDP / vLLM
checks, the fuzzer) are in :mod:`rl_engine.harness`."""
