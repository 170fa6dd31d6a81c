"""LLaVA (LlavaForConditionalGeneration): a CLIP vision transformer's patch features,
projected by a two-layer MLP, replace the image placeholder tokens' embeddings before the
Llama decoder.

Each image is one fixed-size crop (the image processor's crop_size); its tokens are the
hidden states of its patches (the class token dropped: vision_feature_select_strategy
"default") after `vision_feature_layer` of the encoder's layers (-2: all but the last,
which therefore never runs). Positions are the decoder's usual ones. As in Qwen2-VL, the
tower is whole on every tensor-parallel rank (models/qwen2_vl.py's Whole layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from services.worker.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from services.worker.models.qwen2_vl import (VisionLanguageLM, Whole, WholeLayerNorm,
                                             WholeLinear, WholeMerged, attach_whole_loaders)


class WholeConv2d(Whole, nn.Conv2d):
    pass


class WholeEmbedding(Whole, nn.Embedding):
    pass


class CLIPEmbeddings(Whole, nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.patch_embedding = WholeConv2d(c.num_channels, c.hidden_size, c.patch_size,
                                           stride=c.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size))
        self.position_embedding = WholeEmbedding((c.image_size // c.patch_size) ** 2 + 1,
                                                 c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, H, W] (the config's image_size) -> [N, 1 + patches, dim]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv_proj = WholeMerged(dim, dim, ("q", "k", "v"))
        self.out_proj = WholeLinear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = (t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))


class CLIPMLP(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.fc1 = WholeLinear(c.hidden_size, c.intermediate_size)
        self.fc2 = WholeLinear(c.intermediate_size, c.hidden_size)
        self.act = ACT2FN[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(c.hidden_size, c.num_attention_heads)
        self.layer_norm1 = WholeLayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = CLIPMLP(c)
        self.layer_norm2 = WholeLayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(c) for _ in range(c.num_hidden_layers))


class CLIPVisionTransformer(nn.Module):
    """Checkpoint names: vision_tower.* or vision_tower.vision_model.*; post_layernorm
    loads but, as the layers past the feature layer, never runs."""

    def __init__(self, c) -> None:
        super().__init__()
        self.embeddings = CLIPEmbeddings(c)
        self.pre_layrnorm = WholeLayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.encoder = CLIPEncoder(c)
        self.post_layernorm = WholeLayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def features(self, pixels: torch.Tensor, num_layers: int) -> torch.Tensor:
        """The hidden states after the first `num_layers` encoder layers."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers[:num_layers]:
            x = layer(x)
        return x


class LlavaProjector(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        vision, text = hf_config.vision_config.hidden_size, hf_config.hidden_size
        self.linear_1 = WholeLinear(vision, text, bias=hf_config.multimodal_projector_bias)
        self.act = ACT2FN[hf_config.projector_hidden_act]
        self.linear_2 = WholeLinear(text, text, bias=hf_config.multimodal_projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaModel(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        self.vision_tower = CLIPVisionTransformer(hf_config.vision_config)
        self.multi_modal_projector = LlavaProjector(hf_config)
        attach_whole_loaders(self.vision_tower)
        attach_whole_loaders(self.multi_modal_projector)
        flags = LlamaForCausalLM.decoder_flags(hf_config)
        self.language_model = LlamaModel(hf_config, flags,
                                         lambda cfg, fl, i: LlamaMLP(cfg, fl))


class LlavaForConditionalGeneration(VisionLanguageLM):

    def __init__(self, hf_config) -> None:
        super().__init__()
        vision = hf_config.vision_config
        strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        layer = getattr(hf_config, "vision_feature_layer", -2)
        if strategy != "default" or not isinstance(layer, int):
            raise ValueError("LLaVA is built for vision_feature_select_strategy 'default' "
                             f"and one vision_feature_layer; got {strategy!r}, {layer!r}")
        self.model = LlavaModel(hf_config)
        # hidden_states[layer] of the tower: its input is entry 0
        self.feature_layers = layer if layer >= 0 else vision.num_hidden_layers + 1 + layer
        self.build_head(hf_config)
        self.image_size, self.channels = vision.image_size, vision.num_channels
        self.patch_dim = vision.num_channels * vision.patch_size ** 2

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Our names for the layouts LLaVA checkpoints come in (transformers 5 writes the
        Hub's: vision_tower.*, multi_modal_projector.*, language_model.model.*,
        language_model.lm_head; its own model.* names are ours, the tower's
        vision_model level aside)."""
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return "model." + name
        if name.startswith("language_model.model."):
            return "model.language_model." + name[len("language_model.model."):]
        if name.startswith("language_model.lm_head."):
            return name[len("language_model."):]
        return name

    def encode_images(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> list[torch.Tensor]:
        """Each image's token embeddings; `patches` holds the images' [C, H, W] pixels."""
        size = self.image_size
        pixels = patches.reshape(len(grids), self.channels, size, size)
        features = self.model.vision_tower.features(pixels, self.feature_layers)
        embeds = self.model.multi_modal_projector(features[:, 1:])  # the class token dropped
        return list(embeds.to(self.lm_head.weight.dtype))
