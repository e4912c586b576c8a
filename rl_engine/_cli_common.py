"""Plumbing shared by the ``rl-engine`` subcommands that run vLLM against a trainer: ``audit``
(:mod:`rl_engine.audit.cli`) and ``grpo`` (:mod:`rl_engine.grpo.cli`), and by their worker
processes (:mod:`rl_engine.audit.worker`, :mod:`rl_engine.grpo.loop`)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

# the Hugging Face architectures both sides (vLLM plugin, trainer adapters) support
from rl_engine.adapters import SUPPORTED_ARCHS  # the one list

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]
R = TypeVar("R")


def add_subcommand(sub: Any, name: str, summary: str, add_arguments: AddArguments, run: Run):
    """Subcommand ``name`` of the ``rl-engine`` parser's subparsers ``sub``: its arguments from
    ``add_arguments``, carried out by ``run(args)``."""
    p = sub.add_parser(name, help=summary)
    add_arguments(p)
    p.set_defaults(func=run)


def main(
    prog: str,
    description: str | None,
    add_arguments: AddArguments,
    run: Run,
    argv: list[str] | None,
) -> int:
    """A subcommand as a program of its own: parse ``argv`` and return ``run``'s exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_model_argument(p: argparse.ArgumentParser, default_help: str) -> None:
    """``--model``: a Hugging Face model folder; without it the subcommand runs
    :func:`embedded_model` (``default_help`` says so in the help text)."""
    p.add_argument(
        "--model", default=None, help=f"Hugging Face model folder (default: {default_help})"
    )


def embedded_model(workdir: str, dtype: str, seed: int) -> str:
    """The model when none is given: a tiny random Llama written to ``workdir/tiny-llama``, its
    weights a function of ``seed``; returns its folder."""
    from rl_engine.testing.tiny_models import make_tiny_model

    return make_tiny_model(os.path.join(workdir, "tiny-llama"), "llama", dtype, seed=seed)


def check_architectures(archs: list[str], error: type[Exception], where: str = "") -> None:
    """Raise ``error`` unless one of a model's ``architectures`` is in :data:`SUPPORTED_ARCHS`
    (``where``: the text after the architectures in the message, e.g. ``" in <folder>"``)."""
    if not any(a in SUPPORTED_ARCHS for a in archs):
        raise error(
            f"unsupported architecture {archs or '(none given)'}{where}; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )


def check_temperature(value: float, error: type[Exception]) -> None:
    """Raise ``error`` unless ``--temperature`` is finite and > 0: the one check of a CLI's
    temperature, before any worker starts (inside, the ops' public entries check it once more
    for library callers and trust it from there)."""
    if not (value > 0 and math.isfinite(value)):
        raise error(f"--temperature must be > 0, got {value}")


def run_in_workdir(
    prog: str,
    prefix: str,
    compute: Callable[[str], R],
    finish: Callable[[R, str], int],
    *,
    input_error: tuple[type[Exception], int],
    failures: Sequence[tuple[type[Exception], Callable[[Any], int]]] = (),
    internal_exit: int | None = None,
) -> int:
    """A subcommand's run in a fresh temporary ``workdir`` (``prefix``): ``compute(workdir)``,
    then ``finish(result, workdir)`` (writes the outputs while ``workdir`` exists; its exit code).
    ``input_error`` (type, exit code): printed as ``prog: error: ...``; ``failures``: (type,
    ``handle(exc)`` -> exit code); any other exception: with ``internal_exit`` its traceback and
    ``prog: internal error`` (that exit code), else raised."""
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        try:
            result = compute(workdir)
        except input_error[0] as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return input_error[1]
        except Exception as exc:
            for kind, handle in failures:
                if isinstance(exc, kind):
                    return handle(exc)
            if internal_exit is None:
                raise
            import traceback

            traceback.print_exc()
            print(f"{prog}: internal error (a bug: please report it)", file=sys.stderr)
            return internal_exit
        return finish(result, workdir)


def write_figure(draw: Callable[[str], None], workdir: str, out_dir: str, name: str) -> None:
    """``draw(path)`` figure ``name`` inside ``workdir``, then move it into ``out_dir``: a failed
    drawing leaves no half-written file there."""
    stage = os.path.join(workdir, name)
    draw(stage)
    shutil.move(stage, os.path.join(out_dir, name))


def write_outputs(
    prog: str,
    out_dir: str,
    workdir: str,
    texts: list[tuple[str, str]],
    figures: list[tuple[str, Callable[[str], None]]],
) -> list[str]:
    """A subcommand's results in ``out_dir``: the ``texts`` (name, content) first, each complete
    before it is moved in, then the ``figures`` (name, ``draw(path)``, staged in ``workdir``).
    A figure that fails is reported (``prog: warning: ...``) and skipped: the numbers written
    before it are never lost. Returns the names written, in order."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in texts:
        write_text_atomic(os.path.join(out_dir, name), text)
        written.append(name)
    for name, draw in figures:
        try:
            write_figure(draw, workdir, out_dir, name)
            written.append(name)
        except Exception as exc:  # the numbers are already on disk
            print(f"{prog}: warning: no {name} ({type(exc).__name__}: {exc})")
    return written


def write_text_atomic(path: str, text: str) -> None:
    """``text`` at ``path``, written to ``path + ".tmp"`` and renamed, so a reader (the parent of
    a worker process, a user of the output folder) never sees a half-written file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomic(path: str, obj: Any) -> None:
    """``obj`` as JSON at ``path``, atomically (:func:`write_text_atomic`)."""
    import json

    write_text_atomic(path, json.dumps(obj))
