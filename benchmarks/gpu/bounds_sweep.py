"""Decode attention's time against the context bound its launch is sized for: one layer (and
its split combine) replayed in a CUDA graph at the 0.6B's heads (16 of 8 KV) and the 8B's
(32 of 8), batches 1 to 16, contexts of 62 to 4000 keys, bounds of 128 to 4096 keys
(max_seq_len: it sets the split count alone, the kernel cuts the actual context). Each
cell is the median of three timings, "us/splits". The decode graphs' bounds
(services/worker/cuda_graphs.py) are the powers of two this table picks.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/bounds_sweep.py
"""

from __future__ import annotations

import itertools
import statistics

import torch

from benchmarks.gpu.attention_splits import inputs
from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import default_config, paged_attention_triton, split_count

BOUNDS = (128, 256, 512, 1024, 2048, 4096)


def cell(args: dict, bound: int, splits: int) -> str:
    run = lambda: paged_attention_triton(**{**args, "max_seq_len": bound})  # noqa: E731
    us = statistics.median(graph_us(run) for _ in range(3))
    return f"{us:6.2f}/{splits:<2d}"


def main() -> None:
    config = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    print(torch.cuda.get_device_name())
    print(f"{'heads':>6s} {'b':>3s} {'ctx':>5s} " + " ".join(f"{b:9d}" for b in BOUNDS))
    for (heads, kv_heads), batch, context in itertools.product(
            ((16, 8), (32, 8)), (1, 2, 4, 8, 16), (62, 120, 250, 500, 1000, 2000, 4000)):
        args = inputs(heads, kv_heads, 128, batch, context)
        cells = [cell(args, bound, split_count(batch * kv_heads, bound, config))
                 for bound in BOUNDS]
        print(f"{heads:6d} {batch:3d} {context:5d} " + " ".join(c.rjust(9) for c in cells),
              flush=True)


if __name__ == "__main__":
    main()
