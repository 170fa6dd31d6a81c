"""Paged attention over a block-table KV cache: prefill chunks and decodes in one call.

Request r owns queries q[query_start_loc[r]:query_start_loc[r + 1]], which sit at the last
q_len positions of its context of seq_lens[r] tokens. Every context position's K/V (the new
ones included: the cache write happens first) is read through block_tables[r].

Two per-layer options, as Mistral, Qwen2 and Gemma use them:
* sliding_window W: the query at position p sees keys p - W < j <= p (W keys, itself
  included), transformers' and flash-attention's meaning.
* soft_cap c: scores (already scaled) become c * tanh(score / c) before the softmax.

And one per step: key_limits, each query's last visible key position where it is past the
query's own (Gemma 3's image tokens see their whole image; the window, counted from the
query's position, still applies, as in transformers' masks). The scheduler computes an
image whose tokens attend both ways in one step, so no chunk needs keys it lacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cache import dequantize
from kernels.triton_attention import paged_attention_triton, triton_decode_splits

Scale = torch.Tensor | None  # float32 [1] per fp8 cache (kernels.cache), None otherwise


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int | None = None,
                    max_seq_len: int | None = None, k_scale: Scale = None,
                    v_scale: Scale = None, sliding_window: int | None = None,
                    soft_cap: float | None = None, key_limits: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """q: [T, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim],
    fp8 ones with their k_scale/v_scale; returns [T, num_heads, head_dim] in q's dtype.
    sliding_window, soft_cap and key_limits: see the module doc (None: off).
    max_query_len and max_seq_len are host
    upper bounds that size the GPU launch (no device read). The one dispatch point for this
    op: CUDA tensors take the Triton kernel, others the batched torch path."""
    if q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc,
                                      seq_lens, scale, max_query_len, max_seq_len,
                                      k_scale=k_scale, v_scale=v_scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap,
                                      key_limits=key_limits)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 scale, k_scale, v_scale, sliding_window, soft_cap,
                                 key_limits)


def decode_splits(q: torch.Tensor, cache_dtype: torch.dtype, num_kv_heads: int,
                  max_seq_len: int, sliding_window: int | None = None) -> int:
    """The parts paged_attention cuts each context into for a decode of q's requests whose
    contexts are at most max_seq_len keys long: 1 off the GPU (the torch path walks
    whole contexts)."""
    if q.is_cuda:
        return triton_decode_splits(q, cache_dtype, num_kv_heads, max_seq_len,
                                    sliding_window)
    return 1


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, k_scale: Scale = None,
                          v_scale: Scale = None, sliding_window: int | None = None,
                          soft_cap: float | None = None,
                          key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: every decode (one query) of the batch in one padded attention call,
    prefill chunks one request at a time (padding them together would cost
    requests x chunk x context memory). A one-token chunk sees no key past itself (an
    image's last token is the last it may see), so key_limits matter to chunks only."""
    out = torch.empty_like(q)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    decodes = (q_lens == 1).nonzero().flatten()
    if decodes.numel():
        rows = query_start_loc[decodes].long()
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[decodes],
                                      seq_lens[decodes], scale, k_scale, v_scale,
                                      sliding_window, soft_cap)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r in (q_lens > 1).nonzero().flatten().tolist():
        begin, end = starts[r], starts[r + 1]
        k = dequantize(gather_context(k_cache, block_tables[r], lens[r]), q.dtype, k_scale)
        v = dequantize(gather_context(v_cache, block_tables[r], lens[r]), q.dtype, v_scale)
        query_pos = torch.arange(lens[r] - (end - begin), lens[r], device=q.device)
        limits = None if key_limits is None else key_limits[begin:end].long()
        visible = visible_keys(query_pos, lens[r], sliding_window, limits)
        out[begin:end] = _sdpa(q[None, begin:end], k[None], v[None], visible[None], scale,
                               soft_cap)[0]
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, k_scale: Scale, v_scale: Scale,
                      sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    block_size, max_len = k_cache.shape[1], int(seq_lens.max())
    blocks = block_tables[:, :-(-max_len // block_size)].long()
    # [R, S, kv_heads, head_dim]
    k = dequantize(k_cache[blocks].flatten(1, 2)[:, :max_len], q.dtype, k_scale)
    v = dequantize(v_cache[blocks].flatten(1, 2)[:, :max_len], q.dtype, v_scale)
    # each decode's query sits at position seq_len - 1
    visible = visible_keys(seq_lens.long() - 1, max_len, sliding_window)
    return _sdpa(q[:, None], k, v, visible[:, None], scale, soft_cap)[:, 0]


def visible_keys(query_pos: torch.Tensor, num_keys: int,
                 sliding_window: int | None, key_limits: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """bool [len(query_pos), num_keys]: the keys each query position attends to (causal,
    or up to its key limit, and within the window)."""
    keys = torch.arange(num_keys, device=query_pos.device)[None, :]
    last = query_pos if key_limits is None else key_limits
    visible = keys <= last[:, None]
    if sliding_window is not None:
        visible &= keys > query_pos[:, None] - sliding_window
    return visible


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
          scale: float, soft_cap: float | None = None) -> torch.Tensor:
    """q [R, Q, H, D], k/v [R, S, KVH, D], visible [R, Q, S] -> [R, Q, H, D]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)
    # SDPA has no hook between the scores and the softmax: the capped path is explicit
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = cap_scores(torch.matmul(q, k.transpose(-1, -2)).float() * scale, soft_cap)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0).to(v.dtype)  # a row seeing no key: zeros
    return torch.matmul(probs, v).transpose(1, 2)


def cap_scores(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return scores if soft_cap is None else soft_cap * torch.tanh(scores / soft_cap)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one request's cache as [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, k_scale: Scale = None,
                        v_scale: Scale = None, sliding_window: int | None = None,
                        soft_cap: float | None = None,
                        key_limits: torch.Tensor | None = None) -> torch.Tensor:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        begin, end = starts[r], starts[r + 1]
        if end == begin:
            continue
        q_len = end - begin
        k = dequantize(gather_context(k_cache, block_tables[r], seq_len), torch.float32,
                       k_scale).repeat_interleave(group, dim=1)
        v = dequantize(gather_context(v_cache, block_tables[r], seq_len), torch.float32,
                       v_scale).repeat_interleave(group, dim=1)
        scores = cap_scores(torch.einsum("qhd,khd->hqk", q[begin:end].float(), k.float())
                            * scale, soft_cap)
        # query i sits at position seq_len - q_len + i and sees keys up to that position
        # (and, with a window, not before it)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        limits = None if key_limits is None else key_limits[begin:end].long()
        visible = visible_keys(query_pos, seq_len, sliding_window, limits)
        scores.masked_fill_(~visible[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out
