"""Decode attention's tile: one layer's attention (and its split combine) replayed in a CUDA
graph at the heads of the issue-29 models and Llama-3.1-8B. SWEEP=1: batches 1 and 4, 1000
keys, over decode tiles (keys a step, warps, pipeline stages) and split targets, the best
five of each. Otherwise: a few candidate tiles against the default at batches 1 to 32 and
1000 and 4000 keys. At small batches each program walks only a part or two of the context,
so software pipelining's stages buy nothing and cost the prologue.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/attention_tiles.py
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import torch

from benchmarks.gpu.attention_splits import SHAPES, inputs
from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import (AttentionConfig, TileConfig, default_config,
                                      paged_attention_triton, sm_count)


def timed(args: dict, config: AttentionConfig) -> float:
    return graph_us(lambda: paged_attention_triton(**args, config=config))


def sweep(base: AttentionConfig, sms: int) -> None:
    variants = [(n, w, s, f, p) for n, w, s in itertools.product((32, 64, 128), (2, 4, 8),
                                                                   (1, 2, 3))
                for f, p in ((2, 128), (2, 64), (4, 64), (1, 128))]
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for batch in (1, 4):
            args = inputs(heads, kv_heads, head_dim, batch, 1000)
            results = []
            for n, w, s, f, p in variants:
                config = replace(base, decode=TileConfig(16, n, w, s), target_programs=f * sms,
                                 min_partition=p)
                try:
                    results.append((timed(args, config), n, w, s, f, p))
                except Exception as e:  # a tile that does not fit shared memory
                    print(f"  {name} b{batch} n{n} w{w} s{s} {f}xSM/{p}: {type(e).__name__}")
            results.sort()
            best = " ".join(f"{us:.1f}(n{n} w{w} s{s} {f}x/{p})"
                            for us, n, w, s, f, p in results[:5])
            print(f"{name:14s} b{batch}: default {timed(args, base):.1f} us; best {best}")


def candidates(base: AttentionConfig) -> None:
    tiles = [base.decode] + [TileConfig(16, n, 4, s) for n, s in
                             ((32, 1), (64, 1), (128, 1), (64, 2))]
    print(f"{'model':14s} {'batch':>5s} {'keys':>5s} " +
          " ".join(f"n{t.block_n}w{t.num_warps}s{t.num_stages}".rjust(9) for t in tiles))
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for batch, context in itertools.product((1, 2, 4, 8, 16, 32), (1000, 4000)):
            args = inputs(heads, kv_heads, head_dim, batch, context)
            times = [timed(args, replace(base, decode=t)) for t in tiles]
            print(f"{name:14s} {batch:5d} {context:5d} " +
                  " ".join(f"{t:9.1f}" for t in times))


def main() -> None:
    base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    print(f"default: {base}")
    if os.environ.get("SWEEP") == "1":
        sweep(base, sm_count(0))
    else:
        candidates(base)


if __name__ == "__main__":
    main()
