"""Paged attention over a block-table KV cache: prefill chunks and decodes in one call.

Request r owns queries q[query_start_loc[r]:query_start_loc[r + 1]], which sit at the last
q_len positions of its context of seq_lens[r] tokens. Every context position's K/V (the new
ones included: the cache write happens first) is read through block_tables[r].
"""

from __future__ import annotations

import torch


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    returns [T, num_heads, head_dim] in q's dtype. The one dispatch point for this op."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                               scale)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one request's cache as [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
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
        k = gather_context(k_cache, block_tables[r], seq_len).repeat_interleave(group, dim=1)
        v = gather_context(v_cache, block_tables[r], seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), k.float()) * scale
        # query i sits at position seq_len - q_len + i and sees keys 0..that position
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out
