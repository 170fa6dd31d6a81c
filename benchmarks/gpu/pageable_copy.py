"""Whether a host-to-device copy waits for the work queued on the device: the time the call
takes behind about a second of queued spinning, from pageable memory (the step inputs'
copies before issue 31's fix) and from pinned memory (services/worker/transfers.py).

    source .devkit/env.sh && python benchmarks/gpu/pageable_copy.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.worker.transfers import to_device  # noqa: E402


def queued_call_s(copy) -> float:
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
    pageable = lambda: torch.from_numpy(array).to(cuda, non_blocking=True)  # noqa: E731
    pinned = lambda: to_device(array, cuda)  # noqa: E731
    queued_call_s(pinned)  # the first pinned block is allocated outside the timing
    spin = queued_call_s(lambda: torch.cuda.synchronize())
    for name, copy in (("pageable", pageable), ("pinned", pinned)) * 2:
        print(f"{name}: the copy call took {1000 * queued_call_s(copy):.3f} ms behind "
              f"{1000 * spin:.0f} ms of queued work")


if __name__ == "__main__":
    main()
