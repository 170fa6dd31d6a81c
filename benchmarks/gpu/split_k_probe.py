"""Split kernels at the 0.6B decode shapes, timed in CUDA graphs of 200 launches back to back
(PDL as configured; kernels/graph_timing's mean of five replays, where the committed
split9/probe.txt took their median): the GEMV at o_proj's and down_proj's shapes, one row,
with and without its K split, and the batch-1 attention at a context of 62 with the decode
graph's 16 splits and with none; and whether each matches its twin. Runs in this tree or,
with PYTHONPATH at a copy of an older one, in that (the same kernel entry points).

    python benchmarks/gpu/split_k_probe.py
"""

from __future__ import annotations

import torch

from kernels.attention import paged_attention_ref
from kernels.gemv import GemvTiles, gemv_ref, gemv_triton
from kernels.graph_timing import graph_us
from kernels.triton_attention import paged_attention_triton

LAUNCHES = 200


def launch_us(fn) -> float:
    """Microseconds a launch of fn, LAUNCHES launches back to back in one graph."""
    return graph_us(fn, calls=LAUNCHES, replays=5)


def gemv_cases() -> None:
    for n, k in ((1024, 2048), (1024, 3072)):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for tiles in (GemvTiles(8, 256, split_k=1), GemvTiles(8, 256, split_k=2),
                      GemvTiles(4, 512, split_k=1), GemvTiles(4, 256, split_k=1)):
            err = (gemv_triton(x, w, None, tiles).float() - gemv_ref(x, w).float()).abs().max()
            us = launch_us(lambda: gemv_triton(x, w, None, tiles))
            print(f"gemv {n}x{k} {tiles}: {us:.2f} us, max err {err:.3g}")


def attention_cases() -> None:
    heads, kv_heads, dim, block = 16, 8, 128, 16
    blocks = 200
    k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32)[:128].reshape(1, 128)
    starts = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    for ctx in (62, 1000):
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        ref = paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.1)
        for max_seq_len in (128, 2048):
            def run():
                return paged_attention_triton(q, k_cache, v_cache, tables, starts, lens, 0.1,
                                              max_query_len=1, max_seq_len=max_seq_len)
            err = (run().float() - ref.float()).abs().max()
            us = launch_us(run)
            print(f"attention ctx {ctx} max_seq_len {max_seq_len}: {us:.2f} us, "
                  f"max err {err:.3g}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    gemv_cases()
    attention_cases()
