"""Top-p at a decode step's batch sizes, 151,936 columns (Qwen3's vocabulary): the
threshold search (kernels/sampling.py, one program a row) against a full sort and
cumulative sum (the path apply_top_p takes with `ordered`), each replayed in a CUDA graph,
and whether the two keep the same tokens. services/worker/sampler.py's SORTED_TOP_P_ROWS
comes from this.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/top_p_sweep.py
"""

from __future__ import annotations

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.sampling import top_p_threshold_triton

VOCAB = 151936
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def searched(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return probs.masked_fill(probs < top_p_threshold_triton(probs, top_p).unsqueeze(1), 0.0)


def sorted_(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered = probs.sort(dim=-1, descending=True).values
    before = (ordered.cumsum(dim=-1) < top_p.unsqueeze(1)).sum(dim=-1)
    kept = torch.where(top_p < 1.0, before + 1, ordered.shape[1]).clamp_max(ordered.shape[1])
    return probs.masked_fill(probs < ordered.gather(1, (kept - 1).unsqueeze(1)), 0.0)


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, device="cuda", generator=generator) * 3
        probs = torch.softmax(logits, dim=-1)
        top_p = torch.full((rows,), 0.95, device="cuda")
        same = torch.equal(searched(probs, top_p) > 0, sorted_(probs, top_p) > 0)
        search_us = graph_us(lambda: searched(probs, top_p))
        sort_us = graph_us(lambda: sorted_(probs, top_p))
        print(f"rows {rows:4d}: search {search_us:7.1f} us, sort {sort_us:7.1f} us, "
              f"same tokens kept: {same}", flush=True)


if __name__ == "__main__":
    main()
