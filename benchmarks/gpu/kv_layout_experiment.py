"""Decode attention over a paged KV cache in two physical layouts: token-major blocks
[blocks, block_size, kv_heads, head_dim] (each key of a head a 128-element piece at a stride of
kv_heads x head_dim) and head-major blocks [blocks, kv_heads, block_size, head_dim] (a head's
keys of a block contiguous), passed as the same logical view. bf16 and fp8 caches, Llama-3.1-8B
heads, graph-replayed."""
from __future__ import annotations
import math, sys
from dataclasses import replace
import torch
sys.path.insert(0, ".")
from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import default_config, paged_attention_triton, sm_count

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16

def batch(dtype, layout, n, ctx):
    g = torch.Generator().manual_seed(0)
    per = math.ceil(ctx / BLOCK)
    nb = n * per
    tables = torch.randperm(nb, generator=g).view(n, per).int()
    caches = []
    for _ in range(2):
        if layout == "NHD":
            c = torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(dtype)
        else:
            c = torch.randn(nb, KV_HEADS, BLOCK, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(dtype).transpose(1, 2)
        caches.append(c)
    scaled = dtype != torch.bfloat16
    one = torch.ones(1, device="cuda")
    return dict(q=torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                k_cache=caches[0], v_cache=caches[1], block_tables=tables.cuda(),
                query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((n,), ctx, dtype=torch.int32, device="cuda"),
                scale=HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=ctx,
                k_scale=one if scaled else None, v_scale=one if scaled else None)

sms = sm_count(0)
for n, ctx in ((64, 1000), (32, 8000), (1, 1000)):
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16), dtype)
        configs = [base] + [replace(base, decode=replace(base.decode, block_n=bn, num_warps=w, num_stages=s), target_programs=t * sms)
                            for bn, w, s in ((64, 4, 3), (128, 4, 3), (128, 4, 1), (64, 4, 5)) for t in (2, 4)]
        outs = {}
        for layout in ("NHD", "HND"):
            inp = batch(dtype, layout, n, ctx)
            kv = 2 * n * ctx * KV_HEADS * HEAD_DIM * inp["k_cache"].element_size()
            res = []
            for i, c in enumerate(configs):
                try:
                    us = graph_us(lambda c=c: paged_attention_triton(**inp, config=c))
                except Exception as e:
                    print("fail", layout, c, str(e)[:100]); continue
                res.append((us, i))
                if i == 0:
                    outs[layout] = paged_attention_triton(**inp, config=c).float()
            res.sort()
            d0 = [u for u, i in res if i == 0][0]
            bi = res[0][1]; bc = configs[bi]
            print(f"n{n} ctx{ctx} {str(dtype):20s} {layout}: default {d0:7.1f} us {kv/d0/1e3:6.0f} GB/s; best {res[0][0]:7.1f} us "
                  f"{kv/res[0][0]/1e3:6.0f} GB/s (n{bc.decode.block_n} w{bc.decode.num_warps} s{bc.decode.num_stages} t{bc.target_programs//sms})", flush=True)
        print("   same output:", (outs["NHD"] - outs["HND"]).abs().max().item())
