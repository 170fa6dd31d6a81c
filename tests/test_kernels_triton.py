"""Each Triton kernel against its torch reference twin, on fresh random inputs, into
outputs poisoned with NaN so that any element a kernel fails to write fails the check.

On CPU the kernels run in Triton's interpreter at tiny shapes. Triton picks compiling or
interpreting when a kernel is defined, and other test modules import the kernels first in
this process, so each interpreter check runs in a fresh `python -m tests.test_kernels_triton
<check>` with TRITON_INTERPRET=1. On CUDA the same checks run in this process at real model
shapes (benchmarks/gpu/kernels_check.py runs them on the device machine).

fp8 caches (e4m3, e5m2): the attention runs in the interpreter against the torch twin
reading the same fp8 cache with the same scales. The fp8 write is checked on CUDA only: the
interpreter's float32 -> fp8 cast drops the rounding carry into the exponent (31.7 stores
as 16, triton 3.9), where the GPU's conversion rounds to nearest as torch does.

The interpreter multiplies bf16 matrices as their raw 16-bit patterns (triton 3.9), so the
attention checks use fp16 there for the low-precision path; bf16 attention is checked on
the GPU.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.activation import (gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton,
                                silu_and_mul_ref, silu_and_mul_triton)
from kernels.attention import paged_attention, paged_attention_ref
from kernels.attention_inputs import (HeadNorms, _norm_rope_write_kv_kernel,
                                      norm_rope_write_kv_ref, norm_rope_write_kv_triton)
from kernels.cache import quantize, write_kv, write_kv_ref, write_kv_triton
from kernels.fp8_gemv import PackedTiles, fp8_gemv, fp8_gemv_ref, fp8_gemv_triton
from kernels.gemv import (TUNED_TILES, GemvTiles, _gemv_kernel, _sum_splits_kernel, gemv,
                          gemv_ref, gemv_triton)
from kernels.int4 import _w4a16_gemm_kernel, _w4a16_gemv_kernel
from kernels.lora import lora_expand_ref, lora_expand_triton
from kernels.norm import (_gemma_norm_add_norm_kernel, _rms_norm_kernel,
                          gemma_norm_add_norm_ref, gemma_norm_add_norm_triton, rms_norm_ref,
                          rms_norm_triton)
from kernels.quant import (ScaledMmTiles, quantize_per_token_ref, quantize_per_token_triton,
                           scaled_mm, scaled_mm_ref, scaled_mm_triton)
from kernels.rotary import apply_rotary_ref, apply_rotary_triton, rope_cos_sin_cache
from kernels.sampling import (ARGMAX_CHUNK, BLOCK_TOP_P, FIXED_POINT, LOGPROBS_CHUNK,
                              MAX_KERNEL_LOGPROBS, ONE_BITS, RADIX_BITS, RADIX_BLOCK,
                              RADIX_COPIES, TOP_P_STEPS, _argmax_combine_kernel,
                              _chunk_argmax_kernel, _chunk_sums_kernel, _chunk_tops_kernel,
                              _top_combine_kernel, _top_p_bins_kernel, _top_p_pick_kernel,
                              _top_p_threshold_kernel, argmax_triton, gumbel_argmax_ref,
                              gumbel_argmax_triton, philox_uniform, top_logprobs_ref,
                              top_logprobs_triton, top_p_threshold_exact_ref,
                              top_p_threshold_radix, top_p_threshold_ref,
                              top_p_threshold_triton)
from kernels.triton_attention import (MAX_SPLITS, WIDE_FROM, AttentionConfig, TileConfig,
                                      _combine_splits_kernel, _paged_attention_kernel,
                                      default_config, paged_attention_triton, split_count,
                                      triton_decode_splits, visible_span)

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2 ** 31)
    return torch.Generator().manual_seed(seed), seed


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, device: str,
         scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, seed: int) -> None:
    """‖out − ref‖ / ‖ref‖ within the dtype's tolerance; NaN never passes."""
    error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert error <= TOLERANCE[ref.dtype], f"{what}: relative error {error:.3g} (seed {seed})"


# --- paged attention ---------------------------------------------------------------------

# (context length after the step, query length): decodes, a whole prompt, prefill chunks
# behind cached prefixes, a context that exactly fills its blocks
TINY_REQUESTS = [(1, 1), (37, 37), (70, 6), (45, 1), (64, 16), (33, 1), (96, 3)]
TINY_DECODES = [(5, 1), (63, 1), (64, 1), (17, 1), (100, 1)]


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def attention_inputs(shape: AttentionShape, requests: list[tuple[int, int]], padding: int,
                     dtype: torch.dtype, device: str, g: torch.Generator) -> dict:
    """A batch of `requests` then `padding` empty requests (seq_len 0, query_start_loc
    repeating) and `padding` tokens past the last request, as a padded CUDA-graph batch
    has; each request's blocks drawn from a shuffled pool; the whole cache random."""
    bs = shape.block_size
    blocks_needed = [math.ceil(ctx / bs) for ctx, _ in requests]
    num_blocks = 2 * sum(blocks_needed) + 3
    pool = torch.randperm(num_blocks, generator=g)
    table_width = max(blocks_needed) + 2  # entries past each context: other blocks
    block_tables = pool[torch.randint(0, num_blocks, (len(requests) + padding, table_width),
                                      generator=g)]
    taken = 0
    for r, n in enumerate(blocks_needed):
        block_tables[r, :n] = pool[taken:taken + n]
        taken += n
    q_lens = [q for _, q in requests] + [0] * padding
    query_start_loc = torch.tensor([0] + q_lens).cumsum(0)
    num_tokens = int(query_start_loc[-1]) + padding
    seq_lens = torch.tensor([ctx for ctx, _ in requests] + [0] * padding)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    return dict(
        q=rand(g, num_tokens, shape.num_heads, shape.head_dim, dtype=dtype, device=device),
        k_cache=rand(g, *cache_shape, dtype=dtype, device=device),
        v_cache=rand(g, *cache_shape, dtype=dtype, device=device),
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32))


def quantize_caches(inputs: dict, cache_dtype: torch.dtype, g: torch.Generator) -> None:
    """The caches in fp8 with random per-tensor scales (values up to about 4 / scale, well
    inside both formats' range, so saturation is not what is measured here)."""
    for name in ("k", "v"):
        scale = (torch.rand(1, generator=g) * 0.05 + 0.01).to(inputs["q"].device)
        inputs[f"{name}_cache"] = quantize(inputs[f"{name}_cache"], cache_dtype, scale)
        inputs[f"{name}_scale"] = scale


def check_attention(shape: AttentionShape, requests: list[tuple[int, int]], dtype: torch.dtype,
                    device: str, padding: int = 0, config: AttentionConfig | None = None,
                    max_seq_len: int | None = None, cache_dtype: torch.dtype | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    q_scale: float = 1.0,
                    spans: list[list[tuple[int, int]]] | None = None) -> None:
    """cache_dtype: an fp8 cache (with scales) instead of one of q's dtype.
    spans: per request, (first, last) positions whose queries see up to `last` (key
    limits: an image's tokens attending both ways).
    sliding_window, soft_cap, spans: as paged_attention takes them; each must change the
    reference's answer here (else the case tests nothing; a window at least as long as
    every context cannot), and with a window the kernel reads a cache whose V is NaN at
    the keys no tile of the request may load. q_scale: scores that many times larger."""
    g, seed = fresh_generator()
    inputs = attention_inputs(shape, requests, padding, dtype, device, g)
    inputs["q"] *= q_scale
    if cache_dtype is not None:
        quantize_caches(inputs, cache_dtype, g)
    scale = shape.head_dim ** -0.5
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap,
                   key_limits=None if spans is None else span_limits(
                       requests, spans, inputs["q"].shape[0], device))
    ref = paged_attention_ref(**inputs, scale=scale, **options)
    real = sum(q for _, q in requests)
    longest = max(ctx for ctx, _ in requests)
    for name, value in options.items():
        if value is not None and not (name == "sliding_window" and value >= longest):
            without = paged_attention_ref(**inputs, scale=scale, **(options | {name: None}))
            assert_changes(without[:real], ref[:real], f"{name}={value}")
    kernel_inputs = inputs
    if sliding_window is not None:
        used = config or default_config(inputs["q"], inputs["k_cache"].dtype)
        block_n = max(used.decode.block_n, used.prefill.block_n)
        kernel_inputs = inputs | {"v_cache": poison_skipped_keys(
            inputs["v_cache"], inputs["block_tables"], requests, sliding_window, block_n)}
    out = poisoned(inputs["q"].shape, dtype, device)
    paged_attention_triton(**kernel_inputs, scale=scale,
                           max_query_len=max(q for _, q in requests), max_seq_len=max_seq_len,
                           config=config, out=out, **options)
    what = f"attention {shape} {dtype} {cache_dtype} window {sliding_window} cap {soft_cap}"
    assert_close(out[:real], ref[:real], what, seed)
    assert out[real:].isfinite().all(), f"padding rows not finite (seed {seed})"


def span_limits(requests: list[tuple[int, int]], spans: list[list[tuple[int, int]]],
                num_tokens: int, device: str) -> torch.Tensor:
    """int32 [num_tokens]: each query's last visible key position, its span's last where
    it is inside one (padding rows: 0)."""
    limits = torch.zeros(num_tokens, dtype=torch.int32)
    token = 0
    for (seq_len, q_len), request_spans in zip(requests, spans):
        positions = torch.arange(seq_len - q_len, seq_len, dtype=torch.int32)
        for first, last in request_spans:
            positions = torch.where((positions >= first) & (positions <= last), last,
                                    positions)
        limits[token:token + q_len] = positions
        token += q_len
    return limits.to(device)


def assert_changes(without: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The option moves the answer well past the tolerance the kernel is held to."""
    change = ((without.double() - ref.double()).norm() / ref.double().norm()).item()
    assert change > 10 * TOLERANCE[ref.dtype], f"{what} changes the answer by only {change:.3g}"


def poison_skipped_keys(v_cache: torch.Tensor, block_tables: torch.Tensor,
                        requests: list[tuple[int, int]], window: int,
                        block_n: int) -> torch.Tensor:
    """A copy of v_cache with NaN at each request's keys below the BLOCK_N (the widest of
    the config's) that holds its first query's lowest visible key: a kernel that loads
    them, even masked (p = 0 times NaN), returns NaN."""
    poisoned_v = v_cache.clone()
    block_size = v_cache.shape[1]
    for r, (seq_len, q_len) in enumerate(requests):
        skipped = max(seq_len - q_len - window + 1, 0) // block_n * block_n
        keys = torch.arange(skipped, device=v_cache.device)
        blocks = block_tables[r, keys // block_size].long()
        poisoned_v[blocks, keys % block_size] = float("nan")
    return poisoned_v


def tiny_config(decode_block_n: int, prefill_block_m: int, prefill_block_n: int,
                split: bool, prefetch_v: bool = False) -> AttentionConfig:
    """Tile shapes for tiny batches; with split, every context is cut into parts of 16
    keys, as many as MAX_SPLITS allows: split-K at tiny shapes. prefetch_v: both tiles
    load V with K."""
    return AttentionConfig(TileConfig(16, decode_block_n, 4, 1, prefetch_v),
                           TileConfig(prefill_block_m, prefill_block_n, 4, 1, prefetch_v),
                           target_programs=1 << 20 if split else 1, min_partition=16)


def test_window_bounds_the_split_count() -> None:
    """Splits are cut from the keys a tile walks: with a window of 1024 a decode batch
    sized for 131072 keys gets no part under min_partition keys (without the window it
    would take MAX_SPLITS parts of the window's few keys), and a window longer than the
    context changes nothing."""
    config = AttentionConfig(TileConfig(16, 64, 4, 3), TileConfig(64, 64, 4, 2),
                             target_programs=4096, min_partition=64)
    group, busy = 4, 8
    unwindowed = split_count(busy, visible_span(131072, None, [config.decode], group), config)
    assert unwindowed == MAX_SPLITS
    windowed = split_count(busy, visible_span(131072, 1024, [config.decode], group), config)
    assert 1 < windowed < MAX_SPLITS
    walked = 1024 + config.decode.queries(group) + config.decode.block_n
    assert (windowed - 1) * config.min_partition < walked
    assert visible_span(3000, 8192, [config.decode, config.prefill], group) == 3000


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid and launches nothing."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []
        self.options: list[dict] = []  # each launch's keyword arguments (the constexprs)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        self.grids.append(grid)
        return lambda *args, **kwargs: self.options.append(kwargs)


def test_decode_splits_name_the_launchs_parts(monkeypatch) -> None:
    """triton_decode_splits, which the decode graphs' context bounds are chosen by
    (services/worker/cuda_graphs.py), gives the parts a decode launch cuts its contexts
    into at each bound, with a window and without (on the CPU: 2 programs wanted)."""
    import kernels.triton_attention as triton_attention

    attention = LaunchSpy()
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", attention)
    monkeypatch.setattr(triton_attention, "_combine_splits_kernel", LaunchSpy())
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 1, 64, dtype=torch.bfloat16)
    tables = torch.zeros(1, 8, dtype=torch.int32)
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([100], dtype=torch.int32)
    for window in (None, 64):
        for bound in (16, 128, 129, 1024):
            paged_attention_triton(q, cache, cache, tables, starts, lens, 0.1, max_query_len=1,
                                   max_seq_len=bound, sliding_window=window)
            assert attention.grids[-1][2] == triton_decode_splits(q, cache.dtype, 1, bound,
                                                                  window), (window, bound)
    assert [grid[2] for grid in attention.grids] == [1, 1, 2, 2] * 2


def test_wide_decode_batches_take_the_wide_tile(monkeypatch) -> None:
    """A decode batch of WIDE_FROM requests at heads of 128 walks 64 keys a step with V
    loaded beside K; one request fewer, heads of 64, or an fp8 cache keep the default."""
    import kernels.triton_attention as triton_attention

    attention = LaunchSpy()
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", attention)
    for num_reqs, head_dim, cache_dtype in [(WIDE_FROM, 128, torch.bfloat16),
                                            (WIDE_FROM - 1, 128, torch.bfloat16),
                                            (4 * WIDE_FROM, 64, torch.bfloat16),
                                            (WIDE_FROM, 128, torch.float8_e4m3fn)]:
        q = torch.zeros(num_reqs, 2, head_dim, dtype=torch.bfloat16)
        cache = torch.zeros(num_reqs, 16, 1, head_dim, dtype=cache_dtype)
        scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1)) \
            if cache_dtype in FP8 else {}
        paged_attention_triton(q, cache, cache, torch.zeros(num_reqs, 1, dtype=torch.int32),
                               torch.arange(num_reqs + 1, dtype=torch.int32),
                               torch.full((num_reqs,), 16, dtype=torch.int32), 0.1,
                               max_query_len=1, max_seq_len=16, **scales)
    tiles = [(o["BLOCK_N"], o["PREFETCH_V"], o["num_stages"]) for o in attention.options]
    default = default_config(torch.zeros(1, 2, 128, dtype=torch.bfloat16)).decode
    assert tiles[0] == (64, True, 1) and tiles[1] == (default.block_n, False, 1)
    assert not tiles[2][1] and not tiles[3][1]


# --- the small kernels -------------------------------------------------------------------

def check_write_kv(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, device: str, cache_dtype: torch.dtype | None = None) -> None:
    """Into a NaN cache through a fused qkv view; skipped slots and every slot no token
    names must stay NaN. cache_dtype: an fp8 cache, with scales small enough that some
    values saturate; its bytes must equal the reference's."""
    g, seed = fresh_generator()
    cache_dtype = cache_dtype or dtype
    scales = {}
    if cache_dtype in FP8:  # 10 / 448 saturates e4m3 at about 4.5 sigma, e5m2 never
        scales = {"k_scale": torch.tensor([0.01], device=device),
                  "v_scale": torch.tensor([0.03], device=device)}
    num_blocks = 2 * math.ceil(num_tokens / block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    qkv = rand(g, num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=device)
    k, v = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = poisoned(cache_shape, cache_dtype, device)
    v_cache = poisoned(cache_shape, cache_dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = slots.to(device)
    write_kv_triton(k, v, k_cache, v_cache, slots, **scales)
    write_kv_ref(k, v, expected_k, expected_v, slots, **scales)
    # compared as bytes: the untouched NaN slots then compare equal, and torch.equal has
    # no fp8 kernels on CPU
    for name, out, ref in (("K", k_cache, expected_k), ("V", v_cache, expected_v)):
        assert torch.equal(out.float().isnan(), ref.float().isnan()), \
            f"write_kv {name} slots (seed {seed})"
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), \
            f"write_kv {name} (seed {seed})"


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device: str,
                   with_residual: bool, gemma: bool = False, parts: int = 0,
                   split_parts: bool = False) -> None:
    """A strided view as input (a slice of a wider tensor), as the q/k norms get one.
    gemma: Gemma's (1 + weight) weighting against its own twin. parts: x is [T, parts,
    hidden], a MoE layer's unsummed top-k terms, summed into the residual add.
    split_parts: those parts are instead a GEMV's float32 partial sums over a split K, laid
    out [parts, T, hidden] as it writes them, rounded to dtype once summed."""
    g, seed = fresh_generator()
    x_shape = (shape[0], parts, *shape[1:]) if parts else shape
    if split_parts:
        wide = rand(g, parts, shape[0], shape[-1] + 8, dtype=torch.float32, device=device,
                    scale=3.0).permute(1, 0, 2)
    else:
        wide = rand(g, *x_shape[:-1], shape[-1] + 8, dtype=dtype, device=device, scale=3.0)
    x = wide[..., 8:]
    weight = rand(g, shape[-1], dtype=dtype, device=device)
    residual = rand(g, *shape, dtype=dtype, device=device) if with_residual else None
    out = poisoned(shape, dtype, device)
    residual_out = poisoned(shape, dtype, device) if with_residual else None
    rms_norm_triton(x, weight, 1e-6, residual, out=out, residual_out=residual_out,
                    gemma=gemma)
    ref = rms_norm_ref(x, weight, 1e-6, residual, gemma)
    if with_residual:
        assert_close(residual_out, ref[1], f"rms_norm residual {shape} {dtype}", seed)
        ref = ref[0]
    assert_close(out, ref, f"rms_norm {shape} {dtype}", seed)


def check_gemma_norm_add_norm(num_tokens: int, hidden: int, dtype: torch.dtype,
                              device: str) -> None:
    """Gemma's post-norm, residual add and pre-norm in one kernel against its twin (the two
    norms), from strided inputs; weights around 0 as Gemma stores them."""
    g, seed = fresh_generator()
    x = rand(g, num_tokens, hidden + 8, dtype=dtype, device=device, scale=3.0)[:, 8:]
    residual = rand(g, num_tokens, hidden + 8, dtype=dtype, device=device)[:, :hidden]
    weights = [rand(g, hidden, dtype=dtype, device=device, scale=0.3) for _ in range(2)]
    out = poisoned((num_tokens, hidden), dtype, device)
    residual_out = poisoned((num_tokens, hidden), dtype, device)
    gemma_norm_add_norm_triton(x, residual, *weights, 1e-6, out=out, residual_out=residual_out)
    ref_out, ref_residual = gemma_norm_add_norm_ref(x, residual, *weights, 1e-6)
    assert_close(residual_out, ref_residual, f"gemma norm-add-norm residual {dtype}", seed)
    assert_close(out, ref_out, f"gemma norm-add-norm {dtype}", seed)


def check_rotary(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, partial_rotary_factor: float = 1.0) -> None:
    """q and k as strided views of one fused qkv tensor, Llama-3 scaled frequencies; with a
    partial_rotary_factor only the leading dims rotate and the rest are copied."""
    g, seed = fresh_generator()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "partial_rotary_factor": partial_rotary_factor}
    cache = rope_cos_sin_cache(head_dim, 4096, 500000.0, scaling).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    qkv = rand(g, num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype,
               device=device)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    q_out, k_out = poisoned(q.shape, dtype, device), poisoned(k.shape, dtype, device)
    apply_rotary_triton(positions, q, k, cache, q_out=q_out, k_out=k_out)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache)
    assert_close(q_out, q_ref, f"rotary q {dtype}", seed)
    assert_close(k_out, k_ref, f"rotary k {dtype}", seed)


def check_norm_rope_write_kv(num_tokens: int, num_heads: int, num_kv_heads: int,
                             head_dim: int, dtype: torch.dtype, device: str,
                             norm: str | None = None, partial_rotary_factor: float = 1.0,
                             cache_dtype: torch.dtype | None = None) -> None:
    """The fused q/k norm + rotary + cache write against its twin (the separate ops), from
    a strided qkv (a slice of a wider projection output) into NaN caches: q, and the cache
    slots (padding tokens' and unnamed slots stay NaN). norm: None, "llama" or "gemma"
    weighting. cache_dtype: an fp8 cache with scales that saturate some values, compared
    dequantized (rounding may differ by one fp8 step where the statistics' order does)."""
    g, seed = fresh_generator()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "partial_rotary_factor": partial_rotary_factor}
    cos_sin = rope_cos_sin_cache(head_dim, 4096, 500000.0, scaling).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = rand(g, num_tokens, width + 16, dtype=dtype, device=device, scale=2.0)[:, 16:]
    norms = None
    if norm is not None:
        weights = [rand(g, head_dim, dtype=dtype, device=device) for _ in range(2)]
        norms = HeadNorms(*weights, eps=1e-6, gemma=norm == "gemma")
    cache_dtype = cache_dtype or dtype
    scales = {}
    if cache_dtype in FP8:
        scales = {"k_scale": torch.tensor([0.01], device=device),
                  "v_scale": torch.tensor([0.02], device=device)}
    block_size = 16
    num_blocks = 2 * math.ceil(num_tokens / block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    padding = torch.rand(num_tokens, generator=g) < 0.25
    padding[0] = False  # some slot is written: an all-padding draw compares nothing
    slots[padding] = -1
    slots = slots.to(device)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = poisoned(cache_shape, cache_dtype, device), poisoned(cache_shape,
                                                                            cache_dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_out = poisoned((num_tokens, num_heads, head_dim), dtype, device)
    norm_rope_write_kv_triton(qkv, positions, cos_sin, num_heads, k_cache, v_cache, slots,
                              norms, q_out=q_out, **scales)
    q_ref = norm_rope_write_kv_ref(qkv, positions, cos_sin, num_heads, expected_k,
                                   expected_v, slots, norms, **scales)
    what = f"norm_rope_write_kv {num_heads}/{num_kv_heads}x{head_dim} {dtype} {norm}"
    assert_close(q_out, q_ref, f"{what} q", seed)
    for name, out, ref in (("K", k_cache, expected_k), ("V", v_cache, expected_v)):
        written = ~ref.float().isnan()
        assert torch.equal(out.float().isnan(), ~written), f"{what} {name} slots (seed {seed})"
        if cache_dtype in FP8:
            assert_fp8_codes_close(out[written], ref[written], f"{what} {name}", seed)
        else:
            assert_close(out[written], ref[written], f"{what} {name}", seed)


def assert_fp8_codes_close(out: torch.Tensor, ref: torch.Tensor, what: str, seed: int
                           ) -> None:
    """Few fp8 codes differ, and the dequantized values are close. The kernel rounds
    where the twin rounds, but its norm statistics sum in another order; a value whose
    bf16 rounding flips lands a step away in fp8 (an e5m2 step is up to a quarter of the
    value), and further near zero, where the rotation cancels. So the bound is wider than
    bf16's: on the H100, e5m2 caches gave 1.0-1.1% where every code was within reach."""
    differing = (out.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
    assert differing <= 0.02, f"{what}: {differing:.1%} of fp8 codes differ (seed {seed})"
    error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert error <= 0.03, f"{what}: relative error {error:.3g} (seed {seed})"


def check_silu_and_mul(num_tokens: int, d: int, dtype: torch.dtype, device: str) -> None:
    g, seed = fresh_generator()
    x = rand(g, num_tokens, 2 * d, dtype=dtype, device=device, scale=4.0)
    out = poisoned((num_tokens, d), dtype, device)
    silu_and_mul_triton(x, out=out)
    assert_close(out, silu_and_mul_ref(x), f"silu_and_mul {dtype}", seed)


def check_gelu_tanh_and_mul(num_tokens: int, d: int, dtype: torch.dtype, device: str
                            ) -> None:
    g, seed = fresh_generator()
    x = rand(g, num_tokens, 2 * d, dtype=dtype, device=device, scale=4.0)
    out = poisoned((num_tokens, d), dtype, device)
    gelu_tanh_and_mul_triton(x, out=out)
    assert_close(out, gelu_tanh_and_mul_ref(x), f"gelu_tanh_and_mul {dtype}", seed)


def check_lora(num_tokens: int, in_features: int, starts: tuple[int, ...], out_features: int,
               slots: int, rank: int, dtype: torch.dtype, device: str) -> None:
    """Tokens of `slots` adapters and base rows (-1) interleaved, over the slices that
    `starts` splits the output into; slot 0 holds a smaller adapter padded with zeros to
    `rank`, as the worker's slots hold one. The input is the base weight's matmul with the
    stacked A rows below it, as the worker runs it."""
    g, seed = fresh_generator()
    num_slices = len(starts) + 1
    x = rand(g, num_tokens, in_features, dtype=dtype, device=device)
    w = rand(g, out_features, in_features, dtype=dtype, device=device, scale=0.01)
    a = rand(g, num_slices, slots, rank, in_features, dtype=dtype, device=device, scale=0.1)
    b = rand(g, slots, out_features, rank, dtype=dtype, device=device, scale=0.1)
    a[:, 0, rank // 2:], b[0, :, rank // 2:] = 0, 0
    scaling = (torch.rand(slots, generator=g) + 0.5).to(device)
    index = torch.randint(-1, slots, (num_tokens,), generator=g)
    index[:slots + 1] = torch.arange(-1, slots)  # every slot and the base model present
    index = index.to(device=device, dtype=torch.int32)
    y_ext = x @ torch.cat([w, a.view(-1, in_features)]).T
    out = lora_expand_triton(y_ext, b, scaling, index, starts)
    ref = lora_expand_ref(y_ext, b, scaling, index, starts)
    base = y_ext[:, :out_features]
    what = f"lora {dtype} {num_tokens}x{in_features}->{out_features} slices at {starts}"
    assert_close(out - base, ref - base, what, seed)
    assert torch.equal(out[index < 0], base[index < 0]), f"base rows changed (seed {seed})"


def check_gumbel_argmax(rows: int, vocab: int, dtype: torch.dtype, device: str) -> None:
    """Token for token against the twin fed the kernel's own uniforms (a fresh seed)."""
    g, seed = fresh_generator()
    logits = rand(g, rows, vocab, dtype=dtype, device=device, scale=3.0)
    temperature = (torch.rand(rows, generator=g) * 1.9 + 0.1).to(device)
    out = gumbel_argmax_triton(logits, temperature, seed)
    ref = gumbel_argmax_ref(logits, temperature, philox_uniform(rows, vocab, seed,
                                                                logits.device))
    assert torch.equal(out, ref), f"gumbel argmax {dtype} (seed {seed})"


def check_argmax(rows: int, vocab: int, dtype: torch.dtype, device: str) -> None:
    """Each row's first maximum, as torch.argmax picks, with ties planted: a row's largest
    logit twice in two chunks (the lower column wins), twice in one chunk, in the partial
    last chunk, a row of -inf (column 0) and one whose largest is +inf."""
    chunk = ARGMAX_CHUNK
    assert rows >= 5 and vocab >= 3 * chunk
    g, seed = fresh_generator()
    logits = rand(g, rows, vocab, dtype=dtype, device=device, scale=3.0)
    logits[0, [chunk + 5, 2 * chunk + 1]] = 50.0
    logits[1, [chunk + 9, chunk + 3]] = 50.0
    logits[2, vocab - 1] = 50.0
    logits[3] = float("-inf")
    logits[4, [chunk - 1, 7]] = float("inf")
    out = argmax_triton(logits)
    assert out.dtype == torch.int64
    ref = logits.float().argmax(dim=-1)
    assert torch.equal(out, ref), f"argmax {dtype} {rows}x{vocab}: {out} vs {ref} (seed {seed})"
    assert out[:5].tolist() == [chunk + 5, chunk + 3, vocab - 1, 0, 7]
    assert argmax_triton(logits[:0]).shape == (0,)


def split_top(packed: torch.Tensor, rows: int, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_logprobs' packed output as (tokens, ids [rows, k + 1], logprobs [rows, k + 1],
    ranks)."""
    width = k + 1
    ids = packed[rows:rows + rows * width].view(rows, width)
    values = packed[rows + rows * width:rows + 2 * rows * width]
    return (packed[:rows], ids, values.to(torch.int32).view(torch.float32).view(rows, width),
            packed[rows + 2 * rows * width:])


def check_top_logprobs(rows: int, vocab: int, k: int, dtype: torch.dtype, device: str,
                       tile: tuple[int, int] = (LOGPROBS_CHUNK, 4)) -> None:
    """The logprobs of the chosen token and the k likeliest against the twin, for given
    tokens and for greedy's (none given): tokens, ids and ranks exactly, logprobs to
    float32's rounding of a sum over the row. Row 0's first chunk is -inf (a grammar
    mask's), row 1 has fewer finite logits than k, row 2's maximum is in its first and
    last columns (two chunks of equal maxima), and bf16 logits tie, where the first
    maximum is the likeliest and the lower column comes first. tile: the kernel's chunk
    and warps."""
    g, seed = fresh_generator()
    logits = rand(g, rows, vocab, dtype=dtype, device=device, scale=3.0)
    logits[0, :min(tile[0], vocab // 2)] = float("-inf")
    if rows > 1:
        logits[1, max(1, k // 2):] = float("-inf")
    if rows > 2:
        logits[2, [vocab - 1, 0]] = logits[2].max() + 1
    given = torch.randint(vocab // 2, vocab, (rows,), generator=g).to(device)
    given[1:2] = 0  # row 1's chosen token is finite
    for chosen in (given, None):
        got = split_top(top_logprobs_triton(logits, k, chosen, tile), rows, k)
        want = split_top(top_logprobs_ref(logits, k, chosen), rows, k)
        what = f"top {k} logprobs {rows}x{vocab} {dtype} chosen {chosen is not None} (seed {seed})"
        for i in (0, 1, 3):
            assert torch.equal(got[i], want[i]), what
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5, msg=what)
    assert torch.equal(split_top(top_logprobs_triton(logits, k, tile=tile), rows, k)[0],
                       logits.argmax(dim=-1)), "greedy's token is torch.argmax's"


def check_gumbel_distribution(device: str, draws: int = 1500) -> None:
    """The kernel draws from softmax(logits / T): one row repeated `draws` times (each row
    has its own noise), every token's frequency within 4.5 standard errors."""
    g, seed = fresh_generator()
    logits = torch.randn(6, generator=g)
    temperature = 0.7
    out = gumbel_argmax_triton(logits.to(device).repeat(draws, 1),
                               torch.full((draws,), temperature, device=device), seed)
    freq = torch.bincount(out.cpu(), minlength=6).double() / draws
    p = torch.softmax(logits.double() / temperature, dim=0)
    bound = 4.5 * (p * (1 - p) / draws).sqrt() + 1e-3
    assert ((freq - p).abs() <= bound).all(), f"{freq} vs {p} (seed {seed})"


def check_sampler_fused_logprobs(vocab: int, device: str, top: int = 2) -> None:
    """Temperature-only rows that ask for logprobs keep the sampler's fused draw: the tokens
    are the kernel's for the sampler's first seed, and each asking row's logprobs those of
    its raw logits (what the general path reports), the others' none. `top`: the first
    row's logprobs; on CUDA one pass a row (top_logprobs_triton) finds them."""
    from common.sampling_params import SamplingParams
    from services.worker.sampler import Sampler, SamplingRow, _plain_random, unpack_logprobs

    g, seed = fresh_generator()
    temperatures, asks = [0.7, 1.3, 0.5], [top, None, 0]
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=k), [1, 2], [3], None)
            for t, k in zip(temperatures, asks)]
    assert all(_plain_random(row) for row in rows)
    logits = rand(g, len(rows), vocab, dtype=torch.float32, device=device, scale=3.0)
    out = Sampler(torch.device(device), seed)._sample_fused(logits.clone(), rows)
    uniform = philox_uniform(len(rows), vocab, random.Random(seed).getrandbits(31),
                             logits.device)
    tokens = gumbel_argmax_ref(logits, torch.tensor(temperatures, device=device), uniform)
    assert torch.equal(out.token_ids, tokens), f"fused tokens (seed {seed})"
    lp = out.logprobs
    assert lp is not None and lp.rows == [0, 2] and lp.widths == [top + 1, 1]
    columns = unpack_logprobs(out.packed.cpu(), len(rows), lp)
    assert columns is not None and out.packed[:len(rows)].equal(tokens)
    _, ids, values, ranks = split_top(top_logprobs_ref(logits[[0, 2]], max(top, 1),
                                                       tokens[[0, 2]]), 2, max(top, 1))
    ids, values = ids[:, :top + 1].tolist(), values[:, :top + 1].tolist()
    assert columns.widths == [top + 1, 0, 1]
    assert columns.token_ids == ids[0] + ids[1][:1], f"fused ids (seed {seed})"
    assert columns.ranks == ranks.tolist()
    assert columns.logprobs == pytest.approx(values[0] + values[1][:1], rel=1e-5, abs=1e-5)


def check_top_p_threshold(rows: int, vocab: int, device: str) -> None:
    """Both kernels' threshold equal to the twin's (and so the same top-p set as a sort),
    on logits with many exact ties and a third of the rows' tokens dropped, top_p across
    (0, 1]: so few distinct probabilities that no row's mass at a step lies within float
    rounding of top_p, where the radix kernel's exact sums and the twin's float ones could
    differ (check_top_p_exact_masses covers that)."""
    g, seed = fresh_generator()
    logits = torch.round(rand(g, rows, vocab, dtype=torch.float32, device=device,
                              scale=4.0) * 2) / 2
    logits[::3, :vocab // 3] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    choices = torch.tensor([1e-6, 0.1, 0.5, 0.9, 0.99, 1.0])
    top_p = choices[torch.randint(0, len(choices), (rows,), generator=g)].to(device)
    ref = top_p_threshold_ref(probs, top_p)
    for kernel in (top_p_threshold_triton, top_p_threshold_radix):
        out = kernel(probs, top_p)
        assert torch.equal(out, ref), f"{kernel.__name__} (seed {seed})"
    assert torch.equal(ref[top_p == 1.0], torch.zeros_like(ref[top_p == 1.0]))


def assert_top_p_bounds(probs: torch.Tensor, top_p: torch.Tensor, threshold: torch.Tensor,
                        slack: float, what: str) -> None:
    """threshold is the smallest pattern whose mass strictly above is below top_p, with
    masses summed in float64 (close to exact here) and `slack` allowed either side."""
    wide = probs.double()
    for row in torch.nonzero(top_p < 1.0).flatten().tolist():
        t, p = threshold[row], top_p[row].item()
        assert wide[row][wide[row] > t].sum() < p + slack, f"{what}: mass above, row {row}"
        if t > 0:  # the pattern below t must still leave top_p's mass above it
            below = (t.view(torch.int32) - 1).view(torch.float32)
            assert wide[row][wide[row] > below].sum() >= p - slack, f"{what}: row {row}"


def check_top_p_exact_masses(rows: int, vocab: int, device: str) -> None:
    """The radix kernel against its fixed-point twin, bit for bit, where float sums round:
    most of each row's tokens tiny (1e-7 down past 2**-62, where the fixed point drops
    them) and tied in runs, a few large ones, zeros, top_p up to 1 - 1e-6 so that it
    falls among the tiny ones. Both land on the exact threshold (within 1e-10: the
    truncation, float64's sums); the float32 twin only within its rounding, 1e-5."""
    g, seed = fresh_generator()
    tiny = torch.exp(-torch.randint(16, 50, (rows, vocab), generator=g).double())
    probs = torch.where(torch.rand(rows, vocab, generator=g) < 0.01,
                        torch.rand(rows, vocab, generator=g, dtype=torch.float64), tiny)
    probs[:, ::7] = 0.0
    probs = (probs / probs.sum(dim=-1, keepdim=True)).float().to(device)
    choices = torch.tensor([1e-6, 0.3, 0.9, 0.999, 1 - 1e-5, 1 - 1e-6, 1.0])
    top_p = choices[torch.randint(0, len(choices), (rows,), generator=g)].to(device)
    out = top_p_threshold_radix(probs, top_p)
    assert torch.equal(out, top_p_threshold_exact_ref(probs, top_p)), f"radix (seed {seed})"
    assert_top_p_bounds(probs, top_p, out, 1e-10, f"radix (seed {seed})")
    assert_top_p_bounds(probs, top_p, top_p_threshold_ref(probs, top_p), 1e-5,
                        f"float twin (seed {seed})")


def check_quantize(rows: int, cols: int, group: int | None, dtype: torch.dtype,
                   qdtype: torch.dtype, device: str, values: bool = True) -> None:
    """The scales equal the twin's; the quantized values too (values=False: fp8 in the
    interpreter, whose cast rounds differently)."""
    g, seed = fresh_generator()
    x = rand(g, rows, cols, dtype=dtype, device=device, scale=3.0)
    x[0] = 0  # an all-zero row
    q, scale = quantize_per_token_triton(x, qdtype, group)
    q_ref, scale_ref = quantize_per_token_ref(x, qdtype, group)
    assert torch.equal(scale, scale_ref), f"quantize scales (seed {seed})"
    if values:
        assert torch.equal(q.float(), q_ref.float()), f"quantize {qdtype} (seed {seed})"


def check_scaled_mm(rows: int, n: int, k: int, block_n: int, group_k: int,
                    qdtype: torch.dtype, out_dtype: torch.dtype, device: str,
                    bias: bool = True, dispatch: bool = False,
                    tiles: ScaledMmTiles | None = None) -> None:
    """The GEMM of twin-quantized operands against the twin; dispatch: through
    scaled_mm (torch._scaled_mm or the decode tiles where they apply) instead of the
    Triton kernel at `tiles` (None: its default)."""
    g, seed = fresh_generator()
    a = quantize_per_token_ref(rand(g, rows, k, dtype=torch.float32, device=device),
                               qdtype, group_k if group_k < k else None)
    b = quantize_per_token_ref(rand(g, n, k, dtype=torch.float32, device=device), qdtype)[0]
    b_scale = 0.5 + torch.rand(-(-n // block_n), -(-k // group_k), generator=g).to(device)
    b_bias = rand(g, n, dtype=out_dtype, device=device) if bias else None
    if dispatch:
        out = scaled_mm(a[0], a[1], b, b_scale, block_n, group_k, out_dtype, b_bias)
    else:
        out = scaled_mm_triton(a[0], a[1], b, b_scale, block_n, group_k, out_dtype, b_bias,
                               tiles)
    ref = scaled_mm_ref(a[0], a[1], b, b_scale, block_n, group_k, out_dtype, b_bias)
    assert_close(out, ref, f"scaled_mm {qdtype} {block_n}x{group_k}", seed)


def check_fp8_gemv(rows: int, n: int, k: int, scales: str, dtype: torch.dtype, device: str,
                   tiles: GemvTiles | PackedTiles | None = None, bias: bool = True,
                   x_scale: float = 1.0) -> None:
    """The w8a16 GEMV (tiles None: the default table's) against its dequantize-then-matmul
    twin; scales "tensor", "channel" (both given as their element count, the block read
    from it), or "blocks" (128x128) and "rows" (1x64: per channel and K group), whose
    shape is named; x_scale: the activations' size."""
    g, seed = fresh_generator()
    w = rand(g, n, k, dtype=torch.float32, device=device, scale=100.0).clamp(-448, 448)
    w = w.to(torch.float8_e4m3fn)
    block = {"tensor": None, "channel": None, "blocks": (128, 128), "rows": (1, 64)}[scales]
    count = {"tensor": (1,), "channel": (n,)}.get(scales) or (-(-n // block[0]),
                                                               -(-k // block[1]))
    w_scale = (0.5 + torch.rand(*count, generator=g)).to(device) / 100
    x = rand(g, rows, k, dtype=dtype, device=device, scale=x_scale)
    b = rand(g, n, dtype=dtype, device=device, scale=x_scale) if bias else None
    out = fp8_gemv_triton(x, w, w_scale, b, block, tiles)
    ref = fp8_gemv_ref(x, w, w_scale, b, block)
    assert_close(out, ref, f"fp8_gemv {rows}x{k} -> {n} {scales} {tiles}", seed)



def check_gemv(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
               tiles: GemvTiles | None = None, bias: bool = True) -> None:
    """The 16-bit GEMV (tiles None: the table's) against its float32 twin; weights of
    unit rows' scale, so that outputs stay about 1 at any K."""
    g, seed = fresh_generator()
    w = rand(g, n, k, dtype=dtype, device=device, scale=k ** -0.5)
    x = rand(g, rows, k, dtype=dtype, device=device)
    b = rand(g, n, dtype=dtype, device=device) if bias else None
    out = gemv_triton(x, w, b, tiles)
    assert_close(out, gemv_ref(x, w, b), f"gemv {rows}x{k} -> {n} {dtype} {tiles}", seed)

# --- interpreter checks: tiny shapes, each run in a subprocess -----------------------------

CHECKS: dict[str, Callable[[], None]] = {}


def interpreter_check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


@interpreter_check
def attention_mixed_batches() -> None:
    """Decodes and prefill chunks in one batch (two launches: decode and prefill tiles),
    GQA 1, 2, 3 and 4, heads 64 and 128, blocks 16 and 32, fp32 and fp16, split-K on and
    off (splits straddle the causal edge of prefill tiles), V loaded with K and after the
    scores."""
    for shape, dtype, config in [
            (AttentionShape(2, 2, 64, 16), torch.float32, tiny_config(16, 32, 16, False)),
            (AttentionShape(4, 2, 128, 32), torch.float16,
             tiny_config(32, 64, 16, True, prefetch_v=True)),
            (AttentionShape(8, 2, 64, 32), torch.float32, tiny_config(16, 32, 32, True)),
            (AttentionShape(6, 2, 128, 16), torch.float16,
             tiny_config(16, 64, 32, False, prefetch_v=True))]:
        check_attention(shape, TINY_REQUESTS, dtype, "cpu", padding=2, config=config)


@interpreter_check
def attention_padded_decode_batch() -> None:
    """A CUDA-graph-style decode batch (one launch): padded rows, and a max_seq_len far
    above the actual contexts (the split count comes from it, the parts from the real
    lengths)."""
    check_attention(AttentionShape(4, 1, 128, 16), TINY_DECODES, torch.float16, "cpu",
                    padding=3, config=tiny_config(16, 64, 16, True), max_seq_len=4096)
    check_attention(AttentionShape(4, 2, 64, 32), TINY_DECODES, torch.float32, "cpu",
                    padding=2, max_seq_len=4096)


# longer contexts than TINY_REQUESTS': windows that skip several blocks, a prefill chunk
# wider than the small windows behind a cached prefix
WINDOW_REQUESTS = TINY_REQUESTS + [(200, 1), (170, 40)]


@interpreter_check
def attention_sliding_window() -> None:
    """Windows of 3 (below a cache block and BLOCK_N; prefill tiles wider than it have no
    unmasked keys), 24 (above a block, below BLOCK_N), 70 (several blocks and BLOCK_Ns)
    and 1000 (longer than every context); decodes, whole prompts and chunks behind a
    prefix in one batch; split-K on and off; a padded decode batch sized for 4096."""
    for shape, dtype, config, window in [
            (AttentionShape(4, 2, 64, 16), torch.float32, tiny_config(16, 32, 32, True), 3),
            (AttentionShape(2, 2, 64, 16), torch.float16,
             tiny_config(32, 64, 32, False, prefetch_v=True), 24),
            (AttentionShape(6, 2, 64, 32), torch.float16, tiny_config(16, 64, 16, True), 70),
            (AttentionShape(4, 1, 64, 16), torch.float32, tiny_config(16, 16, 16, False),
             1000)]:
        check_attention(shape, WINDOW_REQUESTS, dtype, "cpu", padding=2, config=config,
                        sliding_window=window)
    check_attention(AttentionShape(4, 1, 128, 16), TINY_DECODES, torch.float16, "cpu",
                    padding=3, config=tiny_config(16, 64, 16, True), max_seq_len=4096,
                    sliding_window=20)


# per request of WINDOW_REQUESTS: spans of positions that see to their last (images
# attending both ways) inside the chunk, begun before it, or ending at the context's end
KEY_LIMIT_SPANS = [[], [(5, 20)], [(60, 66)], [], [(50, 63)], [], [(93, 94)], [],
                   [(135, 160)]]


@interpreter_check
def attention_key_limits() -> None:
    """Key limits: prefill tiles and decode-class tiles (the 6- and 3-query chunks), with
    split-K, with windows shorter and longer than a span, the cap, fp16 and fp32."""
    for shape, dtype, config, window, cap in [
            (AttentionShape(4, 2, 64, 16), torch.float32, tiny_config(16, 32, 16, True),
             None, None),
            (AttentionShape(2, 2, 64, 16), torch.float16, tiny_config(32, 64, 32, False),
             24, None),
            (AttentionShape(4, 1, 64, 16), torch.float32, tiny_config(16, 16, 16, False),
             8, 5.0),
            (AttentionShape(6, 2, 64, 32), torch.float16, tiny_config(16, 64, 16, True),
             70, None)]:
        check_attention(shape, WINDOW_REQUESTS, dtype, "cpu", padding=2, config=config,
                        sliding_window=window, soft_cap=cap, spans=KEY_LIMIT_SPANS)


@interpreter_check
def attention_soft_cap() -> None:
    """The soft cap alone (split-K on and off), with scores far past it (tanh saturating
    both ways), with a window; and fp8 caches with a window, e4m3 with the cap too."""
    check_attention(AttentionShape(4, 2, 64, 16), TINY_REQUESTS, torch.float32, "cpu",
                    padding=2, config=tiny_config(16, 32, 16, True), soft_cap=1.5)
    check_attention(AttentionShape(2, 2, 64, 16), TINY_REQUESTS, torch.float16, "cpu",
                    config=tiny_config(16, 32, 32, False), soft_cap=2.0, q_scale=200.0)
    check_attention(AttentionShape(6, 2, 128, 16), WINDOW_REQUESTS, torch.float16, "cpu",
                    padding=2, config=tiny_config(16, 64, 32, False), sliding_window=24,
                    soft_cap=1.5)
    for cache_dtype, soft_cap, split in zip(FP8, (1.5, None), (True, False)):
        check_attention(AttentionShape(4, 2, 64, 16), WINDOW_REQUESTS, torch.float16, "cpu",
                        padding=2, config=tiny_config(16, 32, 16, split),
                        cache_dtype=cache_dtype, sliding_window=40, soft_cap=soft_cap)


@interpreter_check
def attention_head_dim_96() -> None:
    """Phi-3's 96-wide heads, no power of two: the kernel's 128-wide tiles mask the extra
    columns (a read past them would take the next head's values). With a window, split-K
    on and off, and the cache write that fills it."""
    check_write_kv(13, 2, 96, 4, torch.float32, "cpu")
    check_attention(AttentionShape(4, 2, 96, 16), TINY_REQUESTS, torch.float32, "cpu",
                    padding=2, config=tiny_config(16, 32, 16, True))
    check_attention(AttentionShape(4, 4, 96, 16), WINDOW_REQUESTS, torch.float16, "cpu",
                    padding=2, config=tiny_config(16, 32, 32, False), sliding_window=24)


@interpreter_check
def fp8_cache_kernels() -> None:
    """The attention (mixed batch with padding, split-K on and off) over e4m3 and e5m2
    caches, fp32 and fp16 queries."""
    for cache_dtype in FP8:
        check_attention(AttentionShape(4, 2, 64, 16), TINY_REQUESTS, torch.float32, "cpu",
                        padding=2, config=tiny_config(16, 32, 16, True), cache_dtype=cache_dtype)
        check_attention(AttentionShape(6, 2, 128, 16), TINY_REQUESTS, torch.float16, "cpu",
                        padding=2, config=tiny_config(16, 64, 32, False),
                        cache_dtype=cache_dtype)


@interpreter_check
def small_kernels() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        check_write_kv(13, 2, 64, 4, dtype, "cpu")
        check_rms_norm((5, 96), dtype, "cpu", with_residual=False)
        check_rms_norm((5, 96), dtype, "cpu", with_residual=True)
        check_rms_norm((5, 96), dtype, "cpu", with_residual=True, parts=8)
        check_rms_norm((5, 96), dtype, "cpu", with_residual=True, parts=2, split_parts=True)
        check_rms_norm((4, 3, 64), dtype, "cpu", with_residual=False)
        check_rotary(6, 3, 1, 64, dtype, "cpu")
        # partial rotary: 48 of 64 dims (a half that is no power of two), 40 of 80
        check_rotary(6, 3, 1, 64, dtype, "cpu", partial_rotary_factor=0.75)
        check_rotary(5, 2, 2, 80, dtype, "cpu", partial_rotary_factor=0.5)
        check_silu_and_mul(3, 1500, dtype, "cpu")


@interpreter_check
def fused_attention_inputs() -> None:
    """The q/k norm + rotary + cache write: Qwen3's heads (32 q / 4 KV of 128, its norm),
    Llama's (no norm), Phi-3's 96-wide heads, Phi-4-mini's partial rotary, Gemma 3's
    (1 + w) norm on 256-wide heads; head counts off the per-program group of 4. fp16 for
    the low-precision path: the interpreter casts float32 to bf16 by truncation (triton
    3.9), which four roundings in a row carry past the tolerance; bf16 runs on CUDA."""
    for dtype in (torch.float32, torch.float16):
        check_norm_rope_write_kv(3, 32, 4, 128, dtype, "cpu", norm="llama")
        check_norm_rope_write_kv(5, 8, 2, 64, dtype, "cpu")
        check_norm_rope_write_kv(4, 6, 6, 96, dtype, "cpu")
        check_norm_rope_write_kv(4, 5, 3, 64, dtype, "cpu", norm="llama",
                                 partial_rotary_factor=0.75)
        check_norm_rope_write_kv(3, 4, 1, 256, dtype, "cpu", norm="gemma")


@interpreter_check
def gemma_kernels() -> None:
    """Gemma's norm (with and without the residual, per-head), its norm-add-norm (a width
    off the power of two) and its GeGLU."""
    for dtype in (torch.float32, torch.bfloat16):
        check_gemma_norm_add_norm(5, 96, dtype, "cpu")
        check_rms_norm((5, 96), dtype, "cpu", with_residual=False, gemma=True)
        check_rms_norm((5, 96), dtype, "cpu", with_residual=True, gemma=True)
        check_rms_norm((4, 3, 64), dtype, "cpu", with_residual=False, gemma=True)
        check_gelu_tanh_and_mul(3, 1500, dtype, "cpu")


@interpreter_check
def lora_kernels() -> None:
    """Feature counts off the block sizes; one, two and three slices; rank 8 and 16; fp32,
    fp16 and bf16."""
    check_lora(9, 96, (), 300, 3, 8, torch.float32, "cpu")
    check_lora(7, 600, (20,), 40, 2, 16, torch.float16, "cpu")
    check_lora(6, 64, (100, 150), 200, 4, 16, torch.bfloat16, "cpu")


@interpreter_check
def sampling_kernel() -> None:
    """The argmax with ties across and within chunks; a vocabulary over two chunks and a
    partial last one; bf16 and fp32 logits; the logprobs of the chosen token and the k
    likeliest, over three chunks and one, and over ten and nineteen small ones, of which
    the k of the largest maxima hold the top k."""
    check_argmax(6, 3 * ARGMAX_CHUNK + 37, torch.float32, "cpu")
    check_argmax(5, 3 * ARGMAX_CHUNK, torch.bfloat16, "cpu")
    check_gumbel_argmax(5, 2 * ARGMAX_CHUNK + 37, torch.float32, "cpu")
    check_gumbel_argmax(3, 300, torch.bfloat16, "cpu")
    check_top_logprobs(5, 2 * LOGPROBS_CHUNK + 37, 1, torch.float32, "cpu")
    check_top_logprobs(4, 2 * LOGPROBS_CHUNK + 37, 5, torch.float32, "cpu")
    check_top_logprobs(3, 300, 20, torch.bfloat16, "cpu")
    check_top_logprobs(2, 12, 12, torch.float32, "cpu")
    check_top_logprobs(4, 300, 3, torch.bfloat16, "cpu", tile=(32, 4))
    check_top_logprobs(3, 300, 5, torch.float32, "cpu", tile=(16, 4))
    check_gumbel_distribution("cpu")
    check_sampler_fused_logprobs(2 * ARGMAX_CHUNK + 37, "cpu")


@interpreter_check
def top_p_kernel() -> None:
    """A vocabulary over two iterations and a partial last one, and one short of a block."""
    check_top_p_threshold(6, 2 * BLOCK_TOP_P + 37, "cpu")
    check_top_p_threshold(3, 300, "cpu")
    check_top_p_exact_masses(5, 3 * RADIX_BLOCK + 11, "cpu")
    check_top_p_exact_masses(2, 300, "cpu")


@interpreter_check
def quant_kernels() -> None:
    """Per-token and per-1x64-group quantization (a partial last group), int8 and fp8
    (scales only); GEMMs per token x per channel, 128x128 blocks, per-row scales with
    128-wide K groups, M, N and K off the tiles, with and without a bias."""
    for group in (None, 64):
        check_quantize(5, 200, group, torch.float32, torch.int8, "cpu")
        check_quantize(3, 200, group, torch.float16, torch.float8_e4m3fn, "cpu", values=False)
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        check_scaled_mm(7, 130, 200, 1, 200, qdtype, torch.float32, "cpu")
        check_scaled_mm(20, 256, 384, 128, 128, qdtype, torch.float32, "cpu", bias=False)
        check_scaled_mm(3, 96, 256, 1, 128, qdtype, torch.float16, "cpu")
    # the decode tiles' K steps of 256 past K's end, N off the 32-wide stripes
    check_scaled_mm(40, 72, 320, 1, 320, torch.float8_e4m3fn, torch.float32, "cpu",
                    tiles=ScaledMmTiles(64, 32, 256, 4, 3))


@interpreter_check
def fp8_gemv_kernels() -> None:
    """The fp8 GEMV at 1, 3 and 16 rows, N and K off the tiles, every scale kind; the
    CUDA-core sums (one row) and tensor cores (more rows, and forced at one), K tiles wider
    than a scale block (narrowed to it), K split across programs, with and without a bias.
    fp16 throughout and bf16 at one row: the interpreter multiplies bf16 matrices as raw
    bits (module docstring)."""
    for scales in ("tensor", "channel", "blocks", "rows"):
        for rows in (1, 3, 16):
            check_fp8_gemv(rows, 70, 300, scales, torch.float16, "cpu")
        check_fp8_gemv(1, 33, 260, scales, torch.bfloat16, "cpu", bias=False)
    check_fp8_gemv(1, 70, 1000, "channel", torch.float16, "cpu", GemvTiles(16, 64, dot=True))
    check_fp8_gemv(1, 70, 1000, "blocks", torch.float16, "cpu", GemvTiles(16, 256))
    check_fp8_gemv(3, 40, 1000, "blocks", torch.float16, "cpu",
                   GemvTiles(16, 64, dot=True, split_k=3))
    check_fp8_gemv(1, 40, 1000, "tensor", torch.bfloat16, "cpu", GemvTiles(16, 128, split_k=4))



@interpreter_check
def gemv_kernels() -> None:
    """The 16-bit GEMV at 1, 2, 8 and 16 rows, odd N and K, with and without a bias: the
    default tiles (CUDA-core sums at one row, tensor cores at more), tensor cores forced at
    one row, K split across programs, the 4-wide stripes of 1 KiB tiles the 0.6B's o_proj
    and down_proj take (TUNED_TILES) over a K with a ragged last tile. fp16 on tensor
    cores, bf16 on the CUDA cores: the interpreter multiplies bf16 matrices as raw bits
    (module docstring)."""
    for rows in (1, 2, 8, 16):
        check_gemv(rows, 70, 300, torch.float16, "cpu")
    check_gemv(1, 33, 1000, torch.bfloat16, "cpu", bias=False)
    check_gemv(1, 70, 1100, torch.bfloat16, "cpu", TUNED_TILES[(1, 1024, 2048, 132)])
    check_gemv(1, 70, 515, torch.bfloat16, "cpu", GemvTiles(8, 64, split_k=3))
    check_gemv(1, 40, 300, torch.float16, "cpu", GemvTiles(16, 64, dot=True))
    check_gemv(8, 70, 1000, torch.float16, "cpu", GemvTiles(32, 64, dot=True, split_k=4),
               bias=False)
    check_gemv(16, 17, 129, torch.float16, "cpu", GemvTiles(16, 32, dot=True, split_k=2))

@pytest.mark.parametrize("check", sorted(CHECKS))
def test_under_triton_interpreter(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.test_kernels_triton", check],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# --- CUDA: real model shapes ---------------------------------------------------------------

# (heads, KV heads, head_dim, hidden size, MLP intermediate size)
MODELS = {"qwen3-0.6b": (16, 8, 128, 1024, 3072), "llama-3.1-8b": (32, 8, 128, 4096, 14336),
          "smollm2": (9, 3, 64, 576, 1536), "phi-3-mini": (32, 32, 96, 3072, 8192)}
MIXED_REQUESTS = [(700, 1), (2048, 2048), (1500, 512), (3001, 1), (129, 1), (4100, 256),
                  (17, 17), (1000, 1)]


def decode_requests(n: int, g: random.Random) -> list[tuple[int, int]]:
    return [(g.randrange(1, 2000), 1) for _ in range(n)]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_attention_cuda(model: str, block_size: int, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = MODELS[model][:3]
    shape = AttentionShape(heads, kv_heads, head_dim, block_size)
    check_attention(shape, MIXED_REQUESTS, dtype, "cuda", padding=2)
    # decodes: a full batch (at heads of 128, wide_decode's tile), a small one (split-K), a
    # padded one sized for max_model_len
    decodes = random.Random()
    check_attention(shape, decode_requests(256, decodes), dtype, "cuda")
    check_attention(shape, decode_requests(3, decodes), dtype, "cuda")
    check_attention(shape, decode_requests(30, decodes), dtype, "cuda", padding=2,
                    max_seq_len=131072)


@needs_cuda
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_fp8_cache_kernels_cuda(model: str, cache_dtype: torch.dtype) -> None:
    """The fp8 write (bytes equal to torch's, saturation included) and the attention over
    an fp8 cache at real shapes: a mixed batch, and decodes with split-K."""
    heads, kv_heads, head_dim = MODELS[model][:3]
    check_write_kv(300, kv_heads, head_dim, 16, torch.bfloat16, "cuda", cache_dtype)
    shape = AttentionShape(heads, kv_heads, head_dim, 16)
    check_attention(shape, MIXED_REQUESTS, torch.bfloat16, "cuda", padding=2,
                    cache_dtype=cache_dtype)
    check_attention(shape, decode_requests(3, random.Random()), torch.bfloat16, "cuda",
                    cache_dtype=cache_dtype)


@needs_cuda
@pytest.mark.parametrize("window", [None, 1024])
def test_attention_key_limits_cuda(window: int | None) -> None:
    """Gemma 3 4B's heads (8, 4 KV, 256 wide), bf16: 256-token images attending both ways
    in whole prompts and chunks behind a prefix (one ending at the context's end), beside
    decodes, with and without its 1024-key window."""
    requests = [(300, 300), (1500, 600), (700, 1), (2000, 258), (40, 1)]
    spans = [[(20, 275)], [(1000, 1255)], [], [(1744, 1999)], []]
    check_attention(AttentionShape(8, 4, 256, 16), requests, torch.bfloat16, "cuda",
                    padding=2, sliding_window=window, spans=spans)


# (heads, KV heads, head_dim): Gemma-2-9B's 256-wide heads (window 4096, soft cap 50)
WINDOW_MODELS = {"llama-3.1-8b": (32, 8, 128), "gemma-2-9b": (16, 8, 256)}
# contexts of a few thousand keys around both windows: decodes, a whole prompt, chunks
# behind long prefixes
WINDOW_MIXED_REQUESTS = [(5000, 1), (8000, 1024), (6000, 300), (3001, 1), (129, 1),
                         (4700, 256), (17, 17), (7000, 1)]


@needs_cuda
@pytest.mark.parametrize("window", [4096, 1024])
@pytest.mark.parametrize("model", sorted(WINDOW_MODELS))
def test_attention_window_cuda(model: str, window: int) -> None:
    """Sliding windows at real shapes, blocks outside them poisoned (check_attention): a
    mixed batch in bf16 and fp32, decodes with split-K, a padded decode batch sized for
    131072 with every context past the window, the soft cap with the window, and an fp8
    cache with both."""
    shape = AttentionShape(*WINDOW_MODELS[model], 16)
    for dtype in (torch.bfloat16, torch.float32):
        check_attention(shape, WINDOW_MIXED_REQUESTS, dtype, "cuda", padding=2,
                        sliding_window=window)
    check_attention(shape, [(9000, 1), (5000, 1), (1500, 1)], torch.bfloat16, "cuda",
                    sliding_window=window)
    lengths = random.Random()
    check_attention(shape, [(lengths.randrange(window + 1, 3 * window), 1) for _ in range(30)],
                    torch.bfloat16, "cuda", padding=2, max_seq_len=131072,
                    sliding_window=window)
    check_attention(shape, WINDOW_MIXED_REQUESTS, torch.bfloat16, "cuda", padding=2,
                    sliding_window=window, soft_cap=2.0)
    check_attention(shape, WINDOW_MIXED_REQUESTS, torch.bfloat16, "cuda", padding=2,
                    cache_dtype=torch.float8_e4m3fn, sliding_window=window, soft_cap=2.0)


@needs_cuda
@pytest.mark.parametrize("model", sorted(WINDOW_MODELS))
def test_attention_soft_cap_cuda(model: str) -> None:
    """The soft cap without a window: a mixed batch (bf16, and fp32 with scores far past
    the cap), small decode batches with split-K."""
    shape = AttentionShape(*WINDOW_MODELS[model], 16)
    check_attention(shape, MIXED_REQUESTS, torch.bfloat16, "cuda", padding=2, soft_cap=2.0)
    check_attention(shape, MIXED_REQUESTS, torch.float32, "cuda", padding=2, soft_cap=2.0,
                    q_scale=200.0)
    check_attention(shape, [(9000, 1), (700, 1)], torch.bfloat16, "cuda", soft_cap=2.0)


@needs_cuda
def test_attention_dispatch_takes_triton_on_cuda() -> None:
    """The public op on CUDA tensors matches the reference (and is the Triton path: the
    torch path would need a device sync this test would not notice, so compare both)."""
    g, seed = fresh_generator()
    inputs = attention_inputs(AttentionShape(16, 8, 128, 16), MIXED_REQUESTS, 0,
                              torch.bfloat16, "cuda", g)
    out = paged_attention(**inputs, scale=0.088, max_query_len=2048, max_seq_len=4100)
    triton_out = paged_attention_triton(**inputs, scale=0.088, max_query_len=2048,
                                        max_seq_len=4100)
    assert torch.equal(out, triton_out)
    assert_close(out, paged_attention_ref(**inputs, scale=0.088), "dispatch", seed)


def compiled_variants(kernel) -> int:
    """The specializations of a Triton kernel this process has compiled for the current
    device (the JIT's kernel cache: the first of its per-device entries)."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def offset_copy(tensor: torch.Tensor, words: int) -> torch.Tensor:
    """`tensor`'s values `words` elements into a buffer of their dtype: a view that lies as
    a step's metadata lie in the one buffer its inputs came in (to_device_together)."""
    view = torch.empty(words + tensor.numel(), dtype=tensor.dtype,
                       device=tensor.device)[words:].view(tensor.shape)
    return view.copy_(tensor)


@needs_cuda
def test_an_eager_steps_metadata_compile_no_other_attention_kernel() -> None:
    """An eager step's block table is as wide as its longest request, and its table,
    starts and lengths are views at any 4-byte offset (services/worker/inputs.py). Were the
    kernel specialized on either, each new width class or alignment would compile another
    kernel in the middle of serving; the answer stays the reference's."""
    g, seed = fresh_generator()
    inputs = attention_inputs(AttentionShape(16, 8, 128, 16), TINY_REQUESTS, 0,
                              torch.bfloat16, "cuda", g)
    options = dict(scale=0.088, max_query_len=max(q for _, q in TINY_REQUESTS),
                   max_seq_len=max(ctx for ctx, _ in TINY_REQUESTS))  # the same splits
    ref = paged_attention_ref(**inputs, scale=0.088)
    assert_close(paged_attention_triton(**inputs, **options), ref, "aligned", seed)
    compiled = compiled_variants(_paged_attention_kernel)
    used = max(math.ceil(ctx / 16) for ctx, _ in TINY_REQUESTS)
    tables = inputs["block_tables"]
    for words, width in [(1, used), (2, used + 1), (3, 16), (1, 17)]:
        wide = torch.zeros(tables.shape[0], width, dtype=tables.dtype, device="cuda")
        wide[:, :used] = tables[:, :used]
        moved = {name: offset_copy(inputs[name], words)
                 for name in ("query_start_loc", "seq_lens")}
        moved["block_tables"] = offset_copy(wide, words)
        out = paged_attention_triton(**inputs | moved, **options)
        assert_close(out, ref, f"{words} words in, {width} blocks wide", seed)
    assert compiled_variants(_paged_attention_kernel) == compiled


@needs_cuda
def test_an_eager_steps_positions_and_slots_compile_no_other_cache_write() -> None:
    """The fused q/k norm, rotary and cache write, with its positions and slots 8 bytes
    into their buffer (a step's int64 views, services/worker/inputs.py): the kernel
    compiled for aligned ones runs, and writes what it wrote from them."""
    g, _ = fresh_generator()
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 16, 8, 128
    cos_sin = rope_cos_sin_cache(head_dim, 4096, 10000.0, None).cuda()
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).cuda()
    qkv = rand(g, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
               dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(64, generator=g)[:num_tokens].cuda()
    outputs = []
    for words in (0, 1):
        caches = [torch.zeros(4, 16, num_kv_heads, head_dim, dtype=torch.bfloat16,
                              device="cuda") for _ in range(2)]
        q = norm_rope_write_kv_triton(qkv, offset_copy(positions, words), cos_sin, num_heads,
                                      *caches, offset_copy(slots, words))
        outputs.append([q, *caches])
        if words == 0:
            compiled = compiled_variants(_norm_rope_write_kv_kernel)
    assert compiled_variants(_norm_rope_write_kv_kernel) == compiled
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def fill_decode_batch(static: dict[str, torch.Tensor], num_real: int, block_size: int,
                      g: torch.Generator) -> None:
    """New contexts for the first num_real rows of a static decode batch, on distinct
    blocks; the rest padding: seq_len 0, slot -1, query_start_loc repeating."""
    batch, max_blocks = static["block_tables"].shape
    num_blocks = static["k_cache"].shape[0]
    tables = torch.randperm(num_blocks, generator=g)[:batch * max_blocks].view(batch, max_blocks)
    seq_lens = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=g)
    seq_lens[num_real:] = 0
    last = (seq_lens - 1).clamp(min=0)
    slots = tables.gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    slots[num_real:] = -1
    q_lens = (torch.arange(batch) < num_real).int()
    static["block_tables"].copy_(tables)
    static["seq_lens"].copy_(seq_lens)
    static["slot_mapping"].copy_(slots)
    static["query_start_loc"].copy_(torch.cat([torch.zeros(1, dtype=torch.int32),
                                               q_lens.cumsum(0)]))
    for name in ("q", "k", "v"):
        static[name].copy_(torch.randn(static[name].shape, generator=g))


@needs_cuda
def test_padded_decode_step_replays_in_cuda_graph() -> None:
    """The cache write and attention captured once for a batch of 8 sized for a long
    max_seq_len, replayed with fewer real requests and new lengths: capture fails on any
    host sync, and padded rows must neither write nor poison anything."""
    heads, kv_heads, head_dim, block_size, batch, max_blocks = 32, 8, 128, 16, 8, 64
    g, seed = fresh_generator()

    def cuda(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)

    static = dict(q=cuda(batch, heads, head_dim), k=cuda(batch, kv_heads, head_dim),
                  v=cuda(batch, kv_heads, head_dim),
                  k_cache=cuda(batch * max_blocks + 5, block_size, kv_heads, head_dim),
                  v_cache=cuda(batch * max_blocks + 5, block_size, kv_heads, head_dim),
                  block_tables=cuda(batch, max_blocks, dtype=torch.int32),
                  seq_lens=cuda(batch, dtype=torch.int32),
                  slot_mapping=cuda(batch, dtype=torch.int64),
                  query_start_loc=cuda(batch + 1, dtype=torch.int32))
    attention_args = [static[name] for name in ("q", "k_cache", "v_cache", "block_tables",
                                                 "query_start_loc", "seq_lens")]

    def step() -> torch.Tensor:
        write_kv(static["k"], static["v"], static["k_cache"], static["v_cache"],
                 static["slot_mapping"])
        return paged_attention(*attention_args, 0.088, max_query_len=1,
                               max_seq_len=max_blocks * block_size)

    fill_decode_batch(static, batch, block_size, g)
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for num_real in (batch, 5, 1):
        fill_decode_batch(static, num_real, block_size, g)
        expected_k, expected_v = static["k_cache"].clone(), static["v_cache"].clone()
        write_kv_ref(static["k"], static["v"], expected_k, expected_v, static["slot_mapping"])
        graph.replay()
        assert torch.equal(static["k_cache"], expected_k), f"K cache (seed {seed})"
        assert torch.equal(static["v_cache"], expected_v), f"V cache (seed {seed})"
        ref = paged_attention_ref(static["q"], expected_k, expected_v, *attention_args[3:],
                                  0.088)
        assert_close(out[:num_real], ref[:num_real], f"graph replay, {num_real} real", seed)
        assert out.isfinite().all(), f"padded rows not finite (seed {seed})"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_small_kernels_cuda(model: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, hidden, intermediate = MODELS[model]
    for num_tokens in (1, 256, 4096):
        check_write_kv(num_tokens, kv_heads, head_dim, 16, dtype, "cuda")
        check_rms_norm((num_tokens, hidden), dtype, "cuda", with_residual=True)
        check_rms_norm((num_tokens, hidden), dtype, "cuda", with_residual=True, parts=8)
        check_rms_norm((num_tokens, hidden), dtype, "cuda", with_residual=True, parts=2,
                       split_parts=True)
        check_rms_norm((num_tokens, hidden), dtype, "cuda", with_residual=False)
        check_rms_norm((num_tokens, heads, head_dim), dtype, "cuda", with_residual=False)
        check_rotary(num_tokens, heads, kv_heads, head_dim, dtype, "cuda")
        check_rotary(num_tokens, heads, kv_heads, head_dim, dtype, "cuda",
                     partial_rotary_factor=0.75)  # Phi-4-mini's
        check_silu_and_mul(num_tokens, intermediate, dtype, "cuda")
        for norm in (None, "llama"):
            check_norm_rope_write_kv(num_tokens, heads, kv_heads, head_dim, dtype, "cuda",
                                     norm=norm)
        check_norm_rope_write_kv(num_tokens, heads, kv_heads, head_dim, dtype, "cuda",
                                 norm="llama", partial_rotary_factor=0.75)


# (heads, KV heads, head_dim) of the fused q/k norm + rotary + cache write's extra shapes
FUSED_INPUT_MODELS = {"qwen3-30b-a3b": (32, 4, 128), "gemma-3-12b": (16, 8, 256)}


@needs_cuda
@pytest.mark.parametrize("cache_dtype", [None, *FP8])
@pytest.mark.parametrize("model", sorted(FUSED_INPUT_MODELS))
def test_fused_attention_inputs_cuda(model: str, cache_dtype: torch.dtype | None) -> None:
    """Qwen3-30B-A3B's heads with its norm and Gemma 3's with the (1 + w) one, bf16, into
    bf16 and fp8 caches, at a decode, a decode batch and a prefill."""
    heads, kv_heads, head_dim = FUSED_INPUT_MODELS[model]
    norm = "gemma" if model.startswith("gemma") else "llama"
    for num_tokens in (1, 64, 4096):
        check_norm_rope_write_kv(num_tokens, heads, kv_heads, head_dim, torch.bfloat16,
                                 "cuda", norm=norm, cache_dtype=cache_dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_kernels_cuda(dtype: torch.dtype) -> None:
    """Gemma 2 9B's shapes: hidden 3584, 16 heads of 256, MLP 14336."""
    for num_tokens in (1, 256, 4096):
        check_rms_norm((num_tokens, 3584), dtype, "cuda", with_residual=True, gemma=True)
        check_rms_norm((num_tokens, 3584), dtype, "cuda", with_residual=False, gemma=True)
        check_rms_norm((num_tokens, 16, 256), dtype, "cuda", with_residual=False, gemma=True)
        check_gemma_norm_add_norm(num_tokens, 3584, dtype, "cuda")
        check_gelu_tanh_and_mul(num_tokens, 14336, dtype, "cuda")


# --- compiled for the H100 without one: Triton's front end, LLVM and ptxas ---------------

SM90_PTXAS = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"


def compile_for_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
                     num_stages: int = 3) -> None:
    """Compiles fn to an sm_90 cubin on this machine: what the interpreter never checks
    (types the compiler refuses, shapes it cannot lay out, register or shared memory
    limits)."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    assert kernel.asm["cubin"]


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_fused_kernels_compile_for_sm90() -> None:
    """The fused attention inputs at Qwen3's heads into bf16 and e4m3 caches, Phi-3's
    96-wide heads, partial rotary and Gemma 3's 256-wide (1 + w) heads; Gemma's
    norm-add-norm at Gemma-2-9B's width; the RMSNorm with PDL over a residual, and over
    float32 parts."""
    names = ["positions_ptr", "qkv_ptr", "cos_sin_ptr", "q_w_ptr", "k_w_ptr", "q_out_ptr",
             "k_cache_ptr", "v_cache_ptr", "slot_mapping_ptr", "k_scale_ptr", "v_scale_ptr",
             "stride_t", "num_heads", "num_kv_heads", "eps", "q_groups"]
    for cache, head_dim, half, pass_block, gemma in [
            ("bf16", 128, 64, 1, False), ("fp8e4nv", 128, 64, 1, False),
            ("bf16", 96, 48, 1, False), ("bf16", 128, 48, 32, False),
            ("bf16", 256, 128, 1, True)]:
        types = ["*i64", "*bf16", "*fp32", "*bf16", "*bf16", "*bf16", f"*{cache}", f"*{cache}",
                 "*i64", "*fp32", "*fp32", "i32", "i32", "i32", "fp32", "i32"]
        fp8 = cache.startswith("fp8")
        compile_for_sm90(_norm_rope_write_kv_kernel, dict(zip(names, types)), dict(
            BLOCK_H=4, HEAD_DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
            HALF=half, HALF_BLOCK=triton.next_power_of_2(half), PASS_BLOCK=pass_block,
            HAS_NORM=True, GEMMA=gemma, FP8=fp8, FP8_MAX=448.0 if fp8 else 0.0, PDL=True))
    norm_types = dict(x_ptr="*bf16", res_ptr="*bf16", w1_ptr="*bf16", w2_ptr="*bf16",
                      out_ptr="*bf16", new_res_ptr="*bf16", hidden="i32", eps="fp32",
                      stride_x="i32", stride_r="i32")
    compile_for_sm90(_gemma_norm_add_norm_kernel, norm_types, dict(BLOCK=4096))
    rms_types = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                     new_res_ptr="*bf16", hidden="i32", inner="i32", eps="fp32",
                     stride_x0="i32", stride_x1="i32", stride_r0="i32", stride_r1="i32")
    for parts in (1, 2):  # the norm after int4's split o and down takes float32 parts
        compile_for_sm90(_rms_norm_kernel, dict(rms_types, x_ptr="*fp32" if parts > 1
                                                else "*bf16"),
                         dict(HAS_RESIDUAL=True, GEMMA=False, PARTS=parts, BLOCK=4096,
                              PDL=True), num_warps=8)


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_top_logprobs_kernels_compile_for_sm90() -> None:
    """The three passes, with a chosen token and without (greedy's), for k of 1, 5 and the
    most the sampler asks of them: the branches give a count and a rank of different
    origins the same type, and 32 candidates of 32 chunks fit one program."""
    for dtype in ("fp32", "bf16"):
        for chosen in (True, False):
            compile_for_sm90(_chunk_sums_kernel, dict(
                logits_ptr=f"*{dtype}", stride_row="i32", chosen_ptr="*i64",
                maxima_ptr="*fp32", beaten_ptr="*i32", vocab="i32"),
                dict(CHOSEN=chosen, BLOCK=LOGPROBS_CHUNK))
            for k in (1, 5, MAX_KERNEL_LOGPROBS):
                compile_for_sm90(_chunk_tops_kernel, dict(
                    logits_ptr=f"*{dtype}", stride_row="i32", maxima_ptr="*fp32",
                    tops_ptr="*fp32", columns_ptr="*i32", vocab="i32", chunks="i32"),
                    dict(K=k, BLOCK=LOGPROBS_CHUNK, CHUNKS=64,
                         K_SLOTS=triton.next_power_of_2(k)))
                compile_for_sm90(_top_combine_kernel, dict(
                    logits_ptr=f"*{dtype}", stride_row="i32", chosen_ptr="*i64",
                    maxima_ptr="*fp32", beaten_ptr="*i32", tops_ptr="*fp32",
                    columns_ptr="*i32", out_ptr="*i64", vocab="i32", chunks="i32",
                    picked="i32"),
                    dict(CHOSEN=chosen, K=k, CHUNKS=64, PICKED=triton.next_power_of_2(k),
                         K_SLOTS=triton.next_power_of_2(k)))


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_argmax_kernels_compile_for_sm90() -> None:
    """Greedy and Gumbel chunks over bf16 and fp32 logits, with PDL, and the combine over
    Llama-3's 32 chunks."""
    for dtype in ("fp32", "bf16"):
        for gumbel in (True, False):
            compile_for_sm90(_chunk_argmax_kernel, dict(
                logits_ptr=f"*{dtype}", stride_row="i32", temperature_ptr="*fp32",
                maxima_ptr="*fp32", columns_ptr="*i32", seed="i32", vocab="i32"),
                dict(GUMBEL=gumbel, BLOCK=ARGMAX_CHUNK, PDL=True))
    compile_for_sm90(_argmax_combine_kernel, dict(
        maxima_ptr="*fp32", columns_ptr="*i32", out_ptr="*i64", chunks="i32"),
        dict(CHUNKS=32, PDL=True), num_warps=1)


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_top_p_kernel_compiles_for_sm90() -> None:
    """The interpreter let the kernel read a plain global, which a GPU compile refuses:
    every top-p request on CUDA failed."""
    types = dict(probs_ptr="*fp32", stride_row="i32", top_p_ptr="*fp32", out_ptr="*fp32",
                 vocab="i32")
    compile_for_sm90(_top_p_threshold_kernel, types,
                     dict(ONE=ONE_BITS, STEPS=TOP_P_STEPS, BLOCK=BLOCK_TOP_P))


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_top_p_radix_kernels_compile_for_sm90() -> None:
    """Every round of the radix select (the first reads no earlier bins) and its pick, at
    the bits top_p_threshold_radix uses: int64 atomics, the bins' reverse cumsum."""
    types = dict(probs_ptr="*fp32", stride_row="i32", top_p_ptr="*fp32", prev_bins_ptr="*i64",
                 bins_ptr="*i64", state_ptr="*i64", vocab="i32", chunk="i32")
    shift = 30
    for r, bits in enumerate(RADIX_BITS):
        shift -= bits
        compile_for_sm90(_top_p_bins_kernel, types, dict(
            ROUND=r, SHIFT=shift, BITS=bits, PREV_SHIFT=shift + bits,
            PREV_BITS=RADIX_BITS[max(r - 1, 0)], COPIES=RADIX_COPIES, SCALE=FIXED_POINT,
            BLOCK=RADIX_BLOCK))
    compile_for_sm90(_top_p_pick_kernel, dict(top_p_ptr="*fp32", bins_ptr="*i64",
                                              state_ptr="*i64", out_ptr="*fp32"),
                     dict(ROUND=len(RADIX_BITS), BITS=RADIX_BITS[-1], COPIES=RADIX_COPIES,
                          SCALE=FIXED_POINT))


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_gemv_compiles_for_sm90() -> None:
    """The GEMV's default tiles (default_tiles), launched with PDL (kernels/pdl.py). fp8 weights: one row per channel and per
    128x128 block (CUDA-core sums), more rows per channel and per block (tensor cores on
    bf16). bf16 and fp16 weights, no scale: one row on the CUDA cores and on tensor cores
    (the widest projections), more rows on tensor cores. And the K split's sum."""
    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", scale_ptr="*fp32", bias_ptr="*bf16",
                 out_ptr="*bf16", m="i32", n="i32", k="i32", stride_x="i32", stride_w="i32",
                 scale_stride="i32", scale_block_n="i32", scale_block_k="i32", k_share="i32",
                 res_ptr="*bf16", sumsq_ptr="*fp32", norm_w_ptr="*bf16", parts="i32",
                 eps="fp32")
    plain = dict(NORM_IN=False, ADD_RESIDUAL=False, BLOCK_P=1)
    for per_k, dot, block_m, block_n, block_k in [(False, False, 1, 8, 512),
                                                  (True, False, 1, 32, 128),
                                                  (False, True, 16, 32, 128),
                                                  (False, True, 16, 32, 256),
                                                  (True, True, 16, 32, 128)]:
        compile_for_sm90(_gemv_kernel, types, dict(
            HAS_SCALE=True, PER_K_SCALE=per_k, HAS_BIAS=True, USE_DOT=dot, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, **plain))
    for dtype in ("bf16", "fp16"):
        half = dict(types, x_ptr=f"*{dtype}", w_ptr=f"*{dtype}", scale_ptr=f"*{dtype}",
                    bias_ptr=f"*{dtype}", out_ptr=f"*{dtype}", res_ptr=f"*{dtype}",
                    norm_w_ptr=f"*{dtype}")
        for dot, block_m, block_n, block_k in [(False, 1, 8, 256), (True, 16, 32, 64),
                                               (True, 16, 32, 128)]:
            compile_for_sm90(_gemv_kernel, half, dict(
                HAS_SCALE=False, PER_K_SCALE=False, HAS_BIAS=True, USE_DOT=dot,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, **plain))
    sums = dict(parts_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16", size="i32", n="i32",
                splits="i32", res_ptr="*bf16", sumsq_ptr="*fp32")
    for seam in (False, True):
        compile_for_sm90(_sum_splits_kernel, sums,
                         dict(HAS_BIAS=True, ADD_RESIDUAL=seam, BLOCK=1024, PDL=True))


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_paged_attention_compiles_for_sm90() -> None:
    """The attention at Qwen3's heads as default_config launches it: decode tiles over bf16
    and e4m3 caches with the context split and without, prefill tiles, a window and a soft
    cap; and the split combine."""
    names = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_out_ptr",
             "part_lse_ptr", "block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr",
             "k_scale_ptr", "v_scale_ptr", "key_limits_ptr", "num_tokens", "num_reqs",
             "num_splits", "q_len_above", "q_len_upto", "qk_scale", "window", "cap",
             "stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bt"]
    for cache, split, decode, window in [("bf16", True, True, False),
                                         ("bf16", False, True, False),
                                         ("bf16", False, "wide", False),
                                         ("fp8e4nv", True, True, False),
                                         ("bf16", False, False, True)]:
        fp8 = cache != "bf16"
        types = ["*bf16", f"*{cache}", f"*{cache}", "*bf16", "*fp32", "*fp32", "*i32",
                 "*i32", "*i32", "*fp32", "*fp32", "*i32"] + ["i32"] * 5 + \
            ["fp32", "i32", "fp32"] + ["i32"] * 6
        config = default_config(torch.empty(1, 16, 128, dtype=torch.bfloat16),
                                torch.float8_e4m3fn if fp8 else None)
        tile = config.prefill if not decode else \
            config.decode_tile(WIDE_FROM if decode == "wide" else 1)
        compile_for_sm90(_paged_attention_kernel, dict(zip(names, types)), dict(
            GROUP=2, HEAD_DIM=128, DIM_BLOCK=128, BLOCK_SIZE=16, BLOCK_Q=tile.queries(2),
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, ONE_TILE_EACH=bool(decode),
            SEARCH_BLOCK=1 if decode else 512, SPLIT=split, EXACT_DOT=False, SCALED=fp8,
            FP16_DOT=fp8, WINDOW=window, SOFT_CAP=window, LIMITS=False,
            PREFETCH_V=tile.prefetch_v, PDL=True),
            tile.num_warps, tile.num_stages)
    compile_for_sm90(_combine_splits_kernel, dict(
        part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", num_tokens="i32",
        num_heads="i32", num_splits="i32"), dict(SPLITS_PAD=16, HEAD_DIM=128,
                                                 DIM_BLOCK=128, PDL=True))


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_int4_kernels_compile_for_sm90() -> None:
    """The W4A16 GEMV in packed half arithmetic (its inline PTX) at the 8B tiles, with and
    without act-order (and zeros), and the tiled GEMM of decode batches."""
    types = dict(x_ptr="*bf16", qweight_ptr="*i32", scales_ptr="*bf16", zeros_ptr="*u8",
                 perm_ptr="*i32", bias_ptr="*bf16", out_ptr="*fp32", m="i32", n="i32",
                 k="i32", k_share="i32")
    for act_order in (False, True):
        compile_for_sm90(_w4a16_gemv_kernel, types, dict(
            group_size=128, HAS_ZEROS=act_order, HAS_PERM=act_order, HAS_BIAS=not act_order,
            BLOCK_N=16, BLOCK_K=1024, GROUPS=8, PACKED=True, PDL=True))
    compile_for_sm90(_w4a16_gemm_kernel, dict(types, out_ptr="*bf16"), dict(
        group_size=128, HAS_ZEROS=False, HAS_PERM=True, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64,
        BLOCK_K=128, PDL=True))


@needs_cuda
def test_sampling_kernel_cuda() -> None:
    for rows in (5, 256):
        check_argmax(rows, 151936, torch.bfloat16, "cuda")
        check_argmax(rows, 128256, torch.float32, "cuda")
    for rows in (1, 256):
        check_gumbel_argmax(rows, 151936, torch.bfloat16, "cuda")
        check_gumbel_argmax(rows, 128256, torch.float32, "cuda")
        check_top_logprobs(rows, 151936, 1, torch.float32, "cuda")
        check_top_logprobs(rows, 128256, 1, torch.bfloat16, "cuda")
        check_top_logprobs(rows, 151936, 5, torch.float32, "cuda")
        check_top_logprobs(rows, 151936, 20, torch.bfloat16, "cuda")
    check_gumbel_distribution("cuda", draws=20000)
    for top in (5, 2, 1, 0):
        check_sampler_fused_logprobs(151936, "cuda", top)


@needs_cuda
def test_top_p_kernels_cuda() -> None:
    for rows in (1, 8, 32, 256):
        check_top_p_threshold(rows, 151936, "cuda")
        check_top_p_exact_masses(rows, 151936, "cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_kernels_cuda(dtype: torch.dtype) -> None:
    """Llama-3.1-8B's projections at rank 16 (qkv, o, gate_up, down): 32 tokens of 4
    adapters and base rows (a decode batch), and a prefill-sized batch."""
    heads, kv_heads, head_dim, hidden, intermediate = MODELS["llama-3.1-8b"]
    q, kv = heads * head_dim, kv_heads * head_dim
    for num_tokens in (32, 2048):
        check_lora(num_tokens, hidden, (q, q + kv), q + 2 * kv, 4, 16, dtype, "cuda")
        check_lora(num_tokens, hidden, (), hidden, 4, 16, dtype, "cuda")
        check_lora(num_tokens, hidden, (intermediate,), 2 * intermediate, 4, 16, dtype, "cuda")
        check_lora(num_tokens, intermediate, (), hidden, 4, 16, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.1-8b"])
def test_quant_kernels_cuda(model: str) -> None:
    """fp8 and int8 quantization (values too), and the GEMMs of a decode and a prefill
    batch at the model's q/k/v shape: per channel through torch._scaled_mm (fp8, bf16)
    and the Triton kernel, 128x128 blocks through the Triton kernel."""
    heads, kv_heads, head_dim, hidden, _ = MODELS[model]
    n = (heads + 2 * kv_heads) * head_dim
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        for group in (None, 128):
            check_quantize(300, hidden, group, torch.bfloat16, qdtype, "cuda")
        for rows in (1, 8, 17, 64, 1000):  # 17 and 64: fp8 through decode_tiles
            check_scaled_mm(rows, n, hidden, 1, hidden, qdtype, torch.bfloat16, "cuda",
                            dispatch=True)
            check_scaled_mm(rows, n, hidden, 128, 128, qdtype, torch.bfloat16, "cuda")


# Llama-3.1-8B's projections: (K, N)
LLAMA_8B_PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                        "down": (14336, 4096)}


@needs_cuda
@pytest.mark.parametrize("projection", sorted(LLAMA_8B_PROJECTIONS))
def test_fp8_gemv_cuda(projection: str) -> None:
    """The fp8 GEMV at Llama-3.1-8B's projections against its twin (relative error 1e-2
    in bf16, the outputs' rounding): 1, 3, 8 and 16 rows, every scale kind, the default
    tiles and a forced K split, the dispatch, and a replay in a CUDA graph."""
    k, n = LLAMA_8B_PROJECTIONS[projection]
    for rows in (1, 3, 8, 16):
        for scales in ("tensor", "channel", "blocks"):
            check_fp8_gemv(rows, n, k, scales, torch.bfloat16, "cuda")
    check_fp8_gemv(1, n, k, "channel", torch.float16, "cuda", bias=False)
    check_fp8_gemv(1, n, k, "channel", torch.bfloat16, "cuda", GemvTiles(32, 256, split_k=4))
    check_fp8_gemv(8, n, k, "blocks", torch.bfloat16, "cuda",
                   GemvTiles(64, 128, dot=True, split_k=2))
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    w_scale = torch.rand(n, 1, device="cuda") / 100
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    expected = fp8_gemv_ref(x, w, w_scale)
    assert torch.equal(fp8_gemv(x, w, w_scale), fp8_gemv_triton(x, w, w_scale))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, w, w_scale)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, expected, "fp8_gemv in a CUDA graph", 0)


@needs_cuda
@pytest.mark.parametrize("x_scale", [1e-5, 1.0, 3e4])
def test_packed_fp8_gemv_cuda_keeps_large_and_small_activations(x_scale: float) -> None:
    """One row takes the packed kernel, whose products are fp16: activations of 3e4 (a
    product with 448 is past fp16's range unscaled) and 1e-5 (below its normal range),
    every scale kind, K off the tiles (1000) and forced tiles."""
    for scales in ("tensor", "channel", "blocks", "rows"):
        check_fp8_gemv(1, 4096, 14336, scales, torch.bfloat16, "cuda", x_scale=x_scale)
        check_fp8_gemv(1, 70, 1000, scales, torch.bfloat16, "cuda", x_scale=x_scale)
    for tiles in (PackedTiles(8, 1024, 8), PackedTiles(32, 256), PackedTiles(16, 2048)):
        check_fp8_gemv(1, 6144, 4096, "channel", torch.bfloat16, "cuda", tiles,
                       x_scale=x_scale)



# decode projections, (K, N) at TP=1: Phi-3-mini-4k, Gemma-2-9B, Llama-3.1-8B and
# Qwen3-30B-A3B's attention (its experts take the fused MoE kernel)
DECODE_PROJECTIONS = {
    "phi-3-mini": {"qkv": (3072, 9216), "o": (3072, 3072), "gate_up": (3072, 16384),
                   "down": (8192, 3072)},
    "gemma-2-9b": {"qkv": (3584, 8192), "o": (4096, 3584), "gate_up": (3584, 28672),
                   "down": (14336, 3584)},
    "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                     "down": (14336, 4096)},
    "qwen3-30b-a3b": {"qkv": (2048, 5120), "o": (4096, 2048)}}


@needs_cuda
@pytest.mark.parametrize("model", sorted(DECODE_PROJECTIONS))
def test_gemv_cuda(model: str) -> None:
    """The 16-bit GEMV at the model's projections against its twin (relative error 1e-2,
    the outputs' rounding): bf16 at 1, 2, 8 and 16 rows with a bias, fp16 at 1 and 16 rows
    without, a forced K split and tensor cores at one row, and a replay in a CUDA graph."""
    for k, n in DECODE_PROJECTIONS[model].values():
        for rows in (1, 2, 8, 16):
            check_gemv(rows, n, k, torch.bfloat16, "cuda")
        for rows in (1, 16):
            check_gemv(rows, n, k, torch.float16, "cuda", bias=False)
        check_gemv(1, n, k, torch.bfloat16, "cuda", GemvTiles(16, 128, split_k=4))
        check_gemv(1, n, k, torch.bfloat16, "cuda", GemvTiles(32, 64, dot=True))
    k, n = DECODE_PROJECTIONS[model]["o"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemv(x, w), gemv_triton(x, w))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, gemv_ref(x, w), "gemv in a CUDA graph", 0)

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()


def test_pdl_is_asked_only_of_cuda_tensors(monkeypatch) -> None:
    """The interpreter and CPU tensors launch plainly; HEADRACE_PDL=0 turns it off (the
    A/B of benchmarks/issue29-h100/pdl)."""
    import kernels.pdl as pdl
    assert pdl.pdl_launch(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_launch(torch.zeros(1)) == {"PDL": False}
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert pdl.pdl_launch(torch.zeros(1, device="cuda")) == {"PDL": False}
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert pdl.pdl_launch(torch.zeros(1, device="cuda")) == {"PDL": True,
                                                                 "launch_pdl": True}
