"""Decode attention's split target at small batches: one layer's attention (and its split
combine) replayed in a CUDA graph, for the heads of the issue-29 models and Llama-3.1-8B, at
batches 1 to 32 and contexts of 1000 and 4000 keys, with the context split until the grid
holds about 1, 2 or 4 programs per SM, into parts of at least 64 or 128 keys of the
longest possible context (the model length, in CUDA graphs). A batch-1 decode with many KV heads (Phi-3's 32)
gets only a few splits at one program per SM, each walking its part of the context alone.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/attention_splits.py
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import default_config, paged_attention_triton, sm_count

BLOCK = 16
SHAPES = {"phi-3-mini": (32, 32, 96), "qwen3-30b-a3b": (32, 4, 128),
          "gemma-2-9b": (16, 8, 256), "llama-3.1-8b": (32, 8, 128)}


def inputs(heads: int, kv_heads: int, head_dim: int, batch: int, context: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per_request = math.ceil(context / BLOCK)
    num_blocks = batch * per_request
    tables = torch.randperm(num_blocks, generator=g).view(batch, per_request).int()
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return dict(q=torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16),
                k_cache=k, v_cache=v, block_tables=tables.cuda(),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
                scale=head_dim ** -0.5, max_query_len=1, max_seq_len=2 * context)


def main() -> None:
    base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    sms = sm_count(0)
    variants = [(f, p) for p in (64, 128) for f in (1, 2, 4)]
    print(f"{'model':14s} {'batch':>5s} {'context':>7s} " +
          " ".join(f"{f}xSM/{p}".rjust(10) for f, p in variants))
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for batch in (1, 4, 8, 32):
            for context in (1000, 4000):
                args = inputs(heads, kv_heads, head_dim, batch, context)
                times = [graph_us(lambda c=replace(base, target_programs=f * sms,
                                                   min_partition=p):
                                  paged_attention_triton(**args, config=c))
                         for f, p in variants]
                print(f"{name:14s} {batch:5d} {context:7d} " +
                      " ".join(f"{t:10.1f}" for t in times))


if __name__ == "__main__":
    main()
