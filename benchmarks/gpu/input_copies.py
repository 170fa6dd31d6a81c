"""What a step's copies cost the host in steady decoding: each step queues about a
step's worth of device work, then copies and waits for the step before last, as the worker
does (services/worker/launched.py). The ways are interleaved step by step, so that a drift
of the host falls on all alike. A step's inputs:

- nine: an array a copy, from pageable memory (the worker before b815006);
- together: services.worker.to_device_together, the arrays packed into one pageable
  buffer, one copy, and split into their views (the worker now);
- flat-pageable and flat-pinned: the packed bytes' copy alone, from pageable memory and
  from a block of torch's caching host allocator (as b815006 did).

Its output (six int64 a row: a greedy step's tokens and top-1 logprobs) to the host:

- out-alloc: into a fresh pinned block from torch's caching host allocator (before);
- out-ring: into one of four pinned blocks allocated once (as PinnedBlocks does now).

    source .devkit/env.sh && python benchmarks/gpu/input_copies.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from services.worker import to_device_together


def step_arrays(batch: int) -> list[np.ndarray]:
    """A decode step's nine arrays at `batch` requests, as prepare_inputs builds them."""
    rows = np.arange(batch, dtype=np.int64)
    return [rows, rows + 62, rows, rows * 16 + 62, np.zeros((batch, 4), np.int32),
            np.arange(batch + 1, dtype=np.int32), np.full(batch, 63, np.int32), rows, rows,
            np.zeros(0, np.int64)]


def flat_copy(arrays: list[np.ndarray], device: torch.device, pinned: bool) -> torch.Tensor:
    flat = torch.from_numpy(np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays]))
    return (flat.pin_memory() if pinned else flat).to(device, non_blocking=True)


def sleep_cycles_for(ms: float) -> int:
    """Cycles of torch.cuda._sleep that take about `ms` on this device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 * ms / start.elapsed_time(end))


def host_us(ways: dict[str, Callable[[], object]], steps: int, cycles: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in ways}
    last = torch.cuda.Event()
    last.record()
    for _ in range(steps):
        for name, copy in ways.items():
            torch.cuda._sleep(cycles)
            begin = time.perf_counter()
            copy()
            times[name].append(1e6 * (time.perf_counter() - begin))
            done = torch.cuda.Event()
            done.record()
            last.synchronize()
            last = done
    torch.cuda.synchronize()
    return times


def output_ways(batch: int, device: torch.device) -> dict[str, Callable[[], object]]:
    values = torch.zeros(6 * batch, dtype=torch.int64, device=device)
    ring = [torch.empty(6 * 256, dtype=torch.int64, pin_memory=True) for _ in range(4)]
    turn = iter(range(1 << 62))

    def allocated() -> torch.Tensor:
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        return host.copy_(values, non_blocking=True)

    def ringed() -> torch.Tensor:
        host = ring[next(turn) % len(ring)][:values.numel()]
        return host.copy_(values, non_blocking=True)

    return {"out-alloc": allocated, "out-ring": ringed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=0.9)
    args = parser.parse_args()
    cuda = torch.device("cuda")
    cycles = sleep_cycles_for(args.step_ms)
    for batch in (1, 64):
        arrays = step_arrays(batch)
        ways = {"nine": lambda: [torch.from_numpy(a).to(cuda, non_blocking=True)
                                 for a in arrays],
                "together": lambda: to_device_together(arrays, cuda),
                "flat-pageable": lambda: flat_copy(arrays, cuda, pinned=False),
                "flat-pinned": lambda: flat_copy(arrays, cuda, pinned=True),
                **output_ways(batch, cuda)}
        host_us(ways, 50, cycles)  # warm-up: the allocators' first blocks
        for name, samples in host_us(ways, args.steps, cycles).items():
            samples.sort()
            print(f"batch {batch:3d} {name:13s}: host {statistics.median(samples):6.1f} us "
                  f"median, p90 {samples[len(samples) * 9 // 10]:6.1f}, "
                  f"behind {args.step_ms} ms steps")


if __name__ == "__main__":
    main()
