"""Timing a few microseconds of GPU work without the launches' host cost: the calls are
captured once in a CUDA graph and the graph is replayed."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 20) -> float:
    """Microseconds per call of fn: `calls` calls captured in one graph (after one call
    outside it, which compiles), the graph replayed `replays` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)
