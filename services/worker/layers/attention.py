"""Attention over the paged KV cache, and the per-step metadata every layer reads.

A batch is its requests' new tokens concatenated (varlen, no padding). Each layer first
writes the step's new K/V into its cache by slot_mapping and then attends through the block
tables, so two requests of one step can share prefix blocks written in that same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import decode_splits, paged_attention
from kernels.attention_inputs import HeadNorms, norm_rope_write_kv
from kernels.cache import write_kv
from services.worker.layers.parallel import current_group
from services.worker.layers.pipeline import current_stage


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # int64 [T]: cache slot of each new token (-1: skip)
    block_tables: torch.Tensor     # int32 [R, max_blocks_per_req]
    query_start_loc: torch.Tensor  # int32 [R + 1], cumulative query lengths
    seq_lens: torch.Tensor         # int32 [R], context length after this step
    max_query_len: int
    max_seq_len: int
    # int32 [T]: the last context position each query attends to, where some see past
    # their own (an image's tokens attending both ways, Gemma 3); None: causal
    key_limits: torch.Tensor | None = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


class Attention(nn.Module):
    """q: [T, num_heads * head_dim], k and v: [T, num_kv_heads * head_dim] (this rank's
    heads) -> [T, num_heads * head_dim].

    k_scale and v_scale are the fp8 cache's per-layer scales (unused by other caches):
    buffers, so a checkpoint's self_attn.attn.k_scale loads into them and CUDA graphs read
    their current value. calculate_scales: set them from the first forward pass that
    writes real tokens (amax / the format's max), as vLLM's --calculate-kv-scales does.

    sliding_window and soft_cap: this layer's window and score cap (kernels.attention), or
    None."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 layer_idx: int, sliding_window: int | None = None,
                 soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.layer_idx = num_kv_heads, layer_idx
        self.sliding_window, self.soft_cap = sliding_window, soft_cap
        # the loader builds a model in its activations' dtype (loader.default_dtype)
        self.q_dtype = torch.get_default_dtype()
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32))
        self.calculate_scales = False
        self.tp = current_group()
        layers = current_stage().layers  # the KV cache holds the stage's layers only
        self.cache_index = layer_idx - (layers.start if layers is not None else 0)

    def decode_splits(self, num_reqs: int, max_seq_len: int, k_cache: torch.Tensor) -> int:
        """The parts this layer's attention cuts each context into for a decode of
        num_reqs requests whose contexts are at most max_seq_len keys long."""
        q = torch.empty((num_reqs, self.num_heads, self.head_dim), dtype=self.q_dtype,
                        device=k_cache.device)
        return decode_splits(q, k_cache.dtype, self.num_kv_heads, max_seq_len,
                             self.sliding_window)

    def _calculate_scales(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
        keep = slot_mapping >= 0
        if not bool(keep.any()):  # a warm-up or padding-only step says nothing of the data
            return
        limit = torch.finfo(k_cache.dtype).max
        # every rank holds some heads: one scale over all of them, as one rank would have
        amax = self.tp.max_over_ranks(
            torch.stack([k[keep].abs().amax(), v[keep].abs().amax()]).float())
        # a zero amax would divide by zero at the write; any positive scale stores zeros
        k_scale, v_scale = (amax / limit).clamp(min=1e-12)
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)
        self.calculate_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                ctx: ForwardContext, positions: torch.Tensor | None = None,
                cos_sin_cache: torch.Tensor | None = None,
                norms: HeadNorms | None = None) -> torch.Tensor:
        """k and v None: q is the fused projection's output, and positions and
        cos_sin_cache (norms if any) make its inputs in one kernel (forward_qkv); a
        module call either way, so profiles show the attention as its own row."""
        if k is None:
            assert v is None and positions is not None and cos_sin_cache is not None
            return self.forward_qkv(q, positions, cos_sin_cache, ctx, norms)
        assert v is not None
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        meta = ctx.attn
        if self.calculate_scales:
            self._calculate_scales(k, v, k_cache, meta.slot_mapping)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q, k_cache, v_cache, meta)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, ctx: ForwardContext,
                    norms: HeadNorms | None = None) -> torch.Tensor:
        """forward from the fused projection's output [T, (heads + 2 * kv_heads) *
        head_dim]: q/k per-head norms (norms), rotary (cos_sin_cache at positions) and the
        cache write in one kernel (kernels/attention_inputs.py) before the attention. Not
        while the fp8 scales are still to be calculated: those need k and v first."""
        assert not self.calculate_scales, "calculate_scales takes forward"
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        q = norm_rope_write_kv(qkv, positions, cos_sin_cache, self.num_heads, k_cache,
                               v_cache, ctx.attn.slot_mapping, norms, self.k_scale,
                               self.v_scale)
        return self._attend(q, k_cache, v_cache, ctx.attn)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                              meta.seq_lens, self.scale, max_query_len=meta.max_query_len,
                              max_seq_len=meta.max_seq_len, k_scale=self.k_scale,
                              v_scale=self.v_scale, sliding_window=self.sliding_window,
                              soft_cap=self.soft_cap, key_limits=meta.key_limits)
        return out.flatten(1)
