"""The device script for the MoE performance goal: one Qwen3-30B-A3B MoE layer (router,
routing, align, both grouped GEMMs, the top-k sum) at decode batch sizes, replayed in a
CUDA graph, against the time to read the weights of the experts its tokens picked once at
the machine's measured copy bandwidth. The goal is batch 1 within 1.6x of that floor.
First H100 run: benchmarks/issue29-h100/moe-decode.txt.

    source .devkit/env.sh && python benchmarks/gpu/moe_decode.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.moe import fused_moe  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768  # Qwen3-30B-A3B
REPLAYS, STEPS_PER_GRAPH = 20, 20


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (time_of(lambda: dst.copy_(src), 1) / 1e6)


def time_of(fn, per_replay: int) -> float:
    """Microseconds per call of fn, replayed in a CUDA graph of STEPS_PER_GRAPH calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_replay):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * per_replay)


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

        def layer() -> torch.Tensor:
            probs = torch.softmax((x @ gate.T).float(), dim=-1)
            weights, ids = torch.topk(probs, TOP_K, dim=-1)
            weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).float()
            return fused_moe(x, w13, w2, weights, ids)

        us = time_of(layer, STEPS_PER_GRAPH)
        ids = torch.topk(x @ gate.T, TOP_K, dim=-1).indices
        touched = ids.unique().numel()
        floor = touched * 3 * INTERMEDIATE * HIDDEN * 2 / bandwidth * 1e6
        print(f"tokens {tokens:3d}: {us:7.1f} us a layer, {touched:3d} experts read, "
              f"floor {floor:6.1f} us, ratio {us / floor:.2f}")


if __name__ == "__main__":
    main()
