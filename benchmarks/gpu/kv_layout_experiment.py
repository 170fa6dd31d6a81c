"""Decode attention over a paged KV cache in two physical layouts, token-major blocks
[blocks, block size, KV heads, head_dim] (each key of a head a head_dim piece at a stride of
KV heads x head_dim) and head-major ones [blocks, KV heads, block size, head_dim] (a head's
keys of a block contiguous), passed as the same view; bf16 and fp8 caches at Llama-3.1-8B's
heads, the default decode tiles and a few others, replayed in CUDA graphs. (On the H100 the
layouts ran alike: benchmarks/issue30-h100/s5/kv-layout*.txt.)

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/kv_layout_experiment.py
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks.gpu.fp8_attention_sweep import HEAD_DIM, KV_HEADS, batch
from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import default_config, paged_attention_triton, sm_count

TILES = [(64, 4, 3), (128, 4, 3), (128, 4, 1), (64, 4, 5)]  # (keys a step, warps, stages)


def main() -> None:
    sms = sm_count(0)
    for requests, context in ((64, 1000), (32, 8000), (1, 1000)):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16), dtype)
            configs = [base] + [replace(base, decode=replace(base.decode, block_n=n,
                                                             num_warps=w, num_stages=s),
                                        target_programs=t * sms)
                                for n, w, s in TILES for t in (2, 4)]
            for head_major in (False, True):
                inputs = batch(dtype, requests, context, head_major)
                kv = 2 * requests * context * KV_HEADS * HEAD_DIM * inputs["k_cache"].element_size()
                times = sorted((graph_us(lambda c=c: paged_attention_triton(**inputs, config=c)), i)
                               for i, c in enumerate(configs))
                default_us = next(us for us, i in times if i == 0)
                best_us, best = times[0][0], configs[times[0][1]]
                print(f"n{requests} ctx{context} {str(dtype):20s} "
                      f"{'HND' if head_major else 'NHD'}: default {default_us:7.1f} us "
                      f"{kv / default_us / 1e3:6.0f} GB/s; best {best_us:7.1f} us "
                      f"{kv / best_us / 1e3:6.0f} GB/s (n{best.decode.block_n} "
                      f"w{best.decode.num_warps} s{best.decode.num_stages} "
                      f"t{best.target_programs // sms})", flush=True)


if __name__ == "__main__":
    main()
