"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP vision transformer's
patch features, average-pooled to mm_tokens_per_image, normed and projected, replace the
image tokens' embeddings before the Gemma 3 decoder.

Gemma scales its token embeddings by sqrt(hidden_size); the image rows go in after that
scaling, unscaled (transformers' Gemma3Model merges them into the scaled embeddings). The
decoder's attention lets an image's tokens see each other both ways in the prefill: each
image token's keys reach its image's last token (ImageInput.bidirectional, the worker's
AttentionMetadata.key_limits), and sliding windows still bound them, as transformers'
masks do. The tower is whole on every tensor-parallel rank, as LLaVA's CLIP tower is
(models/llava.py, whose encoder layers SigLIP's equal).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.attention import ForwardContext
from services.worker.models.gemma import Gemma3ForCausalLM
from services.worker.models.llama import LlamaMLP, LlamaModel
from services.worker.models.llava import (CLIPEncoder, LlavaForConditionalGeneration,
                                          WholeConv2d, WholeEmbedding)
from services.worker.models.qwen2_vl import (VisionLanguageLM, Whole, WholeLayerNorm,
                                             attach_whole_loaders)


class SiglipEmbeddings(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.patch_embedding = WholeConv2d(c.num_channels, c.hidden_size, c.patch_size,
                                           stride=c.patch_size)
        self.position_embedding = WholeEmbedding((c.image_size // c.patch_size) ** 2,
                                                 c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, H, W] (the config's image_size) -> [N, patches, dim]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    """Checkpoint names: vision_tower.* or vision_tower.vision_model.*. Gemma 3's tower has
    no pooling head: its output is the last layer's, after post_layernorm."""

    def __init__(self, c) -> None:
        super().__init__()
        if getattr(c, "vision_use_head", False):
            raise ValueError("Gemma 3's SigLIP tower is built without its pooling head "
                             "(vision_use_head false)")
        self.embeddings = SiglipEmbeddings(c)
        self.encoder = CLIPEncoder(c)
        self.post_layernorm = WholeLayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class GemmaRMSNorm(Whole, nn.Module):
    """transformers' Gemma3RMSNorm: normalized and weighted by (1 + weight) in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Projector(Whole, nn.Module):
    """The patches' features average-pooled in squares to mm_tokens_per_image, normed
    (mm_soft_emb_norm) and projected to the decoder's width (mm_input_projection_weight,
    [vision, text])."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.side = vision.image_size // vision.patch_size
        self.kernel = self.side // int(hf_config.mm_tokens_per_image ** 0.5)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, hf_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[N, patches, vision] -> [N, tokens, text]."""
        n, _, dim = features.shape
        grid = features.transpose(1, 2).reshape(n, dim, self.side, self.side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3VLModel(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionTransformer(hf_config.vision_config)
        self.multi_modal_projector = Gemma3Projector(hf_config)
        attach_whole_loaders(self.vision_tower)
        attach_whole_loaders(self.multi_modal_projector)
        self.language_model = LlamaModel(hf_config, Gemma3ForCausalLM.decoder_flags(hf_config),
                                         lambda cfg, fl, i: LlamaMLP(cfg, fl))


class Gemma3ForConditionalGeneration(VisionLanguageLM):

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.model = Gemma3VLModel(hf_config)
        self.build_head(hf_config)
        vision = hf_config.vision_config
        self.image_size, self.channels = vision.image_size, vision.num_channels
        self.patch_dim = vision.num_channels * vision.patch_size ** 2
        self.final_soft_cap = getattr(hf_config, "final_logit_softcapping", None)

    # the layouts are LLaVA's: Hub names (language_model.model.*, vision_tower.*) or
    # transformers 5's, a tower's vision_model level dropped
    checkpoint_name = staticmethod(LlavaForConditionalGeneration.checkpoint_name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The text tokens' embeddings scaled, the images' rows put in as they are."""
        decoder = self.model.language_model
        embeds = decoder.embed_tokens(input_ids) * decoder.embed_scale
        if image_rows is not None:
            index, rows = image_rows
            embeds = embeds.index_copy(0, index, rows.to(embeds.dtype))
        return decoder(input_ids, positions, ctx, inputs_embeds=embeds)

    def encode_images(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> list[torch.Tensor]:
        """Each image's token embeddings; `patches` holds the images' [C, H, W] pixels."""
        size = self.image_size
        pixels = patches.reshape(len(grids), self.channels, size, size)
        embeds = self.model.multi_modal_projector(self.model.vision_tower(pixels))
        return list(embeds.to(self.lm_head.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gemma's final soft cap, where the config has one (Gemma 3's are None)."""
        logits = super().compute_logits(hidden)
        if self.final_soft_cap is None:
            return logits
        return torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
