"""Which unquantized projections take the 16-bit GEMV (kernels/gemv.py) for decode-sized
steps instead of cuBLAS, decided once when the worker starts (model_runner.py): before any
CUDA graph is captured, since a graph replays the kernel each layer took at capture.
Eager workers (--enforce-eager) never ask: their steps are bound by the host, where a
Triton launch costs more than cuBLAS's.

Per distinct weight shape on the device (N, K, dtype: a tensor-parallel rank's shard) both
are timed in a CUDA graph at one row (the kernel's CUDA-core path) and at GEMV_MAX_ROWS
rows (its tensor-core path, about as fast at 2 rows as at 16: x is padded to 16 rows). A
timing cycles through the model's layers of that shape, as a decode step streams them,
so that L2 holds none of their weights. The layers take the kernel for the row counts at
which it was faster (`layer.gemv_rows`), cuBLAS for the rest; the choice is kept per shape
for the process (a draft model's projections of the same shape reuse it) and logged once.
CPU layers, float32 weights, quantized and LoRA projections (which run their own matmuls)
are left alone. A MoE router (layers/moe.py's ReplicatedLinear) is timed as the projections
are.

The two round differently, and timings close to each other may fall either way from one
start to the next, so a server's greedy tokens can change across restarts where two
candidates tie to a bf16 step (benchmarks/issue31-h200/pdl8). HEADRACE_GEMV=cublas keeps
cuBLAS everywhere (eager steps' numerics), =gemv takes the kernel at every decode-sized row
count; both skip the timing."""

from __future__ import annotations

import itertools
import logging
import os
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemv import GEMV_MAX_ROWS, gemv
from kernels.graph_timing import graph_us
from services.worker.layers.linear import LinearBase
from services.worker.layers.moe import ReplicatedLinear
from services.worker.layers.quantization import UnquantizedMethod

ShapeKey = tuple[int, int, torch.dtype, torch.device]
TIMED_CALLS = 16  # calls a timing graph holds: 16 x 19 MB (Phi-3's o_proj) passes the L2
GEMV_ENV = "HEADRACE_GEMV"
FIXED_ROWS = {"cublas": range(0), "gemv": range(1, GEMV_MAX_ROWS + 1)}
log = logging.getLogger("headrace.worker.gemv")
_CHOSEN: dict[ShapeKey, range] = {}


def choose_gemv(model: nn.Module) -> None:
    """Sets gemv_rows on each unquantized CUDA projection of 16-bit weights."""
    fixed = fixed_rows(os.environ.get(GEMV_ENV, "timed"))
    if fixed is not None:
        log.info("gemv: %s=%s: the kernel at %s", GEMV_ENV, os.environ[GEMV_ENV],
                 f"rows {fixed.start}-{fixed.stop - 1}" if fixed else "no rows")
    for key, layers in shape_groups(model).items():
        if fixed is None and key not in _CHOSEN:
            _CHOSEN[key] = rows_for(layers)
        for layer in layers.values():
            layer.gemv_rows = _CHOSEN[key] if fixed is None else fixed


def fixed_rows(choice: str) -> range | None:
    """HEADRACE_GEMV's rows for the kernel, None for the timing's."""
    if choice == "timed":
        return None
    if choice not in FIXED_ROWS:
        raise ValueError(f"{GEMV_ENV}={choice!r}: timed, cublas or gemv")
    return FIXED_ROWS[choice]


def shape_groups(model: nn.Module) -> dict[ShapeKey, dict[str, nn.Module]]:
    groups: dict[ShapeKey, dict[str, nn.Module]] = defaultdict(dict)
    for name, module in model.named_modules():
        if (isinstance(module, (LinearBase, ReplicatedLinear))
                and isinstance(module.method, UnquantizedMethod) and module.weight.is_cuda
                and module.weight.dtype in (torch.bfloat16, torch.float16)):
            weight = module.weight
            groups[(*weight.shape, weight.dtype, weight.device)][name] = module
    return groups


def rows_for(layers: dict[str, nn.Module]) -> range:
    """Times both ways over these layers (one shape) at 1 and GEMV_MAX_ROWS rows; the rows
    the kernel takes."""
    first = next(iter(layers.values()))
    n, k = first.weight.shape
    one, more = (time_both(layers, rows) for rows in (1, GEMV_MAX_ROWS))
    rows = range(1 if one[0] < one[1] else 2, GEMV_MAX_ROWS + 1 if more[0] < more[1] else 2)
    names = ", ".join(sorted({name.rpartition(".")[2] for name in layers}))
    taken = f"rows {rows.start}-{rows.stop - 1}" if rows else "no rows"
    log.info("gemv: %s %dx%d %s: 1 row %.1f us vs cuBLAS %.1f us, %d rows %.1f vs %.1f us: "
             "the kernel at %s", names, n, k, str(first.weight.dtype).removeprefix("torch."),
             *one, GEMV_MAX_ROWS, *more, taken)
    return rows


def time_both(layers: dict[str, nn.Module], rows: int) -> tuple[float, float]:
    """Microseconds a call of the kernel and of cuBLAS, x of `rows` rows, each call the
    next layer's weight and bias."""
    first = next(iter(layers.values()))
    x = torch.randn(rows, first.weight.shape[1], dtype=first.weight.dtype,
                    device=first.weight.device)
    pairs = [(layer.weight, layer.bias if layer.bias_in_matmul else None)
             for layer in itertools.islice(itertools.cycle(layers.values()), TIMED_CALLS)]

    def timed(matmul: Callable[..., torch.Tensor]) -> float:
        cycle = itertools.cycle(pairs)
        return graph_us(lambda: matmul(x, *next(cycle)), calls=TIMED_CALLS, replays=10)

    return timed(gemv), timed(F.linear)
