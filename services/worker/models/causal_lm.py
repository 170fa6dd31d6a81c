"""What every model offers the worker: a forward over a varlen batch and the logits."""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
from torch import nn

from services.worker.layers.attention import ForwardContext
from services.worker.layers.embedding import ParallelLMHead


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)


class CausalLM(nn.Module, abc.ABC):
    # checkpoint module name -> (our fused module name, shard id of its weight_loader)
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {}
    # a mixture of experts' per-expert checkpoint module (`experts.{e}.<name>`) -> (the
    # stacked parameter of our `experts` module, the part it fills); the shard id is
    # (e, part)
    expert_weights: ClassVar[dict[str, tuple[str, str]]] = {}
    # checkpoint module names that are another module of ours (Mixtral's MLP block)
    module_renames: ClassVar[dict[str, str]] = {}

    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    lm_head: ParallelLMHead

    # a vision-language model: takes images' embeddings and three positions per token
    multimodal: ClassVar[bool] = False
    mrope: ClassVar[bool] = False  # three positions per token (Qwen2-VL's M-RoPE)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The checkpoint's name for a tensor, in this model's naming (older layouts)."""
        return name

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden_size]. On a
        pipeline stage (layers/pipeline.py) after the first, `hidden` is the residual
        stream the stage before sent; a stage before the last returns its own."""

    def stage_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter name on this pipeline stage; None where another
        stage holds it. A whole model holds every tensor."""
        return name

    def checkpoint_name(self, param_name: str) -> str:
        """The checkpoint tensor a parameter is drawn as by dummy weights."""
        return param_name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 [N, vocab_size]."""
        return self.lm_head(hidden)

    @property
    def float_logits_only(self) -> bool:
        """Whether something follows the lm_head (Gemma's soft cap, in a compute_logits
        of its own), so that the model's logits are compute_logits's float32 only."""
        return type(self).compute_logits is not CausalLM.compute_logits

    def greedy_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] logits for an argmax or the top-logprobs
        kernel, which reads each value into float32: the lm_head's own where nothing
        follows it, so that compute_logits's float32 copy is not made. Both give the same
        tokens and logprobs on either, exactly (a bf16 value is a float32 one); the copy
        took 112 us of a 256-row decode step of Qwen3's vocabulary on an H200
        (benchmarks/issue31-h200/busy14)."""
        return self.compute_logits(hidden) if self.float_logits_only \
            else self.lm_head.logits(hidden)
