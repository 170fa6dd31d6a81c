"""The worker service: its core (state and decisions, no I/O) and its asyncio shell.

What code outside the services (benchmarks/) may use is defined here; the modules behind
it may change shape."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors, (name, tensor) pairs named as in a transformers checkpoint,
    into a model the worker built (the engine's `runner.model`), through the same loader
    that reads checkpoint files: fused and sharded parameters are filled as at start-up.
    Raises ValueError for a tensor with no parameter or a parameter left without one."""
    # Imported here: this package's __init__ runs before any of its modules, and the
    # loader imports the models and layers, which must not all load for each one of them.
    from services.worker.loader import load_weights as load_into
    load_into(model, weights)


def to_device_together(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Int64 and int32 arrays on `device` in one copy, each a tensor of its dtype and
    shape: how the worker sends a step's inputs (benchmarks/gpu/input_copies.py times it)."""
    from services.worker.inputs import to_device_together as copy_together
    return copy_together(arrays, device)


def decode_step_preparer(rows: int, logprobs: int | None = None) -> Callable[[], object]:
    """A call prepares, on the CPU, the inputs of a made-up decode step of `rows` greedy
    requests (each with `logprobs`) whose tokens are all still in flight, as the step
    thread does before each launch (`headrace bench inputs` times it)."""
    from services.worker.synthetic_step import decode_step_preparer as preparer
    return preparer(rows, logprobs)
