"""Which RMSNorms between two projections the projections take themselves
(kernels/norm_seam.py), decided each forward: where the sublayer's last projection and the
next sublayer's first are plain projections (no LoRA wrapper around them) on one rank, the
first without a bias, and both matmuls have the seam for the step (one row: a batch-1
decode, through the 16-bit or the fp8 GEMV). The decoder layers ask only where the norm
between is Llama's (models/llama.py). A CUDA graph captures the choice with its batch size.
HEADRACE_NORM_SEAMS=0 keeps every norm its own kernel, to measure what the seams save."""

from __future__ import annotations

import os

import torch
from torch import nn

from services.worker.layers.linear import ColumnParallelLinear, RowParallelLinear

ENABLED = os.environ.get("HEADRACE_NORM_SEAMS", "1") != "0"


def seam_between(last: nn.Module, first: nn.Module, residual: torch.Tensor) -> bool:
    """Whether `last` adds its output to `residual` and `first` norms that sum as it loads
    it, for a step whose residual stream is `residual`."""
    return (ENABLED and residual.numel() == residual.shape[-1]  # one row
            and isinstance(last, RowParallelLinear) and isinstance(first, ColumnParallelLinear)
            and last.tp_size == 1 and last.bias is None
            and last.method.takes_seam(last, residual)
            and first.method.takes_seam(first, residual))
