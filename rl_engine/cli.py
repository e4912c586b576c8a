"""``rl-engine`` command line: ``check`` (registry + invariance self-test), ``audit`` and
``grpo``."""

from __future__ import annotations

import argparse
import sys
import time

from rl_engine.registry import KernelRegistry
from rl_engine.selftest import SELF_TESTS


def _check(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"rl_engine check on {device} (torch {torch.__version__})")
    print(f"{'op':<18} {'provider':<10} {'numerics':<36} self-test")
    failures = 0
    for op_type in KernelRegistry.known_ops():
        try:
            op = KernelRegistry.get_op(op_type, device=device)
        except Exception as exc:
            print(f"{op_type:<18} {'-':<10} {'-':<30} UNAVAILABLE: {exc}")
            failures += 1
            continue
        test = SELF_TESTS.get(op_type)
        if test is None:
            status = "FAIL: no self-test"
            failures += 1
        else:
            t0 = time.perf_counter()
            try:
                test(device)
                status = f"ok ({time.perf_counter() - t0:.2f} s)"
            except Exception as exc:
                status = f"FAIL: {type(exc).__name__}: {exc}"
                failures += 1
        print(f"{op_type:<18} {op.provider.name:<10} {op.numerics:<36} {status}")
    print("all invariance self-tests passed" if not failures else f"{failures} op(s) failed")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    from rl_engine import __version__

    parser = argparse.ArgumentParser(prog="rl-engine", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rl-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="show the registry's resolution and self-test every op")
    p_check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p_check.set_defaults(func=_check)
    from rl_engine.audit.cli import add_parser as add_audit
    from rl_engine.grpo.cli import add_parser as add_grpo

    add_audit(sub)
    add_grpo(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
