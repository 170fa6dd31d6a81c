"""Mixture-of-experts models: the Llama decoder (attention, norms, rotary) with a sparse
MLP block in its layers. Mixtral routes every layer; Qwen2-MoE and Qwen3-MoE keep dense
MLPs in `mlp_only_layers` and off the `decoder_sparse_step` stride, and Qwen2-MoE adds a
gated shared expert to the routed output.

Checkpoints store each expert's projections apart (`experts.{e}.w1` or `.gate_proj`);
`expert_weights` routes them into FusedMoE's stacked tensors (see loader.route).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.moe import FusedMoE, ReplicatedLinear
from services.worker.models.llama import DecoderFlags, LlamaForCausalLM, LlamaMLP
from services.worker.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM


class SparseMoeBlock(nn.Module):
    """Router (`gate`), routed experts, and optionally a shared expert scaled by
    sigmoid(shared_expert_gate(x)). The output is this rank's partial sum: the shared
    expert's down projection, like the experts', leaves the reduction to the next norm.
    On one rank without a shared expert it leaves the top-k sum to that norm too: the
    output is the k weighted terms [T, k, H] (kernels/norm.py adds them up in its load),
    which saves a launch a layer at decode."""

    def __init__(self, hf_config, flags: DecoderFlags, num_experts: int,
                 intermediate_size: int, renormalize: bool, round_weights: bool,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only silu")
        hidden_size = hf_config.hidden_size
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hf_config.num_experts_per_tok, hidden_size,
                                intermediate_size, renormalize, round_weights)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(hf_config, flags, shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        self.sum_slots = self.shared_expert is not None or self.experts.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x), self.sum_slots)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    """Qwen MoE's rule (transformers' Qwen2MoeDecoderLayer): experts unless the layer is
    listed dense or falls off the sparse stride."""
    return (layer_idx not in (hf_config.mlp_only_layers or [])
            and hf_config.num_experts > 0
            and (layer_idx + 1) % hf_config.decoder_sparse_step == 0)


QWEN_EXPERT_WEIGHTS = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"),
                       "down_proj": ("w2", "down")}


class MixtralForCausalLM(LlamaForCausalLM):
    """Every layer routed; the top-k weights renormalised and kept in float32. A sliding
    window in the config applies to every layer, as Mistral's does."""
    expert_weights = {"w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", "down")}
    module_renames = {"block_sparse_moe": "mlp"}

    @staticmethod
    def make_mlp(hf_config, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(hf_config, flags, hf_config.num_local_experts,
                              hf_config.intermediate_size, renormalize=True,
                              round_weights=False)


def qwen_moe_mlp(hf_config, flags: DecoderFlags, layer_idx: int,
                 shared_intermediate_size: int = 0) -> nn.Module:
    """A Qwen MoE layer's MLP: dense off the sparse layers, else routed experts (top-k
    renormalised by norm_topk_prob, rounded to the model's dtype) and any shared expert."""
    if not is_sparse_layer(hf_config, layer_idx):
        return LlamaMLP(hf_config, flags)
    return SparseMoeBlock(hf_config, flags, hf_config.num_experts,
                          hf_config.moe_intermediate_size,
                          renormalize=bool(hf_config.norm_topk_prob), round_weights=True,
                          shared_intermediate_size=shared_intermediate_size)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3's attention; top-k weights renormalised by `norm_topk_prob`, then rounded
    to the model's dtype."""
    expert_weights = QWEN_EXPERT_WEIGHTS

    @staticmethod
    def make_mlp(hf_config, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(hf_config, flags, layer_idx)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2's attention (q/k/v biases by `qkv_bias`); routed experts as Qwen3-MoE's plus
    the gated shared expert."""
    expert_weights = QWEN_EXPERT_WEIGHTS

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))

    @staticmethod
    def make_mlp(hf_config, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(hf_config, flags, layer_idx,
                            hf_config.shared_expert_intermediate_size)
