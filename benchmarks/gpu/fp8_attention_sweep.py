"""Decode attention over a bf16 and an fp8 KV cache at a KV-bound shape (Llama-3.1-8B
heads, 32 requests of 8000-token contexts), across decode tile configs and split targets:
an fp8 tile of the same keys moves half the bytes, so the bf16 defaults may keep too few
bytes in flight to reach the bandwidth. Times one layer's launch (triton's do_bench,
median), reports GB/s of K and V read.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/fp8_attention_sweep.py
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from triton.testing import do_bench

from kernels.triton_attention import default_config, paged_attention_triton, sm_count

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BATCH, CONTEXT = 32, 8000


def batch(cache_dtype: torch.dtype, requests: int = BATCH, context: int = CONTEXT,
          head_major: bool = False) -> dict:
    """Decode inputs over random blocks; head_major: the cache's storage [blocks, KV heads,
    block size, head_dim], passed as the usual [blocks, block size, KV heads, head_dim]
    view (benchmarks/gpu/kv_layout_experiment.py)."""
    g = torch.Generator().manual_seed(0)
    per_request = math.ceil(context / BLOCK)
    num_blocks = requests * per_request
    tables = torch.randperm(num_blocks, generator=g).view(requests, per_request).int()
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM) if head_major else \
        (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    cache = [torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(cache_dtype)
             for _ in range(2)]
    if head_major:
        cache = [c.transpose(1, 2) for c in cache]
    scaled = cache_dtype != torch.bfloat16
    one = torch.ones(1, device="cuda")
    return dict(q=torch.randn(requests, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                k_cache=cache[0], v_cache=cache[1], block_tables=tables.cuda(),
                query_start_loc=torch.arange(requests + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((requests,), context, dtype=torch.int32, device="cuda"),
                scale=HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=context,
                k_scale=one if scaled else None, v_scale=one if scaled else None)


def main() -> None:
    base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    sms = sm_count(0)
    configs = [replace(base, decode=replace(base.decode, block_n=n, num_warps=w, num_stages=s),
                       target_programs=t)
               for n, w, s in [(64, 4, 3), (64, 4, 5), (128, 4, 3), (128, 8, 3), (128, 8, 4),
                               (256, 8, 3)]
               for t in (sms, 2 * sms, 4 * sms)]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        inputs = batch(dtype)
        kv_bytes = 2 * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * inputs["k_cache"].element_size()
        rows = []
        for config in configs:
            try:
                us = 1000 * do_bench(lambda: paged_attention_triton(**inputs, config=config),
                                     return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config past the chip's resources
                print(f"{dtype} {config.decode} t{config.target_programs}: {exc}"[:200])
                continue
            rows.append((us, config))
        rows.sort(key=lambda row: row[0])
        for us, config in rows:
            d = config.decode
            print(f"{str(dtype):22s} n{d.block_n:<4d} w{d.num_warps} s{d.num_stages} "
                  f"t{config.target_programs // sms}xSM: {us:8.1f} us "
                  f"{kv_bytes / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
