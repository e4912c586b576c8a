"""Timing a collective (or a layer that ends in one) on every rank of a process group.

Used by ``rl_engine.harness.tp_exchange_check`` and ``benchmarks/bench_tp_exchange.py``: all
ranks call the timer in step (the calls under test, and the timer's own barrier and all-reduce,
are collectives), and each figure is the slowest rank's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class RankTimer:
    """``eager(fn)``: microseconds per call, the median of 5 repeats of ``iters`` back-to-back
    calls after 3 warm-up calls and a barrier (CUDA events on GPUs, ``perf_counter`` on the
    CPU), the slowest rank's. ``graph(fn)``: the same ``iters`` calls captured in one CUDA graph
    and replayed (GPU time only, as vLLM's CUDA graphs run them: no host launch cost); ``None``
    without CUDA or when the capture fails on any rank (the reason printed; with
    ``require_graph`` a failure raises on every rank instead)."""

    def __init__(self, dist: Any, group: Any, iters: int, *, cuda: bool = True,
                 require_graph: bool = False) -> None:  # fmt: skip
        self.dist, self.group, self.iters, self.cuda = dist, group, iters, cuda
        # a check (not a benchmark table): a failed capture raises on every rank
        self.require_graph = require_graph

    def _slowest(self, us: float) -> float:
        t = torch.tensor([us], dtype=torch.float64)
        t = t.cuda() if self.cuda else t
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def _run(self, launch: Callable[[], Any]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        self.dist.barrier(group=self.group)
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            launch()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1e3 / self.iters
        t0 = time.perf_counter()
        launch()
        return (time.perf_counter() - t0) * 1e6 / self.iters

    def _many(self, fn: Callable[[], Any]) -> Callable[[], None]:
        def launch() -> None:
            for _ in range(self.iters):
                fn()

        return launch

    def eager(self, fn: Callable[[], Any]) -> float:
        for _ in range(3):
            fn()
        return self._slowest(statistics.median(self._run(self._many(fn)) for _ in range(5)))

    def graph(self, fn: Callable[[], Any]) -> float | None:
        if not self.cuda:
            return None
        ok = torch.ones(1, device="cuda")
        graph = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.dist.barrier(group=self.group)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._many(fn)()
        except Exception as exc:  # said, and the figure is None
            print(f"CUDA graph capture failed: {type(exc).__name__}: {exc}", flush=True)
            ok.zero_()
        self.dist.all_reduce(ok, op=self.dist.ReduceOp.MIN, group=self.group)
        if not bool(ok.item()):
            if self.require_graph:
                raise RuntimeError("CUDA graph capture failed on some rank (its reason above)")
            return None
        us = statistics.median(self._run(graph.replay) for _ in range(5))
        del graph
        return self._slowest(us)
