"""Phi-3: the Llama decoder over checkpoints that store q/k/v and gate/up already fused;
the fused layers' loaders split those tensors into their shards (layers/linear.py), so
tensor parallelism is as for Llama. Its sliding window (e.g. 2047 in Phi-3 mini 4k)
covers every layer; longrope (Phi-3 128k) and a partial_rotary_factor (Phi-4-mini) come
from the rotary layer."""

from __future__ import annotations

from typing import ClassVar

from services.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # the checkpoint's qkv_proj and gate_up_proj are our parameters' names already
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {}

