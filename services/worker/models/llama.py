"""The Llama decoder, shared by every supported architecture.

Variants differ only in flags: biases on the projections, per-head q/k RMSNorm (Qwen3),
tied embeddings (from the config), and in the MLP each layer gets (`make_mlp`: mixtures of
experts in models/moe.py). Mistral is the Llama architecture here: its sliding
window is not applied, so contexts longer than the window attend to every earlier token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from services.worker.layers.activation import SiluAndMul
from services.worker.layers.attention import Attention, ForwardContext
from services.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.worker.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.models.causal_lm import CausalLM, head_dim_of


@dataclass(frozen=True, slots=True)
class DecoderFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, flags: DecoderFlags, rotary_emb: RotaryEmbedding,
                 layer_idx: int) -> None:
        super().__init__()
        hidden_size, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
        total_heads = hf_config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, total_heads,
                                          hf_config.num_key_value_heads, bias=flags.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden_size, bias=flags.o_bias,
                                        reduce_results=flags.o_bias)
        self.rotary_emb = rotary_emb
        self.q_norm = RMSNorm(head_dim, hf_config.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(head_dim, hf_config.rms_norm_eps) if flags.qk_norm else None
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads,
                              layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, flags: DecoderFlags, intermediate_size: int | None = None
                 ) -> None:
        """intermediate_size: the config's unless given (Qwen2-MoE's shared expert)."""
        super().__init__()
        hidden_size = hf_config.hidden_size
        intermediate = intermediate_size or hf_config.intermediate_size
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only silu")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate] * 2,
                                                       bias=flags.mlp_bias)
        self.down_proj = RowParallelLinear(intermediate, hidden_size, bias=flags.mlp_bias,
                                           reduce_results=flags.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, flags: DecoderFlags, rotary_emb: RotaryEmbedding,
                 layer_idx: int, mlp: nn.Module) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        # a projection without a bias leaves its all-reduce to the norm after it
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, sums_ranks=not flags.mlp_bias)
        self.self_attn = LlamaAttention(hf_config, flags, rotary_emb, layer_idx)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps,
                                                sums_ranks=not flags.o_bias)
        self.mlp = mlp  # LlamaMLP, or a mixture of experts (models/moe.py)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


MLPFactory = Callable[[object, DecoderFlags, int], nn.Module]


class LlamaModel(nn.Module):
    def __init__(self, hf_config, flags: DecoderFlags, make_mlp: MLPFactory) -> None:
        """make_mlp(hf_config, flags, layer_idx): each layer's MLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # one cos/sin cache shared by every layer
        rotary_emb = RotaryEmbedding.from_config(hf_config, head_dim_of(hf_config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, flags, rotary_emb, i, make_mlp(hf_config, flags, i))
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps,
                            sums_ranks=not flags.mlp_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.model = LlamaModel(hf_config, self.decoder_flags(hf_config), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tied)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.head_dim = head_dim_of(hf_config)
        self.hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias,
                            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))

    @staticmethod
    def make_mlp(hf_config, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return LlamaMLP(hf_config, flags)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with Mistral's config; the sliding window is not applied (see module doc)."""
