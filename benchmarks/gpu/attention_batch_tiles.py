"""Decode attention's tile at large batches: one layer's attention replayed in a CUDA graph
at the heads of Qwen3-0.6B and Llama-3.1-8B, for batches of 64 to 256 decodes with short
and long contexts, against the default decode tile. attention_tiles.py chose that tile at
batches 1 to 32, where the context is split across programs; here every request and KV
head has a program of its own, walking its context alone, and a serving step of the
detokenizer-bound workload (256 decodes of about 112 keys) spent 1.33 of its 3 ms in this
kernel (benchmarks/issue31-h200/busy14). Each graph call reads another of LAYERS caches,
so that the L2 cache does not hold a small batch's keys from one call to the next. Prints
the default's time, then the best five variants (keys a step, warps, stages, V loaded with
K) and their share of the copy bandwidth.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/attention_batch_tiles.py
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from benchmarks.gpu.attention_splits import inputs
from benchmarks.gpu.graph_timing import graph_us
from kernels.triton_attention import AttentionConfig, TileConfig, default_config, \
    paged_attention_triton

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
BATCHES = (64, 128, 256)
CONTEXTS = (112, 512, 2000)
LAYERS = 4
COPY_TB_S = 4.19  # the H200's copy bandwidth as `bench throughput` measured it


def variants() -> list[TileConfig]:
    return [TileConfig(16, n, w, s, v) for n, w, s, v in
            itertools.product((32, 64, 128), (4, 8), (1, 2), (False, True))]


def layers_of(heads: int, kv_heads: int, head_dim: int, batch: int, context: int
              ) -> list[dict]:
    """LAYERS layers' inputs, each sized as a CUDA graph's for this context."""
    layers = [inputs(heads, kv_heads, head_dim, batch, context) for _ in range(LAYERS)]
    for args in layers:
        args["max_seq_len"] = max(2048, 2 * context)
    return layers


def layer_us(layers: list[dict], config: AttentionConfig) -> float:
    """One call's microseconds, each call on the next layer's inputs."""
    turn = itertools.cycle(layers)
    return graph_us(lambda: paged_attention_triton(**next(turn), config=config),
                    calls=4 * LAYERS)


def kv_bytes(kv_heads: int, head_dim: int, batch: int, context: int) -> int:
    return 2 * batch * context * kv_heads * head_dim * 2  # K and V, bf16


def main() -> None:
    base = default_config(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for batch, context in itertools.product(BATCHES, CONTEXTS):
            ideal = kv_bytes(kv_heads, head_dim, batch, context) / (COPY_TB_S * 1e6)
            layers = layers_of(heads, kv_heads, head_dim, batch, context)
            default = layer_us(layers, base)
            results = []
            for tile in variants():
                try:
                    results.append((layer_us(layers, replace(base, decode=tile)), tile))
                except Exception as e:  # a tile that does not fit shared memory
                    print(f"  {tile}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            best = "  ".join(f"{us:.1f} (n{t.block_n} w{t.num_warps} s{t.num_stages}"
                             f"{' v' if t.prefetch_v else ''})" for us, t in results[:5])
            print(f"{name:13s} b{batch:<4d} ctx{context:<5d} copy-bound {ideal:7.1f} us; "
                  f"default {default:7.1f} ({ideal / default:.0%}); best {best}",
                  flush=True)
            del layers
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
