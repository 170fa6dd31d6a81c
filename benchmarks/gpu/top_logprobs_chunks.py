"""The top-logprobs kernel's chunk (kernels/sampling.py top_logprobs_triton): its two
launches replayed in a CUDA graph over bf16 logits (what the decode graphs' heads read) of
Qwen3's and Llama 3's vocabularies, at 1 to 256 rows and k = 1, 5 and 20, for chunks of
4096 to 32768 columns and their warps. A 256-row step with k = 5 spent 178 us in the first
launch on an H200 (benchmarks/issue31-h200/busy14, lease G's profile).

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/top_logprobs_chunks.py \
        [--tiles 4096:4,8192:8]

(the kernels of the tree first on PYTHONPATH; every tile below without --tiles)
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.sampling import top_logprobs_triton

VOCABS = {"qwen3": 151936, "llama3": 128256}
ROWS = (1, 8, 64, 256)
KS = (1, 5, 20)
TILES = ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16))


def parse_tiles(text: str) -> tuple[tuple[int, int], ...]:
    """"4096:4,8192:8" -> ((4096, 4), (8192, 8))"""
    return tuple(tuple(int(n) for n in tile.split(":")) for tile in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=parse_tiles, default=TILES,
                        help="chunk:warps pairs, comma between")
    tiles = parser.parse_args().tiles
    print(f"{'vocab':7s} {'rows':>4s} {'k':>3s} " + " ".join(f"{c // 1024}k/w{w}".rjust(9)
                                                          for c, w in tiles))
    for (name, vocab), rows, k in itertools.product(VOCABS.items(), ROWS, KS):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 4
        times = [graph_us(lambda t=tile: top_logprobs_triton(logits, k, tile=t))
                 for tile in tiles]
        print(f"{name:7s} {rows:4d} {k:3d} " + " ".join(f"{t:9.1f}" for t in times),
              flush=True)


if __name__ == "__main__":
    main()
