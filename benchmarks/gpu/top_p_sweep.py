"""Top-p at a decode step's batch sizes, 151,936 columns (Qwen3's vocabulary): the
threshold search (kernels/sampling.py, one program a row), the radix select (rows split
across programs, exact fixed-point masses) and a full sort and cumulative sum (the path
apply_top_p takes with `ordered`), each replayed in a CUDA graph, and whether each keeps
the tokens of the exact twin (top_p_threshold_exact_ref). Softmax of randn * 3 logits at
top_p 0.95, then flat rows (every probability tied: all of a round's atomics on one bin)
for the radix select's worst case. services/worker/sampler.py's dispatch comes from this.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/top_p_sweep.py [--variants]

--variants also times the radix select at other round widths, program counts and copies
of the bins.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.sampling import (top_p_threshold_exact_ref, top_p_threshold_radix,
                              top_p_threshold_triton)

VOCAB = 151936
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FLAT_ROWS = (1, 8, 128, 256)
# (round bits, programs, copies of the bins)
VARIANTS = [((10, 10, 10), 512, 1), ((10, 10, 10), 512, 4), ((8, 8, 8, 6), 512, 8)]

Threshold = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kept(threshold: Threshold) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def apply(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return probs.masked_fill(probs < threshold(probs, top_p).unsqueeze(1), 0.0)
    return apply


def sorted_(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered = probs.sort(dim=-1, descending=True).values
    before = (ordered.cumsum(dim=-1) < top_p.unsqueeze(1)).sum(dim=-1)
    kept = torch.where(top_p < 1.0, before + 1, ordered.shape[1]).clamp_max(ordered.shape[1])
    return probs.masked_fill(probs < ordered.gather(1, (kept - 1).unsqueeze(1)), 0.0)


PATHS = {"search": kept(top_p_threshold_triton), "sort": sorted_,
         "radix": kept(top_p_threshold_radix)}


def measure(probs: torch.Tensor, top_p: torch.Tensor, paths: dict) -> str:
    exact = kept(top_p_threshold_exact_ref)(probs, top_p) > 0
    times = ", ".join(f"{name} {graph_us(lambda: path(probs, top_p)):7.1f} us"
                      for name, path in paths.items())
    same = " ".join(f"{name} {torch.equal(path(probs, top_p) > 0, exact)}"
                    for name, path in paths.items())
    return f"{times}; tokens of the exact twin kept: {same}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", action="store_true")
    variants = parser.parse_args().variants
    paths = dict(PATHS)
    if variants:
        for bits, programs, copies in VARIANTS:
            def radix(probs: torch.Tensor, top_p: torch.Tensor, bits=bits, programs=programs,
                      copies=copies) -> torch.Tensor:
                return top_p_threshold_radix(probs, top_p, bits, programs, copies)
            paths[f"radix{bits}/{programs}/{copies}"] = kept(radix)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, device="cuda", generator=generator) * 3
        probs = torch.softmax(logits, dim=-1)
        top_p = torch.full((rows,), 0.95, device="cuda")
        assert torch.equal(top_p_threshold_radix(probs, top_p),
                           top_p_threshold_exact_ref(probs, top_p))
        print(f"rows {rows:4d}: {measure(probs, top_p, paths)}", flush=True)
    for rows in FLAT_ROWS:
        probs = torch.full((rows, VOCAB), 1.0 / VOCAB, device="cuda")
        top_p = torch.full((rows,), 0.95, device="cuda")
        print(f"flat rows {rows:4d}: {measure(probs, top_p, paths)}", flush=True)


if __name__ == "__main__":
    main()
