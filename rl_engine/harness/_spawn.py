"""Spawning the ranks of a multi-process check (gloo on the CPU, NCCL on GPUs)."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


def use_cuda(ranks: int, device: str) -> bool:
    """``device``: ``cpu``, ``cuda`` (one GPU per rank, else an error) or ``auto`` (CUDA when
    every rank gets a GPU of its own, else the CPU)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected auto, cpu or cuda")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < ranks:
        raise RuntimeError(f"{ranks} ranks need {ranks} GPUs; {gpus} visible")
    return device == "cuda" or (device == "auto" and gpus >= ranks)


@contextlib.contextmanager
def _cpu_only(on: bool) -> Iterator[None]:
    """Hide the GPUs from the spawned ranks (they inherit the environment at spawn)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if on:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if on:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


# What the CPU ranks' fork server imports once (each missing one is skipped): a rank forked from
# it starts in well under a second instead of re-importing torch, rl_engine and Megatron (~10 s
# of CPU per rank, most of a CPU check's time).
_PRELOAD = ("torch", "torch.distributed", "rl_engine", "megatron.core", "transformers")


def _rank(rank: int, env: dict[str, str], worker: Callable[..., None], *args: Any) -> None:
    """A CPU rank forked from the fork server: the environment of the :func:`spawn` call (the
    server keeps the one it started with) and the configuration re-read, then ``worker``."""
    os.environ.clear()
    os.environ.update(env)
    from rl_engine import config

    config.reload()
    worker(rank, *args)


def spawn(worker: Callable[..., None], ranks: int, args: tuple, device: str) -> None:
    """``worker(rank, ranks, store, *args)`` in ``ranks`` new processes (file store): spawned
    on GPUs, forked on the CPU from a fork server that has imported :data:`_PRELOAD` (started
    once per process; the ranks run in the environment of this call)."""
    import multiprocessing

    import torch.multiprocessing as mp

    cuda = use_cuda(ranks, device)
    with tempfile.TemporaryDirectory() as tmp, _cpu_only(not cuda):
        store = os.path.join(tmp, "store")
        if cuda:
            fn, fn_args, method = worker, (ranks, store, *args), "spawn"
        else:
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
            fn, fn_args = _rank, (dict(os.environ), worker, ranks, store, *args)
            method = "forkserver"
        mp.start_processes(fn, args=fn_args, nprocs=ranks, join=True, start_method=method)


def init(rank: int, world: int, store: str) -> Any:
    """The rank's process group: NCCL with GPU ``rank`` when CUDA is visible, else gloo."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    return dist


@contextlib.contextmanager
def tp_groups_env(groups: str) -> Iterator[None]:
    """``RL_ENGINE_TP_GROUPS=groups`` in this process for the block (``""``: unset), the
    configuration re-read on entry and exit."""
    from rl_engine.config import override_env

    with override_env({"RL_ENGINE_TP_GROUPS": groups}):
        yield


def degrees_parser(
    doc: str, flag: str, degrees: str, *, model: str, dtype: str, device: str
) -> argparse.ArgumentParser:
    """The command line of a check that compares parallel degrees (the first of ``--<flag>``
    the base): ``--model`` (help ``model``), ``--<flag>`` (default ``degrees``), ``--dtype``,
    ``--out`` and ``--device`` (defaults ``dtype`` and ``device``); ``doc``'s first paragraph
    describes it. Read the parsed arguments with :func:`degrees_and_out`."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", required=True, help=model)
    p.add_argument(f"--{flag}", default=degrees, help="degrees, comma separated (the first: base)")
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--out", default=None, help="folder for the per-rank results")
    p.add_argument("--device", default=device, help="cpu, cuda (a GPU per rank) or auto")
    return p


def degrees_and_out(args: argparse.Namespace, flag: str, prefix: str) -> tuple[list[int], Path]:
    """The degrees of ``args.<flag>`` and the results folder (``args.out``, else a new temporary
    folder named ``prefix...``), created."""
    degrees = [int(x) for x in getattr(args, flag).split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix=prefix))
    out.mkdir(parents=True, exist_ok=True)
    return degrees, out
