"""Decode attention at the 0.6B's and the 8B's heads, one layer (and its split combine)
replayed in a CUDA graph, at batches 1 to 16 and contexts of 62 to 1000 keys: split for
the longest context a graph allows (max_seq_len 2048, as the decode graphs are captured
now) against split for a power-of-two bucket of the context (the least that holds it, at
least 128), under the default decode tile and three others (warps x keys a step). The
default tile spills under Triton 3.6 (split9/results.txt); 8 warps x 64 keys does not.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/context_buckets.py
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from benchmarks.gpu.attention_splits import inputs
from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import TileConfig, default_config, paged_attention_triton

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
GRAPH_SPAN = 2048


def bucket(context: int) -> int:
    return max(128, 1 << (context - 1).bit_length())


def main() -> None:
    base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    tiles = [base.decode, TileConfig(16, 64, 8, 1), TileConfig(16, 128, 8, 1),
             TileConfig(16, 64, 4, 1)]
    names = [f"n{t.block_n}w{t.num_warps}" for t in tiles]
    print(torch.cuda.get_device_name(), f"default {base}")
    print(f"{'model':12s} {'batch':>5s} {'keys':>5s} {'span':>5s} " +
          " ".join(n.rjust(8) for n in names))
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for batch, context in itertools.product((1, 2, 4, 8, 16), (62, 300, 1000)):
            args = inputs(heads, kv_heads, head_dim, batch, context)
            ref = paged_attention_triton(**{**args, "max_seq_len": context}).float()
            for span in sorted({GRAPH_SPAN, bucket(context)}, reverse=True):
                times = []
                for tile in tiles:
                    config = replace(base, decode=tile)
                    run = lambda: paged_attention_triton(**{**args, "max_seq_len": span},
                                                         config=config)
                    assert (run().float() - ref).abs().max() < 2e-2, (name, batch, span, tile)
                    times.append(graph_us(run))
                print(f"{name:12s} {batch:5d} {context:5d} {span:5d} " +
                      " ".join(f"{t:8.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
