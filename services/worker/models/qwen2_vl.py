"""Qwen2-VL and Qwen2.5-VL: a vision transformer whose merged patches replace the image
placeholder tokens' embeddings, then the Qwen2 decoder with M-RoPE.

The vision tower is whole on every tensor-parallel rank (it is small beside the decoder,
and splitting it would add an all-reduce per block for little): its modules are plain torch
layers that load their checkpoint tensors whole. The decoder is the Llama decoder with
Qwen2's biases (models/llama.py), built from the parallel layers; its rotary embedding
takes three positions per token (layers/rotary.MRotaryEmbedding), which
`mrope_positions` computes for a prompt from its images' grids.

The tower: patches (the image processor's rows, [patches, C * T * P * P]) are embedded by
a linear map (the checkpoint's Conv3d, whose kernel equals its stride), rotated by a 2-D
rotary embedding of each patch's row and column, and attend within their image (Qwen2-VL),
or within windows of window_size pixels except in the `fullatt_block_indexes` blocks
(Qwen2.5-VL). Patches are ordered so that each 2x2 group the merger joins is contiguous;
Qwen2.5-VL also reorders the groups window by window for the blocks and back after the
merger.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from common.messages import ImageInput
from services.worker.layers.attention import ForwardContext
from services.worker.layers.embedding import ParallelLMHead
from services.worker.layers.linear import Checkpoint, copy_checked
from services.worker.models.causal_lm import CausalLM, head_dim_of
from services.worker.models.llama import DecoderFlags, LlamaForCausalLM, LlamaMLP, LlamaModel

DEFAULT_VISION_THETA = 10000.0
VISION_NORM_EPS = 1e-6


# --- whole (replicated) layers ---------------------------------------------------------

class Whole:
    """A layer every rank holds whole: each checkpoint tensor is copied as it is."""

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[None, tuple[int, ...]]:
        return {None: tuple(param.shape)}


def attach_whole_loaders(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, Whole):
            for param in sub.parameters(recurse=False):
                param.requires_grad_(False)
                param.weight_loader = getattr(sub, "load", _copy_whole)


def _copy_whole(param: nn.Parameter, loaded: Checkpoint, shard_id=None) -> None:
    copy_checked(param.data, loaded, "vision tower")


class WholeLinear(Whole, nn.Linear):
    pass


class WholeLayerNorm(Whole, nn.LayerNorm):
    pass


class WholeRMSNorm(Whole, nn.Module):
    """transformers' Qwen2RMSNorm: normalized in float32, weighted in the input dtype."""

    def __init__(self, size: int, eps: float = VISION_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class WholeMerged(Whole, nn.Module):
    """Several projections of one input, whole, in one matrix with biases: the loader
    routes q/k/v_proj and gate/up_proj tensors (anywhere in a model) to fused modules,
    each with its shard id (`parts`, in order)."""

    def __init__(self, input_size: int, output_size: int, parts: tuple) -> None:
        super().__init__()
        self.size, self.parts = output_size, parts
        self.weight = nn.Parameter(torch.empty(len(parts) * output_size, input_size))
        self.bias = nn.Parameter(torch.empty(len(parts) * output_size))

    def checkpoint_shapes(self, param: nn.Parameter) -> dict:
        return {part: (self.size, *param.shape[1:]) for part in self.parts}

    def load(self, param: nn.Parameter, loaded: Checkpoint, shard_id) -> None:
        rows = param.data.narrow(0, self.parts.index(shard_id) * self.size, self.size)
        copy_checked(rows, loaded, f"vision {shard_id} projection")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.size, dim=-1)


class WholeConv3d(Whole, nn.Conv3d):
    pass


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d over one patch (kernel = stride = the patch) is a linear map
    of the flattened patch."""

    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = WholeConv3d(in_channels, dim, kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)
        return F.linear(patches.to(weight.dtype), weight)


# --- the vision tower --------------------------------------------------------------------

def equal_runs(cu_seqlens: list[int]) -> list[tuple[int, int, int]]:
    """(start, count, length) of each run of consecutive sequences of one length."""
    runs: list[tuple[int, int, int]] = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end == start:
            continue
        if runs and runs[-1][2] == end - start:  # sequences are back to back
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, end - start)
        else:
            runs.append((start, 1, end - start))
    return runs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = WholeLinear(dim, 3 * dim)
        self.proj = WholeLinear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each [cu_seqlens[i], cu_seqlens[i + 1])."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = (self._rotate(t, cos, sin) for t in (q, k))
        out = torch.empty_like(q)
        for start, count, length in equal_runs(cu_seqlens):
            # a run of equal sequences (Qwen2.5-VL's full windows) is one batch of them; 4-D,
            # because SDPA's flash and memory-efficient kernels take only that and its math
            # fallback holds the whole [heads, length, length] scores (256 GiB at the
            # largest image)
            end = start + count * length
            q_, k_, v_ = (t[start:end].view(count, length, self.num_heads, self.head_dim)
                          .transpose(1, 2) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2) \
                .reshape(end - start, self.num_heads, self.head_dim)
        return self.proj(out.flatten(1))

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # transformers rotates the vision q/k in float32
        return (x32 * cos[:, None] + rotate_half(x32) * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    """Qwen2.5-VL's gated MLP (with biases)."""

    def __init__(self, dim: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = WholeMerged(dim, intermediate, (0, 1))
        self.down_proj = WholeLinear(intermediate, dim)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(self.act(gate) * up)


class VisionFC(nn.Module):
    """Qwen2-VL's MLP: fc1, activation, fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = WholeLinear(dim, hidden)
        self.fc2 = WholeLinear(hidden, dim)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, vision_config, qwen25: bool) -> None:
        super().__init__()
        dim = vision_config.hidden_size if qwen25 else vision_config.embed_dim
        if qwen25:
            self.norm1, self.norm2 = WholeRMSNorm(dim), WholeRMSNorm(dim)
            self.mlp: nn.Module = VisionMLP(dim, vision_config.intermediate_size,
                                            vision_config.hidden_act)
        else:
            self.norm1 = WholeLayerNorm(dim, eps=VISION_NORM_EPS)
            self.norm2 = WholeLayerNorm(dim, eps=VISION_NORM_EPS)
            self.mlp = VisionFC(dim, int(dim * vision_config.mlp_ratio), vision_config.hidden_act)
        self.attn = VisionAttention(dim, vision_config.num_heads)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each group of merge x merge neighbouring patches, normed and concatenated, to one
    token of the decoder's width."""

    def __init__(self, out_dim: int, dim: int, merge: int, qwen25: bool) -> None:
        super().__init__()
        self.width = dim * merge ** 2
        self.ln_q = WholeRMSNorm(dim) if qwen25 else WholeLayerNorm(dim, eps=VISION_NORM_EPS)
        self.mlp = nn.Sequential(WholeLinear(self.width, self.width), nn.GELU(),
                                 WholeLinear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, vision_config, qwen25: bool) -> None:
        super().__init__()
        c = vision_config
        self.qwen25 = qwen25
        dim = c.hidden_size if qwen25 else c.embed_dim
        out_dim = c.out_hidden_size if qwen25 else c.hidden_size
        self.merge, self.patch_size = c.spatial_merge_size, c.patch_size
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        self.window_size = getattr(c, "window_size", 0)
        self.full_blocks = set(getattr(c, "fullatt_block_indexes", None) or [])
        self.patch_embed = PatchEmbed(c.in_channels, c.temporal_patch_size, c.patch_size, dim)
        self.blocks = nn.ModuleList(VisionBlock(c, qwen25) for _ in range(c.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, qwen25)
        head_dim = dim // c.num_heads
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta",
                                                                 DEFAULT_VISION_THETA)
        spatial = head_dim // 2  # half the dims rotate by the row, half by the column
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32) / spatial), persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        """patches: [sum of t*h*w, patch_dim] of the images in `grids` order -> their
        merged tokens, [sum of t*h*w / merge^2, out_dim], in the same order."""
        x = self.patch_embed(patches)
        cos, sin = self._rotary(grids)
        full = frame_seqlens(grids)
        if self.qwen25:
            order, windows = window_order(grids, self.merge,
                                          self.window_size // self.merge // self.patch_size)
            x, cos, sin = (self._by_group(t, order) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            seqlens = full if not self.qwen25 or i in self.full_blocks else windows
            x = block(x, seqlens, cos, sin)
        merged = self.merger(x)
        if self.qwen25:
            merged = merged[torch.as_tensor(np.argsort(order), device=merged.device)]
        return merged

    def _by_group(self, x: torch.Tensor, order: np.ndarray) -> torch.Tensor:
        """Reorder the merge groups (merge^2 contiguous rows each) into `order`."""
        unit = self.merge ** 2
        grouped = x.reshape(x.shape[0] // unit, unit, -1)
        return grouped[torch.as_tensor(order, device=x.device)].reshape(x.shape[0], -1)

    def _rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows_cols = torch.as_tensor(patch_rows_cols(grids, self.merge),
                                    device=self.inv_freq.device)
        freqs = (rows_cols[..., None].float() * self.inv_freq).flatten(1)  # [N, head/2]
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()


def patch_rows_cols(grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """Each patch's (row, column) in its image, [N, 2], in the processor's patch order:
    merge x merge groups row by row, each group's patches row by row, frame after frame."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out)


def frame_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch counts of every frame: full attention stays within a frame."""
    sizes = [h * w for t, h, w in grids for _ in range(t)]
    return [0, *np.cumsum(sizes).tolist()]


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int
                 ) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows of window x window merge groups (cut short at the image's
    right and bottom edges): the merge groups' order window by window (row by row
    inside), and the cumulative patch counts of the windows."""
    order: list[np.ndarray] = []
    seqlens = [0]
    first = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        groups = first + np.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in groups:
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    cell = frame[top:top + window, left:left + window].reshape(-1)
                    order.append(cell)
                    seqlens.append(seqlens[-1] + cell.size * merge ** 2)
        first += t * gh * gw
    return np.concatenate(order), seqlens


# --- M-RoPE positions ------------------------------------------------------------------

def mrope_positions(num_tokens: int, images: list[ImageInput], merge: int,
                    tokens_per_second: float = 0.0) -> tuple[np.ndarray, int]:
    """The three positions (time, height, width) of each of a prompt's tokens, [3, N],
    and the delta that later tokens add to their index. Text counts on from the last
    position; an image's tokens sit at (start + frame, start + row, start + column) of its
    merged grid, and the text after it starts at start + max(rows, columns). A video's
    temporal patches are frames too: Qwen2-VL's one position apart, Qwen2.5-VL's
    (tokens_per_second) `tokens_per_second * second_per_grid_t` apart, rounded down."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    next_pos, done = 0, 0
    for image in sorted(images, key=lambda i: i.offset):
        text = image.offset - done
        positions[:, done:image.offset] = next_pos + np.arange(text)
        next_pos += text
        t, h, w = image.grid_thw
        gh, gw = h // merge, w // merge
        times = np.arange(t)
        if tokens_per_second and image.second_per_grid_t:
            times = (times * (tokens_per_second * image.second_per_grid_t)).astype(np.int64)
        frames, rows, cols = np.meshgrid(times, np.arange(gh), np.arange(gw), indexing="ij")
        end = image.offset + image.length
        positions[:, image.offset:end] = next_pos + np.stack(
            [frames.reshape(-1), rows.reshape(-1), cols.reshape(-1)])
        next_pos += max(gh, gw)
        done = end
    positions[:, done:] = next_pos + np.arange(num_tokens - done)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


# --- the model ---------------------------------------------------------------------------

class Qwen2VLModel(nn.Module):
    """Holds the tower and the decoder under transformers 5's names
    (model.visual, model.language_model)."""

    def __init__(self, hf_config, qwen25: bool) -> None:
        super().__init__()
        self.visual = VisionTransformer(hf_config.vision_config, qwen25)
        attach_whole_loaders(self.visual)
        self.language_model = LlamaModel(hf_config, DecoderFlags(qkv_bias=True),
                                         lambda cfg, flags, i: LlamaMLP(cfg, flags))


class VisionLanguageLM(CausalLM):
    """A vision tower's embeddings in place of the image tokens' before a Llama-style
    decoder (self.model.language_model), whose LM head this builds."""
    packed_modules = LlamaForCausalLM.packed_modules
    multimodal: ClassVar[bool] = True
    model: nn.Module

    def build_head(self, hf_config) -> None:
        decoder = self.model.language_model
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        tied = decoder.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tied)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = decoder.layers[0].self_attn.num_kv_heads
        self.head_dim = head_dim_of(hf_config)
        self.hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """positions: [3, T] with M-RoPE, else [T]; image_rows: (token indices, their
        image embeddings) to put in place of those tokens' embeddings."""
        decoder = self.model.language_model
        embeds = decoder.embed_tokens(input_ids)
        if image_rows is not None:
            index, rows = image_rows
            embeds = embeds.index_copy(0, index, rows.to(embeds.dtype))
        return decoder(input_ids, positions, ctx, inputs_embeds=embeds)


class Qwen2VLForConditionalGeneration(VisionLanguageLM):
    mrope: ClassVar[bool] = True
    qwen25: ClassVar[bool] = False

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.model = Qwen2VLModel(hf_config, self.qwen25)
        self.build_head(hf_config)
        self.merge = hf_config.vision_config.spatial_merge_size
        self.patch_dim = self.model.visual.patch_dim
        # how far apart a video's frames sit in time positions (Qwen2.5-VL; 0: one apart)
        self.tokens_per_second = float(getattr(hf_config.vision_config, "tokens_per_second",
                                               0) or 0) if self.qwen25 else 0.0

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """transformers 5's names for a checkpoint saved before them (the Hub's Qwen2-VL
        and Qwen2.5-VL files): visual.* and model.* (the decoder)."""
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model.") and not name.startswith(("model.visual.",
                                                                "model.language_model.")):
            return "model.language_model." + name[len("model."):]
        return name

    def encode_images(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> list[torch.Tensor]:
        """Each image's token embeddings, [t*h*w / merge^2, hidden_size]."""
        merged = self.model.visual(patches, grids)
        sizes = [t * h * w // self.merge ** 2 for t, h, w in grids]
        return list(merged.to(self.lm_head.weight.dtype).split(sizes))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    qwen25 = True

