"""The attention's inputs from the fused q/k/v projection in one launch: the per-head q/k
RMSNorm (Qwen3, Gemma 3), rotary (neox style, partial rotary too) and the write of the new
K and V into the paged cache (fp8 caches with their scales).

At batch-1 decode these were four to five launches a layer that each move a few kilobytes
(issue 29's profiles: 1.5 to 5 us each); fused, the qkv row is read once and q is the only
tensor written besides the cache. The torch twin is the separate ops in the same order,
which is also what runs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.cache import FP8_DTYPES, _quantize, write_kv_ref
from kernels.norm import rms_norm_ref
from kernels.pdl import let_next_start, pdl_launch, wait_for_previous
from kernels.rotary import _round_like, apply_rotary_ref

# heads per program: a Qwen3-30B-A3B decode token (32 q, 4 KV heads) spreads over 9
# programs instead of one, and a prefill still gets few, fat programs per token
HEADS_PER_PROGRAM = 4


@dataclass(frozen=True, slots=True)
class HeadNorms:
    """Per-head RMSNorm weights of q and k ([head_dim] each), and Gemma's (1 + w) weighting
    when gemma is set (kernels/norm.py)."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    gemma: bool = False


def norm_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, norms: HeadNorms | None = None,
                       k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], q heads then k then v (the
    QKV projection's output); caches [num_blocks, block_size, num_kv_heads, head_dim] with
    slot_mapping, k_scale and v_scale as kernels.cache.write_kv takes them; cos_sin_cache
    as kernels.rotary's. Normalizes q and k per head (norms), rotates them, writes k and v
    into the caches and returns q, [T, num_heads, head_dim]. The one dispatch point for
    this op: CUDA tensors take the Triton kernel."""
    if qkv.is_cuda:
        return norm_rope_write_kv_triton(qkv, positions, cos_sin_cache, num_heads, k_cache,
                                         v_cache, slot_mapping, norms, k_scale, v_scale)
    return norm_rope_write_kv_ref(qkv, positions, cos_sin_cache, num_heads, k_cache, v_cache,
                                  slot_mapping, norms, k_scale, v_scale)


def norm_rope_write_kv_ref(qkv: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, num_heads: int, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           norms: HeadNorms | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.unflatten(1, (-1, head_dim)).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)
    if norms is not None:
        q = rms_norm_ref(q, norms.q_weight, norms.eps, gemma=norms.gemma)
        k = rms_norm_ref(k, norms.k_weight, norms.eps, gemma=norms.gemma)
    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def norm_rope_write_kv_triton(qkv: torch.Tensor, positions: torch.Tensor,
                              cos_sin_cache: torch.Tensor, num_heads: int,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, norms: HeadNorms | None = None,
                              k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None,
                              q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Programs (token, group of HEADS_PER_PROGRAM heads): the q groups first, then the
    k/v groups, which also write the cache. q_out: a contiguous [T, num_heads, head_dim]
    buffer to write q into, allocated when None."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rotary_dim = cos_sin_cache.shape[1]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos_sin_cache.is_contiguous() and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    fp8 = k_cache.dtype in FP8_DTYPES
    assert not fp8 or (k_scale is not None and v_scale is not None), "fp8 needs scales"
    if norms is not None:  # the norm rounds to the activation dtype, as the twin's does
        assert norms.gemma or norms.q_weight.dtype == qkv.dtype, "weights in qkv's dtype"
        assert norms.q_weight.is_contiguous() and norms.k_weight.is_contiguous()
    if q_out is None:
        q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype,
                            device=qkv.device)
    assert q_out.is_contiguous() and q_out.shape == (num_tokens, num_heads, head_dim)
    half, pass_dims = rotary_dim // 2, head_dim - rotary_dim
    q_groups = triton.cdiv(num_heads, HEADS_PER_PROGRAM)
    kv_groups = triton.cdiv(num_kv_heads, HEADS_PER_PROGRAM)
    if num_tokens == 0:
        return q_out
    _norm_rope_write_kv_kernel[(num_tokens, q_groups + kv_groups)](
        positions, qkv, cos_sin_cache, norms.q_weight if norms else qkv,
        norms.k_weight if norms else qkv, q_out, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, qkv.stride(0), num_heads,
        num_kv_heads, norms.eps if norms else 0.0, q_groups,
        BLOCK_H=HEADS_PER_PROGRAM, HEAD_DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
        HALF=half, HALF_BLOCK=triton.next_power_of_2(half),
        PASS_BLOCK=triton.next_power_of_2(max(pass_dims, 1)),
        HAS_NORM=norms is not None, GEMMA=bool(norms and norms.gemma), FP8=fp8,
        FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0, num_warps=4,
        **pdl_launch(qkv))
    return q_out


# An eager step's positions and slots are views at any 8-byte offset into the buffer that
# brought its inputs over (services/worker/inputs.py): specialized on their alignment, they
# would compile another kernel in the middle of serving. One word a program each.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _norm_rope_write_kv_kernel(
        positions_ptr, qkv_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr,
        v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, stride_t, num_heads,
        num_kv_heads, eps, q_groups,
        BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
        HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
        HAS_NORM: tl.constexpr, GEMMA: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        PDL: tl.constexpr):
    let_next_start(PDL)
    # HALF: half the rotary dims; HALF_BLOCK: HALF rounded up to a power of two;
    # PASS_BLOCK: the pass-through dims (HEAD_DIM - 2 * HALF) rounded up, at least 1 (its
    # loads and stores are masked off where there are none)
    token = tl.program_id(0)
    group = tl.program_id(1)
    half_cols = tl.arange(0, HALF_BLOCK)[None, :]
    # a step's positions and slots are inputs, copied in before its first kernel (a plain
    # launch that no PDL kernel overtakes), and the table is a constant: their two
    # dependent round trips go out while the previous kernel ends
    row = cos_sin_ptr + tl.load(positions_ptr + token) * (2 * HALF)
    cos = tl.load(row + half_cols, mask=half_cols < HALF, other=0.0)
    sin = tl.load(row + HALF + half_cols, mask=half_cols < HALF, other=0.0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    wait_for_previous(PDL)
    qkv_row = qkv_ptr + token * stride_t
    if group < q_groups:
        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        rows = heads < num_heads
        x1, x2, x3 = _norm_rope_heads(qkv_row + heads * HEAD_DIM, rows, q_w_ptr, cos, sin,
                                      eps, HEAD_DIM, HALF, HALF_BLOCK, PASS_BLOCK, HAS_NORM,
                                      GEMMA)
        _store_head_parts(q_out_ptr + (token * num_heads + heads) * HEAD_DIM, rows, x1, x2,
                          x3, q_out_ptr, q_out_ptr, HEAD_DIM, HALF, HALF_BLOCK, PASS_BLOCK,
                          False, FP8_MAX)
    else:
        heads = (group - q_groups) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        # padding (slot -1) writes nothing; q above is still computed for its row
        rows = (heads < num_kv_heads) & (heads * 0 + slot >= 0)
        x1, x2, x3 = _norm_rope_heads(qkv_row + (num_heads + heads) * HEAD_DIM, rows, k_w_ptr,
                                      cos, sin, eps, HEAD_DIM, HALF, HALF_BLOCK, PASS_BLOCK,
                                      HAS_NORM, GEMMA)
        cache_heads = (slot * num_kv_heads + heads) * HEAD_DIM
        _store_head_parts(k_cache_ptr + cache_heads, rows, x1, x2, x3, k_cache_ptr,
                          k_scale_ptr, HEAD_DIM, HALF, HALF_BLOCK, PASS_BLOCK, FP8, FP8_MAX)
        dims = tl.arange(0, DIM_BLOCK)[None, :]
        v_mask = rows & (dims < HEAD_DIM)
        v = tl.load(qkv_row + (num_heads + num_kv_heads + heads) * HEAD_DIM + dims,
                    mask=v_mask, other=0.0)
        v = _quantize(v, v_scale_ptr, FP8, FP8_MAX)
        tl.store(v_cache_ptr + cache_heads + dims, v.to(v_cache_ptr.dtype.element_ty),
                 mask=v_mask)


@triton.jit
def _norm_rope_heads(src, rows, w_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr,
                     HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
                     HAS_NORM: tl.constexpr, GEMMA: tl.constexpr):
    """src: [BLOCK_H, 1] pointers to each head's first element. Returns the rotated first
    and second halves of the rotary dims and the pass-through dims (masked-off zeros
    where there are none), in the activation dtype."""
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    mask = rows & (cols < HALF)
    rest = 2 * HALF + tl.arange(0, PASS_BLOCK)[None, :]
    rest_mask = rows & (rest < HEAD_DIM)
    x1 = tl.load(src + cols, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
    x3 = tl.load(src + rest, mask=rest_mask, other=0.0)
    if HAS_NORM:
        a, b, c = x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        # the statistics over the whole head, rotated dims and pass-through ones alike
        squares = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(c * c, axis=1)
        inv_rms = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
        x1 = _weigh(a * inv_rms, w_ptr + cols, cols < HALF, x1, GEMMA)
        x2 = _weigh(b * inv_rms, w_ptr + HALF + cols, cols < HALF, x2, GEMMA)
        x3 = _weigh(c * inv_rms, w_ptr + rest, rest < HEAD_DIM, x3, GEMMA)
    # rounded where the torch twin rounds (kernels/rotary.py's _rotate_heads)
    c, s = _round_like(cos, x1), _round_like(sin, x1)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = _round_like(a * c, x1) - _round_like(b * s, x1)
    out2 = _round_like(b * c, x1) + _round_like(a * s, x1)
    return out1.to(x1.dtype), out2.to(x1.dtype), x3


@triton.jit
def _weigh(normed, w_ptrs, w_mask, like, GEMMA: tl.constexpr):
    """The norm's weighting, rounded to like's dtype as kernels/norm.py's kernel rounds."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = normed * (1.0 + w)
    else:
        y = w * normed.to(like.dtype).to(tl.float32)
    return y.to(like.dtype)


@triton.jit
def _store_head_parts(dst, rows, x1, x2, x3, out_ptr, scale_ptr, HEAD_DIM: tl.constexpr,
                      HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
                      FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Stores a [BLOCK_H, HEAD_DIM] tile given as its three parts at dst ([BLOCK_H, 1]
    pointers), quantized for an fp8 cache (out_ptr gives the element type)."""
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    mask = rows & (cols < HALF)
    kind = out_ptr.dtype.element_ty
    tl.store(dst + cols, _quantize(x1, scale_ptr, FP8, FP8_MAX).to(kind), mask=mask)
    tl.store(dst + HALF + cols, _quantize(x2, scale_ptr, FP8, FP8_MAX).to(kind), mask=mask)
    rest = 2 * HALF + tl.arange(0, PASS_BLOCK)[None, :]
    tl.store(dst + rest, _quantize(x3, scale_ptr, FP8, FP8_MAX).to(kind),
             mask=rows & (rest < HEAD_DIM))
