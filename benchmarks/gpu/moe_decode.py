"""The device script for the MoE performance goal: one Qwen3-30B-A3B MoE layer's parts at
decode batch sizes, each replayed in a CUDA graph: the router GEMM and routing kernel, and
the experts (the grouped GEMMs with their align, and for a few slots the GEMVs), against
the time to read the weights of the experts its tokens picked once at the machine's
measured copy bandwidth. The goal is batch 1 within 1.6x of that floor.
First H100 run: benchmarks/issue29-h100/moe-decode.txt.

    source .devkit/env.sh && python benchmarks/gpu/moe_decode.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.graph_timing import graph_us  # noqa: E402
from kernels.moe import (GEMV_MAX_SLOTS, fused_moe_gemv, fused_moe_triton,  # noqa: E402
                         moe_blocks, select_experts)

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768  # Qwen3-30B-A3B
REPLAYS, STEPS_PER_GRAPH = 20, 20
UP_TILES = [(8, 128, 8), (8, 256, 8), (4, 256, 4), (4, 512, 8), (16, 128, 8), (8, 64, 4)]
DOWN_TILES = [(8, 128, 8), (16, 128, 8), (32, 128, 8), (32, 64, 4), (16, 256, 8),
              (64, 64, 8), (4, 256, 4)]
GEMV_SWEEP = [(u, d) for u in UP_TILES for d in DOWN_TILES]


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (graph_us(lambda: dst.copy_(src), 1, REPLAYS) / 1e6)


def main() -> None:
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    # 8 experts of 9.4 MB outgrow the L2 (50 MB on an H100): replays read them from memory
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **bf16) * HIDDEN ** -0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, **bf16) * INTERMEDIATE ** -0.5
    gate = torch.randn(EXPERTS, HIDDEN, **bf16) * HIDDEN ** -0.5
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for tokens in (1, 2, 4, 8, 16, 64):
        x = torch.randn(tokens, HIDDEN, **bf16)
        weights, ids = select_experts(x @ gate.T, TOP_K, True, True)
        touched = ids.unique().numel()
        floor = touched * 3 * INTERMEDIATE * HIDDEN * 2 / bandwidth * 1e6
        paths = {"grouped": lambda: fused_moe_triton(
                     x, w13, w2, weights, ids, blocks=moe_blocks(tokens, TOP_K, EXPERTS)),
                 "routing": lambda: select_experts(x @ gate.T, TOP_K, True, True)}
        if tokens * TOP_K <= GEMV_MAX_SLOTS:
            paths["gemv"] = lambda: fused_moe_gemv(x, w13, w2, weights, ids)
        if tokens * TOP_K <= GEMV_MAX_SLOTS:
            base = fused_moe_gemv(x, w13, w2, weights, ids)
            for tiles in GEMV_SWEEP:  # each checked against the default tiles first
                diff = (fused_moe_gemv(x, w13, w2, weights, ids, tiles=tiles) - base).abs()
                assert diff.max().item() < 0.05, f"tiles {tiles}: off by {diff.max()}"
                paths[f"gemv{tiles}"] = (lambda t=tiles: fused_moe_gemv(x, w13, w2, weights,
                                                                       ids, tiles=t))
        times = {name: graph_us(fn, STEPS_PER_GRAPH, REPLAYS) for name, fn in paths.items()}
        best = sorted((us, name) for name, us in times.items() if name.startswith("gemv("))
        experts = " ".join(f"{name} {us:6.1f} us ({us / floor:.2f}x)"
                           for name, us in times.items()
                           if name in ("grouped", "gemv")) + "; best tiles: " + " ".join(
            f"{name} {us:.1f}" for us, name in best[:6])
        print(f"tokens {tokens:3d}: {touched:3d} experts read, floor {floor:6.1f} us; "
              f"router + routing {times['routing']:5.1f} us; experts: {experts}")

if __name__ == "__main__":
    main()
