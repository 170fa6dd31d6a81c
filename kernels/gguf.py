"""GGUF weights kept quantized: dequantize and matmul straight from llama.cpp's blocks.

A quantized GGUF matrix [rows, cols] is stored row by row, each row a run of independent
blocks (ggml's block layouts, the `gguf` package's numpy dequantizers being the oracle):

    Q4_0  32 values in 18 bytes:  d (fp16), 16 bytes of 4-bit q (value i < 16 the low
          nibble of byte i, value 16 + i its high nibble)        value = d * (q - 8)
    Q4_1  32 values in 20 bytes:  d, m (fp16), then as Q4_0       value = d * q + m
    Q8_0  32 values in 34 bytes:  d (fp16), 32 x int8 q            value = d * q
    Q4_K  256 values in 144 bytes: d, dmin (fp16), 12 bytes of eight 6-bit scales and
          eight 6-bit mins, 128 bytes of 4-bit q (sub-block j of 32 values: byte
          32*(j//2) + i, low nibble for even j, high for odd)   value = d*sc_j*q - dmin*m_j
    Q5_K  256 values in 176 bytes: as Q4_K, with 32 bytes of high bits (bit j of byte i
          is the fifth bit of value i of sub-block j) before the 128 bytes of low nibbles
    Q6_K  256 values in 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs,
          16 int8 scales (one per 16 values), d (fp16)   value = d * scale * (q - 32)

Since rows are independent, a weight may be split (tensor parallelism) or permuted by
whole rows, and along its columns at block boundaries.

Three forms of each operation: `*_ref` (torch, any device: the CPU path and the twin the
kernels are tested against), `*_triton` (CUDA, or the interpreter), and `gguf_linear`,
which picks: for a few rows of x (decode) a fused kernel reads the blocks once per tile of
weight rows; for more rows the weight is dequantized into x's dtype and multiplied by
torch's matmul, whose tensor-core tiles beat a dequantizing loop there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


class GGUFType(IntEnum):
    """ggml's type ids (GGMLQuantizationType) of the types kept quantized."""
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


@dataclass(frozen=True, slots=True)
class BlockLayout:
    values: int  # values per block
    nbytes: int  # bytes per block


LAYOUTS = {GGUFType.Q4_0: BlockLayout(32, 18), GGUFType.Q4_1: BlockLayout(32, 20),
           GGUFType.Q8_0: BlockLayout(32, 34), GGUFType.Q4_K: BlockLayout(256, 144),
           GGUFType.Q5_K: BlockLayout(256, 176), GGUFType.Q6_K: BlockLayout(256, 210)}
GEMV_MAX_ROWS = 8  # rows of x up to which gguf_linear takes the fused kernel


def gguf_type(qtype: int) -> GGUFType:
    try:
        return GGUFType(int(qtype))
    except ValueError:
        supported = ", ".join(t.name for t in GGUFType)
        raise ValueError(f"GGUF quantization type {int(qtype)} is not kept quantized; "
                         f"supported: {supported}") from None


def layout(qtype: int) -> BlockLayout:
    return LAYOUTS[gguf_type(qtype)]


def bytes_per_row(qtype: int, cols: int) -> int:
    """Bytes of one row of `cols` values; cols must be whole blocks."""
    block = layout(qtype)
    if cols % block.values:
        raise ValueError(f"{gguf_type(qtype).name} rows hold whole blocks of {block.values} "
                         f"values; {cols} columns is not a multiple")
    return cols // block.values * block.nbytes


def check_raw(raw: torch.Tensor, qtype: int, cols: int) -> None:
    expected = bytes_per_row(qtype, cols)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected:
        raise ValueError(f"{gguf_type(qtype).name} weight of {cols} columns must be uint8 "
                         f"[rows, {expected}], got {raw.dtype} {list(raw.shape)}")


# --- torch twin -------------------------------------------------------------------------

def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 [..., 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from bytes 4..15: sub-blocks 0-3 in the low
    6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take 4 bits from bytes
    8-11 (low nibble scale, high nibble min) and their top 2 bits from the top of 0-7."""
    s = blocks[..., 4:16].int()
    first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([first & 63, (third & 15) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., groups, n] bytes -> [..., groups, 2, n]: the low nibbles, then the high."""
    return torch.stack([packed & 15, packed >> 4], dim=-2)


def _dequantize_q4(blocks: torch.Tensor, with_min: bool) -> torch.Tensor:
    """Q4_0 (with_min False: q offset by 8) or Q4_1 (d * q + m)."""
    d = _fp16_field(blocks, 0)
    start = 4 if with_min else 2
    q = _nibbles(blocks[..., start:start + 16].int()).reshape(*blocks.shape[:-1], 32)
    if with_min:
        return d * q.float() + _fp16_field(blocks, 2)
    return d * (q - 8).float()


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16_field(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()


def _dequantize_k(blocks: torch.Tensor, high_bits: bool) -> torch.Tensor:
    """Q4_K (high_bits False) or Q5_K: [..., 256] values of each super-block."""
    lead = blocks.shape[:-1]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    scales, mins = _k_scales_mins(blocks)
    low_start = 48 if high_bits else 16
    q = _nibbles(blocks[..., low_start:low_start + 128].int().reshape(*lead, 4, 32))
    q = q.reshape(*lead, 8, 32)
    if high_bits:
        qh = blocks[..., 16:48].int()
        shifts = torch.arange(8, device=blocks.device)[:, None]
        q = q | (((qh[..., None, :] >> shifts) & 1) << 4)
    values = (d * scales)[..., None] * q.float() - (dmin * mins)[..., None]
    return values.reshape(*lead, 256)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    lead = blocks.shape[:-1]
    low = _nibbles(blocks[..., :128].int().reshape(*lead, 2, 64)).reshape(*lead, 256)
    qh = blocks[..., 128:192].int().reshape(*lead, 2, 32)
    shifts = 2 * torch.arange(4, device=blocks.device)[:, None]
    high = ((qh[..., None, :] >> shifts) & 3).reshape(*lead, 256)
    q = ((low | (high << 4)) - 32).float().reshape(*lead, 16, 16)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = _fp16_field(blocks, 208)
    return ((d * scales)[..., None] * q).reshape(*lead, 256)


def dequantize_ref(raw: torch.Tensor, qtype: int, cols: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [rows, bytes_per_row] -> [rows, cols] (computed in float32)."""
    check_raw(raw, qtype, cols)
    qtype, block = gguf_type(qtype), layout(qtype)
    blocks = raw.reshape(raw.shape[0], cols // block.values, block.nbytes)
    if qtype in (GGUFType.Q4_0, GGUFType.Q4_1):
        values = _dequantize_q4(blocks, with_min=qtype == GGUFType.Q4_1)
    elif qtype == GGUFType.Q8_0:
        values = _dequantize_q8_0(blocks)
    elif qtype == GGUFType.Q6_K:
        values = _dequantize_q6_k(blocks)
    else:
        values = _dequantize_k(blocks, high_bits=qtype == GGUFType.Q5_K)
    return values.reshape(raw.shape[0], cols).to(dtype)


def gguf_linear_ref(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W dequantized into x's dtype."""
    return F.linear(x, dequantize_ref(raw, qtype, cols, x.dtype), bias)


# --- Triton ------------------------------------------------------------------------------

@triton.jit
def _load_fp16(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _dequantize_values(block, e, mask, QTYPE: tl.constexpr):
    """float32 values at index `e` of the blocks starting at the pointers `block` (any
    shape; both broadcast). Each value gathers its own bytes: neighbours share them, and
    the loads of a tile hit the same cache lines."""
    if QTYPE == 2:  # Q4_0
        q = (_load_byte(block + 2 + e % 16, mask) >> (4 * (e // 16))) & 15
        values = _load_fp16(block, mask) * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        q = (_load_byte(block + 4 + e % 16, mask) >> (4 * (e // 16))) & 15
        values = _load_fp16(block, mask) * q.to(tl.float32) + _load_fp16(block + 2, mask)
    elif QTYPE == 8:  # Q8_0
        q = tl.load(block + 2 + e, mask=mask, other=0).to(tl.int8, bitcast=True)
        values = _load_fp16(block, mask) * q.to(tl.float32)
    elif QTYPE == 14:  # Q6_K
        half = e // 128
        within = e % 128
        low = (_load_byte(block + half * 64 + within % 64, mask) >> (4 * (within // 64))) & 15
        high = (_load_byte(block + 128 + half * 32 + within % 32, mask)
                >> (2 * (within // 32))) & 3
        scale = tl.load(block + 192 + e // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _load_fp16(block + 208, mask)
        values = d * scale.to(tl.float32) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # Q4_K (12), Q5_K (13)
        j = e // 32
        i = j % 4
        first = _load_byte(block + 4 + i, mask)
        second = _load_byte(block + 8 + i, mask)
        third = _load_byte(block + 12 + i, mask)
        low_half = j < 4
        scale = tl.where(low_half, first & 63, (third & 15) | ((first >> 6) << 4))
        minimum = tl.where(low_half, second & 63, (third >> 4) | ((second >> 6) << 4))
        if QTYPE == 13:
            qs_start = 48
        else:
            qs_start = 16
        q = (_load_byte(block + qs_start + 32 * (j // 2) + e % 32, mask) >> (4 * (j % 2))) & 15
        if QTYPE == 13:
            q = q | (((_load_byte(block + 16 + e % 32, mask) >> j) & 1) << 4)
        d = _load_fp16(block, mask)
        dmin = _load_fp16(block + 2, mask)
        values = (d * scale.to(tl.float32)) * q.to(tl.float32) \
            - dmin * minimum.to(tl.float32)
    return values


@triton.jit
def _dequantize_kernel(raw, out, cols, raw_stride, out_stride, QTYPE: tl.constexpr,
                       BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    block = raw + row.to(tl.int64) * raw_stride + (col // BLOCK_VALUES) * BLOCK_BYTES
    values = _dequantize_values(block, col % BLOCK_VALUES, mask, QTYPE)
    tl.store(out + row.to(tl.int64) * out_stride + col, values.to(out.dtype.element_ty),
             mask=mask)


def dequantize_triton(raw: torch.Tensor, qtype: int, cols: int,
                      dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                      block: int = 256) -> torch.Tensor:
    """dequantize_ref's twin: one program per row and `block` columns."""
    check_raw(raw, qtype, cols)
    if raw.stride(1) != 1:
        raise ValueError("GGUF rows must be contiguous bytes")
    qtype, layout_ = gguf_type(qtype), layout(qtype)
    out = torch.empty(raw.shape[0], cols, dtype=dtype, device=raw.device) if out is None \
        else out
    assert out.shape == (raw.shape[0], cols) and out.stride(1) == 1
    grid = (raw.shape[0], triton.cdiv(cols, block))
    _dequantize_kernel[grid](raw, out, cols, raw.stride(0), out.stride(0), int(qtype),
                             layout_.values, layout_.nbytes, block)
    return out


@triton.jit
def _gemv_kernel(x, raw, y, rows_x, n, cols, x_stride, raw_stride, y_stride,
                 QTYPE: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[:, tile] = x W[tile]^T for one tile of BLOCK_N weight rows: each weight tile is
    dequantized once in registers and dotted with every row of x (at most BLOCK_M)."""
    w_rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    row_ok = w_rows < n
    block_row = raw + w_rows.to(tl.int64)[:, None] * raw_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < cols
        w = _dequantize_values(block_row + (k // BLOCK_VALUES)[None, :] * BLOCK_BYTES,
                               (k % BLOCK_VALUES)[None, :], row_ok[:, None] & k_ok[None, :],
                               QTYPE)
        xs = tl.load(x + m[:, None] * x_stride + k[None, :],
                     mask=(m < rows_x)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xs[:, None, :] * w[None, :, :], axis=2)
    tl.store(y + m[:, None] * y_stride + w_rows[None, :], acc.to(y.dtype.element_ty),
             mask=(m < rows_x)[:, None] & row_ok[None, :])


def gguf_gemv_triton(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int,
                     block_n: int = 16, block_k: int = 64) -> torch.Tensor:
    """y = x W^T for x [M <= GEMV_MAX_ROWS, cols], reading W's blocks directly."""
    check_raw(raw, qtype, cols)
    if x.dim() != 2 or x.shape[1] != cols or x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"the fused GGUF GEMV takes x [<= {GEMV_MAX_ROWS}, {cols}], got "
                         f"{list(x.shape)}")
    x = x.contiguous()
    qtype, layout_ = gguf_type(qtype), layout(qtype)
    y = torch.empty(x.shape[0], raw.shape[0], dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(raw.shape[0], block_n),)
    _gemv_kernel[grid](x, raw, y, x.shape[0], raw.shape[0], cols, x.stride(0), raw.stride(0),
                       y.stride(0), int(qtype), layout_.values, layout_.nbytes,
                       triton.next_power_of_2(max(x.shape[0], 1)), block_n, block_k)
    return y


def gguf_linear_triton(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., cols]: the fused GEMV for up to GEMV_MAX_ROWS rows, else the weight
    dequantized into x's dtype and torch's matmul. The choice reads only shapes (no host
    sync: CUDA graphs capture it)."""
    flat = x.reshape(-1, cols)
    if flat.shape[0] <= GEMV_MAX_ROWS:
        y = gguf_gemv_triton(flat, raw, qtype, cols)
        y = y if bias is None else y + bias
    else:
        y = F.linear(flat, dequantize_triton(raw, qtype, cols, x.dtype), bias)
    return y.reshape(*x.shape[:-1], raw.shape[0])


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for a GGUF-quantized W: Triton on CUDA, the twin elsewhere."""
    if x.is_cuda:
        return gguf_linear_triton(x, raw, qtype, cols, bias)
    return gguf_linear_ref(x, raw, qtype, cols, bias)
