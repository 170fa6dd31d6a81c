"""W8A8 matmuls: activations quantized per token (or per 1 x `group` slice of a token) on the
fly, times weights quantized offline, with the scales applied to the float32 sums.

`quantize_per_token` gives x ≈ q * scale with one scale per row and group of `group`
columns: scale = amax / the format's max (448 for e4m3, 127 for int8), q = x / scale,
saturated (fp8) or rounded half away from zero and clamped (int8). `scaled_mm` multiplies
q_a [M, K] (scales [M, ceil(K / group_k)]) by q_b [N, K] (scales [ceil(N / block_n),
ceil(K / group_k)]): per-token x per-channel is group_k = K, block_n = 1; DeepSeek-style
128 x 128 weight blocks with 1 x 128 activation groups is group_k = block_n = 128.

Each has a torch twin (`_ref`) that computes the same in float32 on the dequantized values;
CPU tensors take it. On CUDA the Triton kernels run, and fp8 per-token x per-channel goes
through torch._scaled_mm (cuBLAS's rowwise-scaled fp8 GEMM) where its shapes allow.

tests/test_kernels_triton.py checks both kernels against their twins in the Triton
interpreter on CPU (int8 and fp8 GEMMs, int8 quantization, fp8 scales), except the fp8
values the quantization kernel writes: the interpreter's float32 -> fp8 cast drops the
rounding carry (triton 3.9), so those, and torch._scaled_mm's path, are checked on CUDA
only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import overlap_previous, pdl_launch

FP8_DTYPE = torch.float8_e4m3fn
QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
MIN_SCALE = 1e-10  # an all-zero row still divides by something
BLOCK_K = 64  # the GEMM's K tile: a scale group must be whole tiles (or all of K)
DECODE_ROWS = (17, 64)  # rows where decode_tiles applies (measured at 32 and 64)


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype, group: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `dtype`, float32 scales [M, ceil(K / group)]); group
    None is the whole row. The one dispatch point: CUDA tensors take the Triton kernel."""
    if x.is_cuda:
        return quantize_per_token_triton(x, dtype, group)
    return quantize_per_token_ref(x, dtype, group)


def quantize_per_token_ref(x: torch.Tensor, dtype: torch.dtype, group: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    group = group or cols
    groups = triton.cdiv(cols, group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols))
    parts = padded.view(rows, groups, group)
    amax = parts.abs().amax(dim=2)
    # over a tensor, not the Python number: CUDA torch multiplies by a scalar divisor's
    # reciprocal, a rounding off the kernel's (and the CPU's) correctly rounded division
    scale = (amax / torch.full_like(amax, QUANT_MAX[dtype])).clamp(min=MIN_SCALE)
    q = to_quantized(parts / scale[:, :, None], dtype).view(rows, -1)[:, :cols]
    return q.contiguous(), scale


def to_quantized(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> `dtype`, as the kernel rounds."""
    limit = QUANT_MAX[dtype]
    if dtype == torch.int8:
        v = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return v.clamp(-limit, limit).to(dtype)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / a fixed (checkpoint) scale, one elementwise pass: torch on every device."""
    return to_quantized(x.float() / scale, dtype)


def quantize_per_token_triton(x: torch.Tensor, dtype: torch.dtype, group: int | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    assert x.stride(1) == 1, "rows of contiguous features"
    group = group or cols
    groups = triton.cdiv(cols, group)
    q = torch.empty(rows, cols, dtype=dtype, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(rows, groups)](
            x, q, scale, cols, x.stride(0), group, QUANT_MAX[dtype], MIN_SCALE,
            IS_INT=dtype == torch.int8, BLOCK=triton.next_power_of_2(group), **pdl_launch(x))
    return q, scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, cols, x_stride, group, qmax, min_scale,
                     IS_INT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    overlap_previous(PDL)
    row, g = tl.program_id(0), tl.program_id(1)
    offs = g * group + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < group) & (offs < cols)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    # correctly rounded divisions (Triton's `/` may approximate), as torch's twin
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), qmax), min_scale)
    v = tl.math.div_rn(x, scale)
    if IS_INT:
        v = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
    v = tl.minimum(tl.maximum(v, -qmax), qmax)
    tl.store(q_ptr + row * cols + offs, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * tl.num_programs(1) + g, scale)


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              block_n: int, group_k: int, out_dtype: torch.dtype,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a * a_scale) (b * b_scale)^T (+ bias) in out_dtype. The one dispatch point."""
    if not a.is_cuda:
        return scaled_mm_ref(a, a_scale, b, b_scale, block_n, group_k, out_dtype, bias)
    tiles = decode_tiles(a, b, block_n, group_k)
    if tiles is None and can_use_scaled_mm(a, b, block_n, group_k, out_dtype):
        return torch._scaled_mm(a, b.t(), scale_a=a_scale.contiguous(), scale_b=b_scale.t(),
                                bias=bias, out_dtype=out_dtype)
    return scaled_mm_triton(a, a_scale, b, b_scale, block_n, group_k, out_dtype, bias, tiles)


def decode_tiles(a: torch.Tensor, b: torch.Tensor, block_n: int, group_k: int
                 ) -> ScaledMmTiles | None:
    """The Triton kernel's tiles for fp8 decode batches of DECODE_ROWS, per token x per
    channel, where they beat cuBLAS's rowwise GEMM: 256-byte K steps, 64 or 32 outputs a
    program so that even N = 4096 fills the SMs, five stages over a long K. At 64 rows on
    the H100 (benchmarks/gpu/fp8_gemm_sweep.py, benchmarks/issue30-h100/s5): Llama-3.1-8B's
    qkv 8.6 against 14.5 us, o 7.1 against 13.1, gate_up 45.2 against 47.7, down 25.2
    against 37.6; at 32 rows 8.2 against 17.6, 6.8 against 14.0, 44.1 against 47.9, 24.8
    against 42.0. At 128 rows cuBLAS wins gate_up (48.3 against 55.6), so larger batches
    stay with it. Elsewhere None: the caller's choice stands."""
    rows, k = a.shape
    n = b.shape[0]
    if not (a.dtype == FP8_DTYPE and block_n == 1 and group_k >= k
            and DECODE_ROWS[0] <= rows <= DECODE_ROWS[1]):
        return None
    return ScaledMmTiles(64, 64 if n // 64 >= 96 else 32, 256, 4, 5 if k >= 8192 else 3)


def can_use_scaled_mm(a: torch.Tensor, b: torch.Tensor, block_n: int, group_k: int,
                      out_dtype: torch.dtype) -> bool:
    """cuBLAS's rowwise fp8 GEMM: one scale per row of each operand, bf16 out, K and N
    multiples of 16."""
    rows, k = a.shape
    return (a.dtype == FP8_DTYPE and block_n == 1 and group_k >= k
            and out_dtype == torch.bfloat16 and k % 16 == 0 and b.shape[0] % 16 == 0)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_rows: int, group: int
               ) -> torch.Tensor:
    """q [R, C] times its scales [ceil(R / block_rows), ceil(C / group)], in float32."""
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block_rows, 0)[:rows]
    return q.float() * full.repeat_interleave(group, 1)[:, :cols]


def scaled_mm_ref(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                  b_scale: torch.Tensor, block_n: int, group_k: int, out_dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    group_k = min(group_k, a.shape[1])
    y = dequantize(a, a_scale, 1, group_k) @ dequantize(b, b_scale, block_n, group_k).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@dataclass(frozen=True, slots=True)
class ScaledMmTiles:
    block_m: int
    block_n: int = 64
    block_k: int = BLOCK_K
    num_warps: int = 4
    num_stages: int = 3


def scaled_mm_triton(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                     b_scale: torch.Tensor, block_n: int, group_k: int,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     tiles: ScaledMmTiles | None = None) -> torch.Tensor:
    """tiles: force these (sweeps); by default by the row count."""
    rows, k = a.shape
    n = b.shape[0]
    tiles = tiles or ScaledMmTiles(16 if rows <= 16 else 64)
    assert group_k >= k or group_k % tiles.block_k == 0, "a scale group must be whole K tiles"
    assert a.stride(1) == 1 and b.stride(1) == 1
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    c = torch.empty(rows, n, dtype=out_dtype, device=a.device)
    if rows == 0:
        return c
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _scaled_mm_kernel[grid](
        a, a_scale, b, b_scale, bias if bias is not None else c, c, rows, n, k,
        a.stride(0), b.stride(0), a_scale.shape[1], min(group_k, k), block_n,
        HAS_BIAS=bias is not None, IS_INT=a.dtype == torch.int8,
        PER_K_SCALE=group_k < k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_launch(a))
    return c


@triton.jit
def _scaled_mm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
                      stride_a, stride_b, groups, group_k, block_n, HAS_BIAS: tl.constexpr,
                      IS_INT: tl.constexpr, PER_K_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One scale group over all of K (per-token activations, per-channel weights) scales
    the sums once after the loop; K groups scale each tile's."""
    overlap_previous(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_a + k0 + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_b + k0 + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        if IS_INT:
            part = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
        else:
            part = tl.dot(a, b)
        if PER_K_SCALE:  # every K tile lies in one scale group (asserted by the caller)
            g = k0 // group_k
            sa = tl.load(a_scale_ptr + offs_m * groups + g, mask=mask_m, other=0.0)
            sb = tl.load(b_scale_ptr + (offs_n // block_n) * groups + g, mask=mask_n,
                         other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
    if not PER_K_SCALE:
        sa = tl.load(a_scale_ptr + offs_m * groups, mask=mask_m, other=0.0)
        sb = tl.load(b_scale_ptr + (offs_n // block_n) * groups, mask=mask_n, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])
