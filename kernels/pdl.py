"""Programmatic dependent launch (Hopper and later): a decode step is a chain of small
kernels, each of which, launched plainly, starts only after the one before it has ended
and its launch has gone through the GPU's front end, a microsecond or two each, hundreds
of times a step. A kernel launched with PDL may be scheduled while the one before it is
still running its last programs: it opens with `overlap_previous`, which lets the next
kernel in turn be scheduled (gdc_launch_dependents) and then waits until everything the
previous kernel wrote is visible (gdc_wait), so it reads nothing early. CUDA graphs keep
these edges. HEADRACE_PDL=0 launches plainly (to measure what it saves).

PDL changes no token: with the start-up choice between the 16-bit GEMV and cuBLAS fixed
(services/worker/layers/gemv_choice.py), bf16 decode graphs give the same greedy tokens
with it and without it (benchmarks/issue31-h200/pdl8). An H200 run that seemed to show
otherwise compared two processes whose timings had chosen differently."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("HEADRACE_PDL", "1") != "0"


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel that takes PDL: tensor t's device decides."""
    if ENABLED and t.is_cuda and _supports_pdl(t.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def overlap_previous(PDL: tl.constexpr):
    """A PDL kernel's first statement: nothing before it may read another kernel's
    output."""
    let_next_start(PDL)
    wait_for_previous(PDL)


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """The first half of overlap_previous. Between it and wait_for_previous a kernel may
    read what no kernel of the chain writes, and those loads go out while the previous
    kernel ends: constants (weights, scales, a norm's weight, the rotary table) and the
    step's inputs (positions, slots, query starts, sequence lengths), which are copied in
    before the step's first kernel, a plain launch that no PDL kernel overtakes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """The second half: from here on, every other kernel's output is visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
