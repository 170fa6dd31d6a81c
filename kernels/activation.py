"""The gated activations of Llama-style MLPs: SiLU (Llama, Qwen, Phi-3) and tanh-approximated
GELU (Gemma's GeGLU), both act(gate) * up over one fused [gate; up] input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import overlap_previous, pdl_launch

# columns per program: wide enough for 16-byte accesses across 4 warps, narrow enough
# that a decode batch's few rows still spread over every SM
BLOCK_COLS = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]. The one dispatch point for this op:
    CUDA tensors take the Triton kernel."""
    if x.is_cuda:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out: a contiguous [..., d] buffer to write into, allocated when None."""
    return _act_and_mul_triton(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> gelu_tanh(x[..., :d]) * x[..., d:] (transformers'
    gelu_pytorch_tanh). The one dispatch point for this op: CUDA tensors take Triton."""
    if x.is_cuda:
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """out: a contiguous [..., d] buffer to write into, allocated when None."""
    return _act_and_mul_triton(x, out, gelu_tanh=True)


def _act_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool
                        ) -> torch.Tensor:
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    assert rows.stride(1) == 1
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device) if out is None \
        else out
    assert out.is_contiguous() and out.shape == (*x.shape[:-1], d)
    block = min(BLOCK_COLS, triton.next_power_of_2(d))
    _act_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
        rows, out, d, rows.stride(0), GELU_TANH=gelu_tanh, BLOCK=block, num_warps=4,
        **pdl_launch(x))
    return out


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, d, stride_row, GELU_TANH: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    overlap_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_row + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi)
        # tanh(z) = 2 sigmoid(2z) - 1: exp overflows to inf for very negative z, giving -1
        act = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        act = g / (1.0 + tl.exp(-g))
    # the activation rounded to the activation dtype before the product, as the reference
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)
