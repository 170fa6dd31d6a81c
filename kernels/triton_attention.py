"""The Triton paged attention: one kernel for prefill chunks and decodes, split-K for long
contexts in small batches.

A program owns a tile of one request's queries for one KV head: BLOCK_Q consecutive query
tokens times the GROUP query heads that share that KV head, flattened into the rows of
one matrix (row i = token i // GROUP, head i % GROUP). So every K/V element a tile reads
serves all the heads of its group, and a decode (one token) still gives the tensor cores
GROUP rows. The program walks its request's block table BLOCK_N keys at a time (any
number of cache blocks per step) with an online softmax.

Decode tiles hold 16 rows, prefill tiles up to 128: a decode in a 128-row tile would leave
most of the tensor-core work idle. So the kernel runs as a decode launch, taking the
requests that fit one decode tile, and, when max_query_len says the batch may hold
longer ones, a prefill launch taking those; each skips the other's requests.

Tiles are numbered without a look at the lengths. In the decode launch tile r is request
r's. In the prefill launch request r's tiles start at query_start_loc[r] // BLOCK_Q + r,
since q_len // BLOCK_Q + 1 tiles always cover it, and num_tokens // BLOCK_Q + num_reqs + 1
tiles cover the batch; a program finds its request with one vector compare over
query_start_loc. In both, an extra last "request" holds the tokens past
query_start_loc[-1] (a padded CUDA-graph batch): it has no context and its rows come out
as zeros. Programs whose tile is past their request's queries return at once.

Keys below the tile's first query position that fill whole BLOCK_Ns go through an
unmasked loop; the rest (the diagonal, the context's ragged end) through a masked one.

A sliding window W (a query at position p sees keys p - W < j <= p) moves the start of
a tile's keys up to the BLOCK_N holding its first query's lowest visible key: the blocks
below are never read, so a windowed decode costs W keys, not the context. The keys
below its last query's window start (the partial BLOCK_N at the lower edge, and more
when the tile's queries span more than a BLOCK_N) go through a second masked loop
before the unmasked one. A soft cap c turns each score into c * tanh(score / c) before
the mask and the softmax. Both are constexpr switches: without them the kernel compiles
to the loops above and nothing more.

With num_splits > 1 the program axis 2 cuts each tile's keys into that many equal parts
(of the actual visible range, in whole BLOCK_Ns); each part stores its normalised
output and log-sum-exp, and a second kernel merges them. The split count comes from host
ints only (the batch shape, the SM count, max_seq_len or the window), so a captured graph
replays with any lengths up to max_seq_len.

An fp8 cache's K and V are cast to q's dtype as they load (to fp16 under a bf16 q: the
dots then run in fp16, see FP16_DOT); their per-tensor scales are applied outside the
loop: k_scale to the score scale, v_scale to the normalised output.

key_limits (a constexpr switch too) gives each query the last key it sees, past its own
position where an image's tokens attend both ways (Gemma 3): a tile's keys then run to
its rows' furthest limit (never past the context), the masks compare keys with each
row's limit, and the window still counts from the row's position. The unmasked keys stay
those at or before the tile's first position, which every row sees either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.cache import FP8_DTYPES
from kernels.pdl import let_next_start, overlap_previous, pdl_launch, wait_for_previous

LOG2_E = 1.4426950408889634
# splits beyond this add combine traffic faster than they add parallelism
MAX_SPLITS = 64
NO_LIMIT = 2 ** 31 - 1
MIN_SEARCH_BLOCK = 512  # one search width for any batch up to 511 requests
WIDE_FROM = 64  # decode batches from which wide_decode's tile runs


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int     # query rows per program (tokens x heads of the group), >= 16
    block_n: int     # keys per step of the context loop, >= 16
    num_warps: int
    num_stages: int
    prefetch_v: bool = False  # load a step's V with its K, before the scores need K

    def queries(self, group: int) -> int:
        """Query tokens per tile."""
        return max(1, self.block_m // group)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    decode: TileConfig    # requests of at most decode.queries(group) queries
    prefill: TileConfig   # the longer ones, in a second launch when a batch may have them
    target_programs: int  # split contexts until the grid has about this many programs
    min_partition: int    # fewest keys worth a split of their own
    # the decode tile of batches of WIDE_FROM requests or more (the same block_m)
    wide_decode: TileConfig | None = None

    def decode_tile(self, num_reqs: int) -> TileConfig:
        wide = self.wide_decode is not None and num_reqs >= WIDE_FROM
        return self.wide_decode if wide else self.decode


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(q: torch.Tensor, cache_dtype: torch.dtype | None = None
                   ) -> AttentionConfig:
    """Decode tiles of 16 rows (a decode has only GROUP rows: wider tiles would multiply
    idle tensor-core work), prefill tiles of 64 rows, and splits until about one program
    per SM. Chosen by the H100 sweeps in benchmarks/gpu/kernels.md. An fp8 cache's decode
    tiles, since its dots run in fp16 (FP16_DOT), read 128 keys a step over three stages,
    split to about two programs per SM: at Llama-3.1-8B's heads 64.7 against 71.9 us for
    64 x 1000 keys, 218.5 against 266.0 for 32 x 8000, than the 64-key, five-stage, four
    per SM tiles chosen before the fp16 dots (benchmarks/gpu/kv_layout_experiment.py,
    benchmarks/issue30-h100/s5/kv-layout.txt). bf16 decodes split to about two programs per
    SM in parts of at least 128 keys: on the H100 as fast as one program per SM and 64
    keys, or faster (Phi-3 at batch 1: 10.8 against 12.1 us; Qwen3-30B-A3B at 32 x 4000
    keys: 100 against 133 us), in all of benchmarks/gpu/attention_splits.py's 32 cases but
    two, batch 1 at 4000 keys for Qwen3-30B-A3B and Llama-3.1-8B (1.3 and 0.5 us slower;
    benchmarks/issue29-h100/attention-splits.txt). bf16 decode tiles run one pipeline
    stage, 128 keys a step for heads up to 128 wide and 64 for wider ones: a program walks
    only a part or two of the context, so stages buy no overlap and cost their prologue
    (benchmarks/gpu/attention_tiles.py: at batch 1 and 1000 keys Phi-3 10.4 -> 8.1 us,
    Gemma-2-9B 10.9 -> 8.2, Llama-3.1-8B 7.5 -> 6.4; as fast or faster at every batch to 32
    and both contexts, but Phi-3's 32 KV heads at 16 and 32 requests, 3-5% slower,
    benchmarks/issue29-h100/attention-tiles-candidates.txt). Decode batches of WIDE_FROM
    requests or more take wide_decode's tile."""
    programs = sm_count(q.device.index or 0) if q.is_cuda else 1
    if q.dtype == torch.float32:  # exact fp32 dots: 16 x 16 tiles, larger ones spill
        return AttentionConfig(TileConfig(16, 16, 4, 2), TileConfig(16, 16, 4, 2), programs, 64)
    if cache_dtype in FP8_DTYPES:
        return AttentionConfig(TileConfig(16, 128, 4, 3), TileConfig(64, 64, 4, 2),
                               2 * programs, 64)
    decode_keys = 128 if q.shape[-1] <= 128 else 64
    return AttentionConfig(TileConfig(16, decode_keys, 4, 1), TileConfig(64, 64, 4, 2),
                           2 * programs, 128, wide_decode(q.shape[-1]))


def wide_decode(head_dim: int) -> TileConfig | None:
    """The bf16 decode tile of batches of WIDE_FROM requests or more. There
    every request and KV head has a program that walks its whole context, and the 128-key
    steps' registers leave few programs to an SM to hide the loads behind: 64-key steps
    whose V loads with K ran Qwen3-0.6B's and Llama-3.1-8B's heads at 256 decodes of 112,
    512 and 2000 keys in 38.1, 132.6 and 500.3 us against 45.0, 148.7 and 563.0, and at 64
    and 128 decodes 8-15% faster too; within 5% of the best tile of the 24 swept in each
    case but one (benchmarks/gpu/attention_batch_tiles.py, benchmarks/issue31-h200/busy14/
    leaseC-attention-sweep/). Swept at heads of 128 only."""
    return TileConfig(16, 64, 4, 1, prefetch_v=True) if head_dim == 128 else None


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           max_query_len: int | None = None, max_seq_len: int | None = None,
                           config: AttentionConfig | None = None,
                           out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.attention.paged_attention. max_query_len and max_seq_len
    are host upper bounds (the shapes' bounds when None); nothing here reads the device.
    out: a contiguous buffer to write into (a static buffer, a poisoned one in tests).
    k_scale, v_scale: float32 [1] device tensors, needed by fp8 caches.

    A batch that may hold requests longer than a decode tile runs two launches of the
    kernel: decode tiles for the short requests, prefill tiles for the long ones."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs, num_kv_heads, block_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim >= 16, "head_dim: at least 16"
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1
    assert k_cache.stride() == v_cache.stride(), "K and V caches: one layout"
    group = num_heads // num_kv_heads
    scaled = k_cache.dtype in FP8_DTYPES
    assert not scaled or (k_scale is not None and v_scale is not None), "fp8 needs scales"
    assert sliding_window is None or sliding_window >= 1, "sliding_window: at least 1 key"
    assert soft_cap is None or soft_cap > 0, "soft_cap: positive"
    max_query_len = num_tokens if max_query_len is None else max_query_len
    max_seq_len = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    config = config or default_config(q, k_cache.dtype)
    passes, num_splits = launch_plan(config, group, num_tokens, num_reqs, num_kv_heads,
                                     max_query_len, max_seq_len, sliding_window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    if num_splits > 1:
        part_out = torch.empty((num_splits, num_tokens, num_heads, head_dim),
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32,
                               device=q.device)
    else:  # never touched: the SPLIT=False kernel stores straight into out
        part_out = part_lse = out
    for tile, q_len_above, q_len_upto, one_tile_each in passes:
        block_q = tile.queries(group)
        # tiles: one per request then the padding tail's, or, numbered by the search,
        # request r's from query_start_loc[r] // block_q + r on (module doc)
        num_tiles = num_reqs + triton.cdiv(num_tokens, block_q) if one_tile_each \
            else num_tokens // block_q + num_reqs + 1
        grid = (num_tiles, num_kv_heads, num_splits)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, part_out, part_lse, block_tables, query_start_loc,
            seq_lens, k_scale if scaled else q, v_scale if scaled else q,
            seq_lens if key_limits is None else key_limits, num_tokens,
            num_reqs, num_splits, q_len_above, q_len_upto,
            scale * LOG2_E, sliding_window or 0, (soft_cap or 0.0) * LOG2_E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size, BLOCK_Q=block_q,
            BLOCK_M=max(16, triton.next_power_of_2(block_q * group)), BLOCK_N=tile.block_n,
            ONE_TILE_EACH=one_tile_each,
            SEARCH_BLOCK=1 if one_tile_each else search_block(num_reqs),
            SPLIT=num_splits > 1, EXACT_DOT=q.dtype == torch.float32, SCALED=scaled,
            FP16_DOT=scaled and q.dtype == torch.bfloat16,
            WINDOW=sliding_window is not None, SOFT_CAP=soft_cap is not None,
            LIMITS=key_limits is not None, PREFETCH_V=tile.prefetch_v,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages, **pdl_launch(q))
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, num_tokens, num_heads, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            DIM_BLOCK=triton.next_power_of_2(head_dim), num_warps=4, **pdl_launch(q))
    return out


Pass = tuple[TileConfig, int, int, bool]  # tiles, q_len range (above, upto], one tile each


def launch_plan(config: AttentionConfig, group: int, num_tokens: int, num_reqs: int,
                num_kv_heads: int, max_query_len: int, max_seq_len: int,
                sliding_window: int | None) -> tuple[list[Pass], int]:
    """The launches of a batch (decode tiles, then prefill tiles where max_query_len says
    it may hold requests longer than a decode tile) and the parts each context is cut
    into: from host ints only."""
    decode = config.decode_tile(num_reqs)
    short = decode.queries(group)
    passes = [(decode, 0, short, True)]
    if max_query_len > short:
        passes.append((config.prefill, short, NO_LIMIT, False))
    busy_tiles = max(num_reqs, triton.cdiv(num_tokens, passes[-1][0].queries(group)))
    span = visible_span(max_seq_len, sliding_window, [tile for tile, *_ in passes], group)
    return passes, split_count(busy_tiles * num_kv_heads, span, config)


def triton_decode_splits(q: torch.Tensor, cache_dtype: torch.dtype, num_kv_heads: int,
                         max_seq_len: int, sliding_window: int | None = None) -> int:
    """The parts paged_attention_triton cuts each context into for a decode of q's
    requests (one query each) whose contexts are at most max_seq_len keys long."""
    num_reqs, num_heads = q.shape[:2]
    config = default_config(q, cache_dtype)
    return launch_plan(config, num_heads // num_kv_heads, num_reqs, num_reqs, num_kv_heads,
                       1, max_seq_len, sliding_window)[1]


def search_block(num_reqs: int) -> int:
    """The tile search's width: every request's start at once, at least MIN_SEARCH_BLOCK
    wide so that batch sizes do not each compile a kernel of their own."""
    return max(MIN_SEARCH_BLOCK, triton.next_power_of_2(num_reqs + 1))


def visible_span(max_seq_len: int, sliding_window: int | None, tiles: list[TileConfig],
                 group: int) -> int:
    """The most keys one tile walks: the whole context, or with a window the window plus
    the tile's other queries (their windows are staggered) and the rounding of its lower
    edge down to a BLOCK_N. Splits are cut from this span, not from max_seq_len, so that
    a window never gets parts below min_partition."""
    if sliding_window is None:
        return max_seq_len
    widest = max(tile.queries(group) + tile.block_n for tile in tiles)
    return min(max_seq_len, sliding_window + widest)


def split_count(busy_programs: int, max_seq_len: int, config: AttentionConfig) -> int:
    """Enough context splits to fill the GPU, never so many that a split of the longest
    possible context gets fewer than min_partition keys."""
    wanted = config.target_programs // max(busy_programs, 1)
    useful = triton.cdiv(max(max_seq_len, 1), config.min_partition)
    return max(1, min(wanted, useful, MAX_SPLITS))


@triton.jit
def _request_of_tile(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr,
                     SEARCH_BLOCK: tl.constexpr):
    """The last request r (num_reqs: the padding tail) whose first tile is <= tile,
    counted over all requests at once: one round trip to memory, not a chain of dependent
    loads as a binary search would be. (A loop over blocks of requests here kept triton
    3.9 from vectorizing and pipelining the K/V loads of the main loop.)"""
    r = tl.arange(0, SEARCH_BLOCK)
    exists = r <= num_reqs
    first_tile = tl.load(query_start_loc_ptr + r, mask=exists, other=0) // BLOCK_Q + r
    return tl.sum((exists & (first_tile <= tile)).to(tl.int32), axis=0) - 1


# The sizes of a step change every step; were they specialized on (divisibility by 16,
# equality to 1), each new combination would compile another kernel in the middle of
# serving, seconds each on the H100. So does an eager step's block table width
# (stride_bt: its longest request's blocks), and so do the 16-byte alignments of its
# metadata, views at any 4-byte offset into the one buffer that brought a step's inputs
# over (services/worker/inputs.py's to_device_together): a py-spy of the in-process
# engine caught the step thread compiling this kernel for 2.8 s of a run, warm-up and
# timed (benchmarks/issue31-h200/heads13). Those loads are a few words a program.
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_splits", "q_len_above",
                               "q_len_upto", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr", "key_limits_ptr"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
        key_limits_ptr, num_tokens, num_reqs, num_splits, q_len_above, q_len_upto, qk_scale,
        window, cap, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ONE_TILE_EACH: tl.constexpr, SEARCH_BLOCK: tl.constexpr, SPLIT: tl.constexpr,
        EXACT_DOT: tl.constexpr, SCALED: tl.constexpr, FP16_DOT: tl.constexpr,
        WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, LIMITS: tl.constexpr,
        PREFETCH_V: tl.constexpr, PDL: tl.constexpr):
    # the step's metadata is its input, copied in before its first kernel (a plain launch
    # that no PDL kernel overtakes): it is read while the previous kernel ends, a round
    # trip to memory less on a decode's critical path; q and the cache wait for it
    let_next_start(PDL)
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if ONE_TILE_EACH:
        # the decode launch: each request of its class fits one tile, so tile r is request
        # r's, and the tiles past num_reqs cover the padding tail (no search, one memory
        # round trip less on the critical path of a small batch)
        req = tl.minimum(tile, num_reqs)
        first_query = (tile - req) * BLOCK_Q
    else:
        req = _request_of_tile(query_start_loc_ptr, num_reqs, tile, BLOCK_Q, SEARCH_BLOCK)
    real = req < num_reqs
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1, mask=real, other=num_tokens) - q_begin
    seq_len = tl.load(seq_lens_ptr + req, mask=real, other=0)
    if not ONE_TILE_EACH:
        first_query = (tile - q_begin // BLOCK_Q - req) * BLOCK_Q
    # real requests of another launch's length class are not ours; the padding tail is
    # every launch's (it only writes zeros)
    other_class = real & ((q_len <= q_len_above) | (q_len > q_len_upto))
    if (first_query >= q_len) | other_class:
        return
    wait_for_previous(PDL)

    rows = tl.arange(0, BLOCK_M)
    # a head_dim that is no power of two (Phi-3's 96) runs in the next one's tiles, its
    # extra columns masked: zeros in q, never stored
    dims = tl.arange(0, DIM_BLOCK)
    dim_ok = dims < HEAD_DIM
    query = first_query + rows // GROUP  # index among the request's queries
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query < q_len)
    # query i of q_len sits at context position seq_len - q_len + i
    query_pos = seq_len - q_len + query
    token = q_begin + query
    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_ok[None, :], other=0.0)
    if SCALED:  # q.k * k_scale == q.(k_fp8 * k_scale): one multiply per score
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if FP16_DOT:
        # bf16 q over an fp8 cache: the dots run in fp16, to which fp8 converts in one
        # instruction per two values (to bf16 it takes several, and the conversion, not
        # the bytes, bound the loop). q / 256 is exact in fp16 up to |q| = 2^24, and the
        # 256 comes back in the score scale; p in [0, 1] is finer in fp16 than in bf16.
        q = (q.to(tl.float32) * (1.0 / 256.0)).to(tl.float16)
        qk_scale = qk_scale * 256.0

    # the keys this tile can see, [kv_begin, kv_end): up to its last query's position,
    # and with a window from the first BLOCK_N holding a key its first query sees (the
    # blocks below are skipped, not masked), and this split's share of them
    first_pos = seq_len - q_len + first_query
    causal_end = tl.maximum(seq_len - q_len + tl.minimum(first_query + BLOCK_Q, q_len), 0)
    if LIMITS:  # rows that see past themselves: up to their furthest, within the context
        key_last = tl.maximum(tl.load(key_limits_ptr + token, mask=row_valid, other=0),
                              query_pos)
        furthest = tl.max(tl.where(row_valid, key_last + 1, 0), axis=0)
        kv_end = tl.minimum(tl.maximum(causal_end, furthest), seq_len)
    else:
        key_last = query_pos
        kv_end = causal_end
    if WINDOW:
        kv_begin = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        kv_begin = 0
    part = tl.cdiv(tl.cdiv(tl.maximum(kv_end - kv_begin, 0), num_splits), BLOCK_N) * BLOCK_N
    kv_start = kv_begin + split * part
    kv_stop = tl.minimum(kv_start + part, kv_end)
    # whole BLOCK_Ns that every row sees (at or before the tile's first query position,
    # and inside its last query's window) need neither the causal, window nor range mask
    seen_by_all = tl.minimum(kv_stop, first_pos + 1)
    unmasked_stop = kv_start + tl.maximum(seen_by_all - kv_start, 0) // BLOCK_N * BLOCK_N
    if WINDOW:
        # the last query's window starts at causal_end - window; below it some rows need the
        # mask (a tile wider than the window has no unmasked keys: start == stop). Clamped
        # to kv_start last: a split past kv_end has kv_stop < kv_start, and its loops must
        # all be empty
        all_from = tl.cdiv(tl.maximum(causal_end - window, 0), BLOCK_N) * BLOCK_N
        unmasked_start = tl.maximum(tl.minimum(all_from, kv_stop), kv_start)
        unmasked_stop = tl.maximum(unmasked_stop, unmasked_start)
    else:
        unmasked_start = kv_start

    # a finite floor instead of -inf keeps rows that see no key of this split NaN-free
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_BLOCK], dtype=tl.float32)
    table_row = block_tables_ptr + req * stride_bt
    kv_head_ptrs = (k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch)
    if WINDOW:  # the window's lower edge
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, query_pos, key_last, kv_head_ptrs,
                                table_row, kv_start, unmasked_start, qk_scale, window, cap,
                                stride_cb, stride_cs, True, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                                DIM_BLOCK, EXACT_DOT, WINDOW, SOFT_CAP, PREFETCH_V)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, query_pos, key_last, kv_head_ptrs, table_row,
                            unmasked_start, unmasked_stop, qk_scale, window, cap, stride_cb,
                            stride_cs, False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_BLOCK,
                            EXACT_DOT, WINDOW, SOFT_CAP, PREFETCH_V)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, query_pos, key_last, kv_head_ptrs, table_row,
                            unmasked_stop, kv_stop, qk_scale, window, cap, stride_cb,
                            stride_cs, True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_BLOCK,
                            EXACT_DOT, WINDOW, SOFT_CAP, PREFETCH_V)

    # l_i == 0: the row saw no key (padding, or a split past its causal edge)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SCALED:
        out = out * tl.load(v_scale_ptr)
    out_rows = token * tl.num_programs(1) * GROUP + head
    if SPLIT:
        part_rows = split * num_tokens * tl.num_programs(1) * GROUP + out_rows
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_valid[:, None] & dim_ok[None, :])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part_rows, lse, mask=row_valid)
    else:
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_ok[None, :])


@triton.jit
def _attend(acc, m_i, l_i, q, query_pos, key_last, kv_head_ptrs, table_row, start, stop,
            qk_scale, window, cap, stride_cb, stride_cs, MASKED: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
            DIM_BLOCK: tl.constexpr, EXACT_DOT: tl.constexpr, WINDOW: tl.constexpr,
            SOFT_CAP: tl.constexpr, PREFETCH_V: tl.constexpr):
    """The online softmax over keys [start, stop), BLOCK_N at a time, read through the
    block table. MASKED: mask keys past stop and past each row's last key (key_last: its
    position, or its key limit) and, with WINDOW, those at or below position - window.
    Scores are in log2 units (scale * log2(e)); cap is the soft cap in the same units,
    and c * tanh(s / c) commutes with that scaling, so the cap applies to them as they
    are."""
    k_ptr, v_ptr = kv_head_ptrs
    dims = tl.arange(0, DIM_BLOCK)
    if SOFT_CAP:
        # c tanh(s / c) = c - 2c / (1 + e^(2s / c)): one exp2 and one division a score.
        # exp2 overflowing to inf gives c, underflowing to 0 gives -c, so large scores
        # need no care; near 0 the error is an ulp of c. (triton has no tanh that also
        # runs in the interpreter.)
        cap_exp2 = 2.0 * 1.4426950408889634 / cap
        two_cap = 2.0 * cap
    for block_start in range(start, stop, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        in_range = keys < stop
        if MASKED:
            block = tl.load(table_row + keys // BLOCK_SIZE, mask=in_range, other=0)
        else:
            block = tl.load(table_row + keys // BLOCK_SIZE)
        slot = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_cs
        kv_offsets = slot[:, None] + dims[None, :]
        k = _load_kv(k_ptr, kv_offsets, in_range, dims, MASKED, HEAD_DIM, DIM_BLOCK)
        if PREFETCH_V:
            v = _load_kv(v_ptr, kv_offsets, in_range, dims, MASKED, HEAD_DIM, DIM_BLOCK)
        k = k.to(q.dtype)  # an fp8 cache's values, unscaled; a no-op otherwise
        if EXACT_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            scores = tl.dot(q, tl.trans(k)) * qk_scale
        if SOFT_CAP:  # before the mask: the cap would turn -inf into -cap
            scores = cap - two_cap / (1.0 + tl.exp2(scores * cap_exp2))
        if MASKED:
            visible = keys[None, :] <= key_last[:, None]
            if WINDOW:
                visible = visible & (keys[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not PREFETCH_V:
            v = _load_kv(v_ptr, kv_offsets, in_range, dims, MASKED, HEAD_DIM, DIM_BLOCK)
        v = v.to(q.dtype)
        if EXACT_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _load_kv(ptr, offsets, in_range, dims, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
             DIM_BLOCK: tl.constexpr):
    """One step's keys or values: masked past the range's end, and past head_dim where
    the tile is wider."""
    if MASKED:
        x = tl.load(ptr + offsets, mask=in_range[:, None] & (dims[None, :] < HEAD_DIM),
                    other=0.0)
    elif DIM_BLOCK != HEAD_DIM:
        x = tl.load(ptr + offsets, mask=dims[None, :] < HEAD_DIM, other=0.0)
    else:
        x = tl.load(ptr + offsets)
    return x


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_tokens, num_heads,
                           num_splits, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                           DIM_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t, h] = sum over splits of exp2(lse_s) * out_s / sum of exp2(lse_s)."""
    overlap_previous(PDL)
    token, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_BLOCK)
    dim_ok = dims < HEAD_DIM
    rows = (splits * num_tokens + token) * num_heads + head
    exists = splits < num_splits
    lse = tl.load(part_lse_ptr + rows, mask=exists, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
                    mask=exists[:, None] & dim_ok[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (token * num_heads + head) * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)
