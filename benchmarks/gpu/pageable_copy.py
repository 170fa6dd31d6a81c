"""Whether a host-to-device copy waits for the work queued on the device: the time the call
takes behind about a second of queued spinning, from pageable memory (as the step inputs
are copied, services/worker/inputs.py) and from a pinned copy of it.

    source .devkit/env.sh && python benchmarks/gpu/pageable_copy.py

On an H200 (issue 31, benchmarks/issue31-h200/logprobs/greedy-top1/pageable-copy.txt)
neither waited: 0.16-0.20 ms pageable, 0.23-0.28 ms pinned (a fresh pinned block each
time, since the last one's copy is still queued), so the served worker's time in its first
input copy of a step (py-spy) is not a wait for the step in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch


def queued_call_s(copy: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    start = time.perf_counter()
    copy()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    cuda = torch.device("cuda")
    array = np.arange(64, dtype=np.int64)

    def pageable() -> torch.Tensor:
        return torch.from_numpy(array).to(cuda, non_blocking=True)

    def pinned() -> torch.Tensor:
        return torch.from_numpy(array).pin_memory().to(cuda, non_blocking=True)

    queued_call_s(pinned)  # the first pinned block is allocated outside the timing
    spin = queued_call_s(torch.cuda.synchronize)
    for name, copy in (("pageable", pageable), ("pinned", pinned)) * 2:
        print(f"{name}: the copy call took {1000 * queued_call_s(copy):.3f} ms behind "
              f"{1000 * spin:.0f} ms of queued work")


if __name__ == "__main__":
    main()
