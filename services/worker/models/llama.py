"""The Llama decoder, shared by every supported architecture.

Variants differ only in flags: biases on the projections, per-head q/k RMSNorm (Qwen3,
Gemma 3), Gemma's norm weighting, its extra norms around each sublayer and its scaled
embedding. The rest comes from the config as it is: tied embeddings, the MLP activation,
each layer's sliding window (common.model_files.sliding_windows) and rotary parameters
(per layer type where they differ), the attention scale (`query_pre_attn_scalar`) and the
attention logit soft cap; and from the model class, the MLP each layer gets (`make_mlp`:
mixtures of experts in models/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from common.model_files import sliding_windows
from kernels.attention_inputs import HeadNorms
from kernels.norm import sum_parts
from kernels.norm_seam import ResidualSum, SeamNorm
from services.worker.layers.activation import gated_activation
from services.worker.layers.attention import Attention, ForwardContext
from services.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.worker.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from services.worker.layers.norm import RMSNorm, norm_add_norm
from services.worker.layers.norm_seam import seam_between
from services.worker.layers.parallel import current_group
from services.worker.layers.pipeline import current_stage
from services.worker.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from services.worker.models.causal_lm import CausalLM, head_dim_of


@dataclass(frozen=True, slots=True)
class DecoderFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    gemma_norm: bool = False       # every RMSNorm weighs by (1 + weight) in float32
    sandwich_norms: bool = False   # norms after attention and after the MLP too (Gemma 2/3)
    scale_embedding: bool = False  # embeddings times sqrt(hidden_size) (Gemma)

    @property
    def attn_reduces(self) -> bool:
        """o_proj all-reduces itself: for its bias, or for the norm that takes its output
        alone; otherwise the next norm fuses the reduction with the residual add."""
        return self.o_bias or self.sandwich_norms

    @property
    def mlp_reduces(self) -> bool:
        return self.mlp_bias or self.sandwich_norms


def attention_scale(hf_config) -> float:
    """Gemma scales scores by query_pre_attn_scalar ** -0.5, the others by head_dim's."""
    scalar = getattr(hf_config, "query_pre_attn_scalar", None) or head_dim_of(hf_config)
    return scalar ** -0.5


def activation_name(hf_config) -> str:
    """Gemma's configs name the MLP activation `hidden_activation`."""
    return getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act",
                                                                    "silu")


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, flags: DecoderFlags, rotary_emb: RotaryEmbedding,
                 layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        hidden_size, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
        total_heads = hf_config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, total_heads,
                                          hf_config.num_key_value_heads, bias=flags.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden_size, bias=flags.o_bias,
                                        reduce_results=flags.attn_reduces)
        self.rotary_emb = rotary_emb
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(head_dim, eps, gemma=flags.gemma_norm) if flags.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, gemma=flags.gemma_norm) if flags.qk_norm else None
        self.attn = Attention(self.num_heads, head_dim, attention_scale(hf_config),
                              self.num_kv_heads, layer_idx, sliding_window=sliding_window,
                              soft_cap=getattr(hf_config, "attn_logit_softcapping", None))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | SeamNorm,
                ctx: ForwardContext, add_to: torch.Tensor | None = None
                ) -> torch.Tensor | ResidualSum:
        """add_to: the residual stream, which o_proj then adds its output to (a norm
        seam, layers/norm_seam.py); hidden a SeamNorm: qkv_proj norms it."""
        qkv = self.qkv_proj(hidden)
        if self.attn.calculate_scales or positions.dim() > 1:
            # the fp8 scales need k and v before the write; M-RoPE's three positions a token
            # take their own rotary
            out = self.separate_ops(positions, qkv, ctx)
        else:
            norms = None
            if self.q_norm is not None:
                norms = HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                  self.q_norm.gemma)
            out = self.attn(qkv, None, None, ctx, positions, self.rotary_emb.cos_sin_cache,
                            norms)
        return self.o_proj(out) if add_to is None else self.o_proj.add_to(out, add_to)

    def separate_ops(self, positions: torch.Tensor, qkv: torch.Tensor,
                     ctx: ForwardContext) -> torch.Tensor:
        """The attention with its q/k norms, rotary and cache write as separate ops."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, ctx)


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, flags: DecoderFlags, intermediate_size: int | None = None
                 ) -> None:
        """intermediate_size: the config's unless given (Qwen2-MoE's shared expert)."""
        super().__init__()
        hidden_size = hf_config.hidden_size
        intermediate = intermediate_size or hf_config.intermediate_size
        self.act_fn = gated_activation(activation_name(hf_config))
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate] * 2,
                                                       bias=flags.mlp_bias)
        self.down_proj = RowParallelLinear(intermediate, hidden_size, bias=flags.mlp_bias,
                                           reduce_results=flags.mlp_reduces)

    def forward(self, x: torch.Tensor | SeamNorm, add_to: torch.Tensor | None = None
                ) -> torch.Tensor | ResidualSum:
        """add_to and a SeamNorm x: LlamaAttention.forward's, for down_proj and
        gate_up_proj."""
        act = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(act) if add_to is None else self.down_proj.add_to(act, add_to)


class LlamaDecoderLayer(nn.Module):
    """With sandwich norms (Gemma's names): input_layernorm, attention,
    post_attention_layernorm, residual add, pre_feedforward_layernorm, MLP,
    post_feedforward_layernorm, residual add. Without, post_attention_layernorm is the
    norm before the MLP.

    Gemma's norm, add, norm seams run as one kernel each (layers/norm.norm_add_norm): the
    one after attention here, and the one between layers by leaving this layer's
    post_feedforward_layernorm to whoever takes its output next (`pending`: the next
    layer's input norm, or LlamaModel's final norm)."""

    def __init__(self, hf_config, flags: DecoderFlags, rotary_emb: RotaryEmbedding,
                 layer_idx: int, sliding_window: int | None, mlp: nn.Module) -> None:
        super().__init__()
        eps, size, gemma = hf_config.rms_norm_eps, hf_config.hidden_size, flags.gemma_norm
        # a projection that does not all-reduce leaves it to the norm after it
        self.input_layernorm = RMSNorm(size, eps, sums_ranks=not flags.mlp_reduces,
                                       gemma=gemma)
        self.self_attn = LlamaAttention(hf_config, flags, rotary_emb, layer_idx,
                                        sliding_window)
        self.post_attention_layernorm = RMSNorm(size, eps, sums_ranks=not flags.attn_reduces,
                                                gemma=gemma)
        self.sandwich_norms = flags.sandwich_norms
        if flags.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, gemma=gemma)
            self.post_feedforward_layernorm = RMSNorm(size, eps, gemma=gemma)
        self.mlp = mlp  # LlamaMLP, or a mixture of experts (models/moe.py)
        # the projections that end each sublayer feed a norm alone (this layer's, the next
        # layer's or the model's), which adds up a split K's partial sums where they leave
        # it (RowParallelLinear.leave_parts_to_norm)
        self.self_attn.o_proj.leave_parts_to_norm()
        if isinstance(mlp, LlamaMLP):
            mlp.down_proj.leave_parts_to_norm()
        # whether the projections may take the norms after o_proj and down_proj themselves
        # (layers/norm_seam.py): Llama's norms, a dense MLP; LlamaModel sets the next layer
        self.seams = isinstance(mlp, LlamaMLP) and not (gemma or flags.sandwich_norms)
        # in a tuple, so that it is no submodule of this one; its qkv_proj is looked up at
        # each forward, since a LoRA wrapper may take its place after the model is built
        self.next_layer: tuple[LlamaDecoderLayer, ...] = ()

    @property
    def pending_norm(self) -> RMSNorm | None:
        """The norm this layer's output still needs before its residual add."""
        return self.post_feedforward_layernorm if self.sandwich_norms else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | ResidualSum,
                residual: torch.Tensor | None, ctx: ForwardContext,
                pending: RMSNorm | None = None
                ) -> tuple[torch.Tensor | ResidualSum, torch.Tensor | None]:
        """pending: the previous layer's pending_norm, applied to hidden before the add.
        hidden a ResidualSum (residual None): the layer before added its output to the
        residual stream, and this layer's qkv_proj takes the input norm. This layer returns
        one where its down_proj and the next layer's qkv_proj take the norm between."""
        if isinstance(hidden, ResidualSum):
            hidden, residual = self.input_layernorm.seam(hidden), hidden.total
        elif residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        elif pending is not None:
            hidden, residual = norm_add_norm(hidden, residual, pending, self.input_layernorm)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.sandwich_norms:
            hidden = self.self_attn(positions, hidden, ctx)
            hidden, residual = norm_add_norm(hidden, residual, self.post_attention_layernorm,
                                             self.pre_feedforward_layernorm)
            return self.mlp(hidden), residual  # post_feedforward_layernorm: pending_norm
        if self.seams and seam_between(self.self_attn.o_proj, self.mlp.gate_up_proj,
                                       residual):
            summed = self.self_attn(positions, hidden, ctx, add_to=residual)
            hidden, residual = self.post_attention_layernorm.seam(summed), summed.total
        else:
            hidden = self.self_attn(positions, hidden, ctx)
            hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.next_layer and seam_between(self.mlp.down_proj,
                                            self.next_layer[0].self_attn.qkv_proj, residual):
            return self.mlp(hidden, add_to=residual), None
        return self.mlp(hidden), residual


def rotary_by_layer(hf_config) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one cos/sin cache shared by every layer, or one per
    layer type where `rope_parameters` is nested by type (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    layer_types = getattr(hf_config, "layer_types", None) or \
        [None] * hf_config.num_hidden_layers
    keys = [kind if kind in params else None for kind in layer_types]
    # Qwen2-VL's decoder: three positions per token (services/worker/models/qwen2_vl.py)
    cls = MRotaryEmbedding if "mrope_section" in params else RotaryEmbedding
    caches = {key: cls.from_config(hf_config, head_dim_of(hf_config), key)
              for key in dict.fromkeys(keys)}
    return [caches[key] for key in keys]


MLPFactory = Callable[[object, DecoderFlags, int], nn.Module]


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights, keeps the layers' names."""


class LlamaModel(nn.Module):
    """The stage's part of the decoder (layers/pipeline.py): the embedding on the first
    stage, the final norm on the last, and its own layers, the others MissingLayer."""

    def __init__(self, hf_config, flags: DecoderFlags, make_mlp: MLPFactory) -> None:
        """make_mlp(hf_config, flags, layer_idx): each layer's MLP."""
        super().__init__()
        self.stage, self.tp = current_stage(), current_group()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size) \
            if self.stage.is_first else None
        # rounded to the activation dtype (the default one while the model is built), as
        # transformers multiplies by a tensor of that dtype
        self.embed_scale = float(torch.tensor(hf_config.hidden_size ** 0.5, device="cpu")) \
            if flags.scale_embedding else None
        windows = sliding_windows(hf_config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, flags, rotary, i, windows[i],
                              make_mlp(hf_config, flags, i))
            if self.stage.holds(i) else MissingLayer()
            for i, rotary in enumerate(rotary_by_layer(hf_config)))
        self.own_layers = [layer for layer in self.layers
                           if not isinstance(layer, MissingLayer)]
        for layer, after in zip(self.own_layers, self.own_layers[1:]):
            if layer.seams and after.seams:
                layer.next_layer = (after,)
        self.partial_output = not flags.mlp_reduces  # each rank's share of a sum
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps,
                            sums_ranks=not flags.mlp_reduces, gemma=flags.gemma_norm) \
            if self.stage.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, hidden: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: the residual stream the stage before sent (every stage but the first).
        The last stage returns the final hidden states, the others the residual stream.
        inputs_embeds: the embeddings to run instead of input_ids' (a vision-language
        model's, with its images' rows merged in), already scaled where Gemma scales
        (Gemma 3 scales its text rows only)."""
        if inputs_embeds is not None:
            hidden = inputs_embeds
        elif self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        assert hidden is not None, "a stage after the first takes the hidden states sent"
        residual, pending = None, None
        for layer in self.own_layers:
            hidden, residual = layer(positions, hidden, residual, ctx, pending)
            pending = layer.pending_norm
        if self.norm is None:
            if pending is not None:
                hidden = pending(hidden)
            hidden = sum_parts(hidden, residual)  # a MoE layer's unsummed top-k terms
            return (self.tp.all_reduce(hidden) if self.partial_output else hidden) + residual
        if pending is not None:
            return norm_add_norm(hidden, residual, pending, self.norm)[0]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.model = LlamaModel(hf_config, self.decoder_flags(hf_config), self.make_mlp)
        self.stage = self.model.stage
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.stage.is_last:  # tied to an embedding on this stage, or its own weight
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                          self.model.embed_tokens
                                          if self.tie_word_embeddings else None)
        self.num_layers = len(self.model.own_layers)
        self.num_kv_heads = self.model.own_layers[0].self_attn.num_kv_heads
        self.head_dim = head_dim_of(hf_config)
        self.hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size

    def stage_name(self, name: str) -> str | None:
        """A checkpoint tensor's name on this pipeline stage, None where another stage
        holds it. A last stage without the embedding loads a tied LM head from it."""
        stage = self.stage
        if stage.size == 1:
            return name
        if name.startswith("model.layers."):
            return name if stage.holds(int(name.split(".")[2])) else None
        if name.startswith("model.embed_tokens."):
            if stage.is_first:
                return name
            return "lm_head." + name.partition("model.embed_tokens.")[2] \
                if stage.is_last and self.tie_word_embeddings else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if stage.is_last else None
        return name

    def checkpoint_name(self, param_name: str) -> str:
        """The checkpoint tensor a parameter is drawn as (dummy weights): the embedding
        for a tied LM head that has its own weight on a stage without the embedding."""
        if param_name.startswith("lm_head.") and self.tie_word_embeddings:
            return "model.embed_tokens." + param_name.partition("lm_head.")[2]
        return param_name

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias,
                            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))

    @staticmethod
    def make_mlp(hf_config, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return LlamaMLP(hf_config, flags)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, ctx, hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with Mistral's config: v0.1's sliding window applies to every layer."""
