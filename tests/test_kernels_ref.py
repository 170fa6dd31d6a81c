"""The torch reference kernels against plain formulas written independently of them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import (gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul,
                                silu_and_mul_ref)
from kernels.attention import paged_attention, paged_attention_ref
from kernels.cache import dequantize, quantize, write_kv, write_kv_ref
from kernels.norm import rms_norm, rms_norm_ref
from kernels.rotary import (apply_rotary, apply_rotary_ref, rope_cos_sin_cache,
                            rope_inv_freq)
from services.worker.layers.rotary import rope_settings

# (context length after the step, query length): a decode, whole prompts, prefill chunks
# behind a cached prefix, and a context that exactly fills its blocks
REQUESTS = [(1, 1), (17, 17), (40, 5), (33, 1), (64, 16), (9, 3)]


def dense_attention(q, k, v, scale):
    """q: [q_len, H, D] at the last q_len positions of k, v: [ctx, KVH, D]."""
    q_len, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def paged_case(block_size, num_heads, num_kv_heads, head_dim, seed):
    """Random per-request K/V laid into a cache through shuffled, non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(ctx / block_size) for ctx, _ in REQUESTS]
    num_blocks = 2 * sum(blocks_needed) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.zeros(len(REQUESTS), max(blocks_needed), dtype=torch.int32)
    dense = []
    for r, (ctx, q_len) in enumerate(REQUESTS):
        ids = [pool.pop() for _ in range(blocks_needed[r])]
        block_tables[r, :len(ids)] = torch.tensor(ids)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        for pos in range(ctx):
            k_cache[ids[pos // block_size], pos % block_size] = k[pos]
            v_cache[ids[pos // block_size], pos % block_size] = v[pos]
        q = torch.randn(q_len, num_heads, head_dim, generator=g)
        dense.append((q, k, v))
    q_lens = torch.tensor([q_len for _, q_len in REQUESTS])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int()
    seq_lens = torch.tensor([ctx for ctx, _ in REQUESTS], dtype=torch.int32)
    q = torch.cat([d[0] for d in dense])
    return q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, dense


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 2), (128, 6, 2),
                                                             (64, 2, 2), (128, 4, 1)])
def test_paged_attention_matches_dense_causal(block_size, head_dim, num_heads, num_kv_heads):
    q, k_cache, v_cache, tables, qsl, seq_lens, dense = paged_case(
        block_size, num_heads, num_kv_heads, head_dim, seed=block_size * 1000 + head_dim)
    scale = head_dim ** -0.5
    out = paged_attention_ref(q, k_cache, v_cache, tables, qsl, seq_lens, scale)
    expected = torch.cat([dense_attention(dq, dk, dv, scale) for dq, dk, dv in dense])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, tables, qsl, seq_lens,
                                               scale), out)


def windowed_capped_attention(q, k, v, scale, window, cap):
    """The dense formula with a sliding window and a tanh score cap, written out."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    query_pos = torch.arange(ctx - q_len, ctx)[:, None]
    keys = torch.arange(ctx)[None, :]
    seen = (keys <= query_pos) & ((keys > query_pos - window) if window else True)
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window,cap", [(8, None), (1, None), (None, 5.0), (5, 2.0),
                                        (100, None)])
def test_paged_attention_with_sliding_window_and_soft_cap(window, cap):
    q, k_cache, v_cache, tables, qsl, seq_lens, dense = paged_case(4, 4, 2, 64, seed=11)
    expected = torch.cat([windowed_capped_attention(dq, dk, dv, 0.125, window, cap)
                          for dq, dk, dv in dense])
    for attention in (paged_attention_ref, paged_attention):
        out = attention(q, k_cache, v_cache, tables, qsl, seq_lens, 0.125,
                        sliding_window=window, soft_cap=cap)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if window == 100:  # wider than every context: plain causal attention
        torch.testing.assert_close(expected, torch.cat(
            [dense_attention(dq, dk, dv, 0.125) for dq, dk, dv in dense]), rtol=1e-5, atol=1e-5)


# per request of REQUESTS: (first, last) positions of spans whose queries see up to `last`
# (an image's tokens attending both ways), inside the step's queries or begun before them
KEY_LIMIT_SPANS = [[], [(3, 8)], [(36, 38)], [], [(45, 49), (50, 60)], [(6, 8)]]


def step_key_limits() -> torch.Tensor:
    """Each query's last visible key position: its span's last, or its own."""
    limits = []
    for r, (ctx, q_len) in enumerate(REQUESTS):
        positions = torch.arange(ctx - q_len, ctx)
        for first, last in KEY_LIMIT_SPANS[r]:
            positions = torch.where((positions >= first) & (positions <= last), last,
                                    positions)
        limits.append(positions)
    return torch.cat(limits).int()


@pytest.mark.parametrize("window,cap", [(None, None), (4, None), (3, 2.0)])
def test_paged_attention_with_key_limits(window, cap):
    """Queries inside a span see every key of it (those after them included), the window
    still counted from their own position."""
    q, k_cache, v_cache, tables, qsl, seq_lens, dense = paged_case(4, 4, 2, 64, seed=12)
    expected = []
    for (ctx, q_len), spans, (dq, dk, dv) in zip(REQUESTS, KEY_LIMIT_SPANS, dense):
        group = dq.shape[1] // dk.shape[1]
        k, v = dk.repeat_interleave(group, 1), dv.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", dq, k) * 0.125
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        query_pos = torch.arange(ctx - q_len, ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        seen = keys <= query_pos
        for first, last in spans:
            inside = (query_pos >= first) & (query_pos <= last)
            seen |= inside & (keys >= first) & (keys <= last)
        if window:
            seen &= keys > query_pos - window
        scores = scores.masked_fill(~seen[None], float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    limits = step_key_limits()
    for attention in (paged_attention_ref, paged_attention):
        out = attention(q, k_cache, v_cache, tables, qsl, seq_lens, 0.125,
                        sliding_window=window, soft_cap=cap, key_limits=limits)
        torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_paged_attention_ignores_cache_past_each_context():
    q, k_cache, v_cache, tables, qsl, seq_lens, _ = paged_case(4, 4, 2, 64, seed=7)
    out = paged_attention_ref(q, k_cache, v_cache, tables, qsl, seq_lens, 0.125)
    used = set(tables.flatten().tolist())
    spare = [b for b in range(k_cache.shape[0]) if b not in used]
    for r, ctx in enumerate(seq_lens.tolist()):
        num_blocks = -(-ctx // 4)
        tables[r, num_blocks:] = spare[r]  # table entries past the context: garbage blocks
        k_cache[spare[r]] = v_cache[spare[r]] = 1e4
        k_cache[tables[r, num_blocks - 1], ctx - 4 * (num_blocks - 1):] = 1e4
    torch.testing.assert_close(
        paged_attention_ref(q, k_cache, v_cache, tables, qsl, seq_lens, 0.125), out)
    torch.testing.assert_close(
        paged_attention(q, k_cache, v_cache, tables, qsl, seq_lens, 0.125), out)


def test_paged_attention_keeps_bf16_dtype():
    q, k_cache, v_cache, tables, qsl, seq_lens, dense = paged_case(4, 4, 2, 64, seed=3)
    out = paged_attention_ref(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables,
                              qsl, seq_lens, 0.125)
    assert out.dtype == torch.bfloat16
    expected = torch.cat([dense_attention(dq, dk, dv, 0.125) for dq, dk, dv in dense])
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)


def test_write_kv_writes_slots_and_skips_minus_one():
    g = torch.Generator().manual_seed(11)
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([13, -1, 0, 22, -1, 7], dtype=torch.int64)
    k = torch.randn(6, kv_heads, head_dim, generator=g)
    v = torch.randn(6, kv_heads, head_dim, generator=g)
    write_kv(k, v, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = k[t]
            expected_v[slot // block_size, slot % block_size] = v[t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not torch.equal(k_cache, before_k)


def test_write_kv_ref_casts_to_cache_dtype():
    g = torch.Generator().manual_seed(12)
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    k, v = torch.randn(3, 1, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    write_kv_ref(k, v, k_cache, v_cache, torch.tensor([5, 1, -1]))
    assert torch.equal(k_cache[1, 1], k[0].bfloat16()) and torch.equal(v_cache[0, 1],
                                                                        v[1].bfloat16())


def rms_formula(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_matches_formula():
    g = torch.Generator().manual_seed(21)
    x, w = torch.randn(7, 96, generator=g) * 3, torch.randn(96, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_formula(x, w, 1e-5))
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5), rms_formula(x, w, 1e-5))


def test_rms_norm_with_residual_returns_the_sum():
    g = torch.Generator().manual_seed(22)
    x, res, w = (torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g),
                 torch.randn(64, generator=g))
    out, new_residual = rms_norm(x, w, 1e-6, residual=res)
    torch.testing.assert_close(new_residual, x + res)
    torch.testing.assert_close(out, rms_formula(x + res, w, 1e-6))


def test_rms_norm_bf16_keeps_dtype_and_accuracy():
    g = torch.Generator().manual_seed(23)
    x, w = torch.randn(4, 128, generator=g), torch.randn(128, generator=g)
    out = rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rms_formula(x, w, 1e-6), rtol=2e-2, atol=2e-2)


def test_gemma_rms_norm_weighs_by_one_plus_weight_in_float32():
    """(normed * (1 + w)) rounded once: in bf16 it differs from rounding normed first."""
    g = torch.Generator().manual_seed(24)
    x, res, w = (torch.randn(6, 128, generator=g) * 3, torch.randn(6, 128, generator=g),
                 torch.randn(128, generator=g) * 0.5)
    expected = rms_formula(x + res, 1.0 + w, 1e-6)
    out, new_residual = rms_norm(x, w, 1e-6, residual=res, gemma=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_residual, x + res)
    xb, wb = x.bfloat16(), w.bfloat16()
    once = rms_formula(xb.float(), 1.0 + wb.float(), 1e-6).bfloat16()
    assert torch.equal(rms_norm_ref(xb, wb, 1e-6, gemma=True), once)
    assert rms_norm_ref(xb, wb, 1e-6, gemma=True).dtype == torch.bfloat16


def rotate_by_complex(x, positions, inv_freq):
    """Rotates each (x[i], x[i + d/2]) pair by position * inv_freq[i], as complex numbers."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    angle = positions.double()[:, None] * inv_freq.double()[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).float()


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}])
def test_rotary_matches_complex_rotation(scaling):
    g = torch.Generator().manual_seed(31)
    head_dim, theta = 64, 10000.0
    cache = rope_cos_sin_cache(head_dim, 512, theta, scaling)
    positions = torch.randint(0, 512, (9,), generator=g)
    q, k = torch.randn(9, 4, head_dim, generator=g), torch.randn(9, 2, head_dim, generator=g)
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    q_out, k_out = apply_rotary(positions, q, k, cache)
    torch.testing.assert_close(q_out, rotate_by_complex(q, positions, inv_freq),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_out, rotate_by_complex(k, positions, inv_freq),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(apply_rotary_ref(positions, q, k, cache)[0], q_out)


def test_default_inv_freq_is_theta_power():
    inv_freq = rope_inv_freq(128, 500000.0)
    expected = torch.tensor([500000.0 ** (-2 * i / 128) for i in range(64)])
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("original_max,factor", [(8192, 8.0), (64, 4.0)])
def test_llama3_inv_freq_matches_transformers(original_max, factor):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": factor,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": original_max})
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    theta, scaling = rope_settings(config)
    assert theta == 500000.0 and attention_factor == 1.0
    ours = rope_inv_freq(128, theta, scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    # all three bands present: kept, interpolated, slowed by `factor`
    unscaled = rope_inv_freq(128, theta)
    ratio = unscaled / ours
    assert (ratio == 1).any() and (ratio == factor).any()
    assert ((ratio > 1) & (ratio < factor)).any()


def test_rope_settings_reads_old_style_configs():
    old = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
    assert rope_settings(old) == (1e6, None)
    scaled = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "llama3", "factor": 8.0})
    assert rope_settings(scaled) == (5e5, {"type": "llama3", "factor": 8.0})
    assert rope_settings(SimpleNamespace()) == (10000.0, None)


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported rope_type .proportional.; supported: "):
        rope_inv_freq(64, 10000.0, {"rope_type": "proportional", "factor": 4.0})


def test_silu_and_mul_matches_formula():
    g = torch.Generator().manual_seed(41)
    x = torch.randn(3, 5, 2 * 48, generator=g) * 4
    gate, up = x[..., :48], x[..., 48:]
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(silu_and_mul(x), expected)
    torch.testing.assert_close(silu_and_mul_ref(x), expected)


def test_gelu_tanh_and_mul_matches_formula():
    g = torch.Generator().manual_seed(42)
    x = torch.randn(3, 5, 2 * 48, generator=g) * 4
    gate, up = x[..., :48], x[..., 48:]
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)
    expected = 0.5 * gate * (1 + torch.tanh(inner)) * up
    torch.testing.assert_close(gelu_tanh_and_mul(x), expected)
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), expected)


# --- fp8 caches ----------------------------------------------------------------------------

# (format, largest relative rounding error of a normal value: half its mantissa step,
# smallest subnormal step)
FP8_FORMATS = [(torch.float8_e4m3fn, 2 ** -4, 2 ** -9), (torch.float8_e5m2, 2 ** -3, 2 ** -16)]


def fp8_caches(dtype, *shape):
    return torch.zeros(*shape, dtype=dtype), torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype,rel,subnormal_step", FP8_FORMATS)
def test_write_kv_fp8_round_trip_within_the_format_error(dtype, rel, subnormal_step):
    """Scales of amax / fp8 max (calculate-kv-scales') use the whole range: every value
    comes back within half a mantissa step, subnormals within half their step."""
    g = torch.Generator().manual_seed(21)
    k, v = torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g) * 3
    k_scale = k.abs().amax().reshape(1) / torch.finfo(dtype).max
    v_scale = v.abs().amax().reshape(1) / torch.finfo(dtype).max
    k_cache, v_cache = fp8_caches(dtype, 10, 4, 2, 16)
    write_kv(k, v, k_cache, v_cache, torch.arange(40), k_scale, v_scale)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        back = dequantize(cache.flatten(0, 1), torch.float32, scale)
        assert ((back - x).abs() <= rel * x.abs() + subnormal_step / 2 * scale).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_fp8_saturates_past_the_range(dtype):
    """A scale too small for the data stores the format's max, never NaN or inf."""
    k_cache, v_cache = fp8_caches(dtype, 1, 4, 1, 2)
    x = torch.tensor([[[1e6, -1e6]], [[0.125, -0.25]]])
    write_kv(x, x, k_cache, v_cache, torch.tensor([0, 1]), torch.tensor([1e-3]),
             torch.tensor([1e-3]))
    limit = torch.finfo(dtype).max
    assert k_cache[0, 0, 0].float().tolist() == [limit, -limit]
    assert v_cache[0, 0, 0].float().tolist() == [limit, -limit]
    assert k_cache[0, 1, 0].float().tolist() == pytest.approx([125.0, -250.0], rel=2 ** -3)


# relative error (‖out − exact‖ / ‖exact‖) of attention over an fp8 cache of random
# unit-variance K/V, scaled to the range: e4m3 keeps 3 mantissa bits, e5m2 2; measured
# 3.1% and 6.0% on this case, bounded with about 1.3x headroom
FP8_ATTENTION_TOLERANCE = {torch.float8_e4m3fn: 0.04, torch.float8_e5m2: 0.08}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_attention_over_fp8_cache_close_to_fp32(dtype):
    q, k_cache, v_cache, tables, qsl, seq_lens, _ = paged_case(4, 6, 2, 64, seed=5)
    exact = paged_attention(q, k_cache, v_cache, tables, qsl, seq_lens, 0.125)
    limit = torch.finfo(dtype).max
    k_scale = k_cache.abs().amax().reshape(1) / limit
    v_scale = v_cache.abs().amax().reshape(1) / limit
    k8, v8 = quantize(k_cache, dtype, k_scale), quantize(v_cache, dtype, v_scale)
    for attention in (paged_attention, paged_attention_ref):
        out = attention(q, k8, v8, tables, qsl, seq_lens, 0.125, k_scale=k_scale,
                        v_scale=v_scale)
        error = ((out - exact).norm() / exact.norm()).item()
        assert error <= FP8_ATTENTION_TOLERANCE[dtype], f"{attention.__name__}: {error:.3g}"
