"""The gated activation of Llama-style MLPs, from the config's name (transformers' ACT2FN
names) to the kernels' (kernels/activation.py). The down projection takes the [gate; up]
output with this name and applies it itself: a decode GEMV as it reads its input, other
paths with the activation kernel first."""

from __future__ import annotations

KERNEL_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def gated_activation(name: str) -> str:
    if name not in KERNEL_ACTS:
        raise ValueError(f"unsupported MLP activation {name!r}; supported: "
                         f"{', '.join(KERNEL_ACTS)}")
    return KERNEL_ACTS[name]
