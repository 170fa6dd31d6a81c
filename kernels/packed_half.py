"""What the one-row GEMVs that multiply in packed fp16 share (kernels/int4.py, and
kernels/fp8_gemv.py's one-row kernel): activations packed two to an int32 for f16x2
instructions, and the power-of-two scales that keep their products inside fp16's range.
CUDA only: the kernels that use them run inline PTX."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def half_pair(low, high):
    """Two float32 tensors as fp16 pairs in int32s: low in bits 0-15, high in 16-31. One
    packing conversion a pair, where two conversions and the bit moves took five."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [low, high],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def power_of_two_scales(largest, TOP: tl.constexpr):
    """(up, down) = (2^(TOP - e), 2^(e - TOP)), 2^e being `largest` (float32, >= 0)
    rounded down to a power of two: values times `up` lie below 2^(TOP + 1), exactly
    rescaled by `down`. e is taken as at least -119, so that both are normal floats."""
    power = tl.maximum(largest.to(tl.int32, bitcast=True) & 0x7F800000, 8 << 23)
    up = ((254 << 23) - power + (TOP << 23)).to(tl.float32, bitcast=True)
    down = (power - (TOP << 23)).to(tl.float32, bitcast=True)
    return up, down
