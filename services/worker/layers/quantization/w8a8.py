"""W8A8: 8-bit weights (fp8 e4m3 or int8) times activations quantized to the same type on
the fly, through kernels/quant.py; on CUDA a step of at most GEMV_MAX_ROWS rows (decode)
multiplies fp8 weights by the unquantized activations instead (kernels/fp8_gemv.py): at a few
rows the weight read is the whole cost, and the quantize launch and cuBLAS's fp8 GEMM only
add to it. The row count is a shape, so each CUDA-graph batch size captures one path.

Weight scales are held per output row ([out, 1]) or per block ([out / 128, in / 128]), as
one fused GEMM needs them: per-tensor checkpoints load one scale per fused part (q, k, v)
and process_after_loading spreads each over its part's rows, which is exact (vLLM instead
requantizes every part to the largest scale). A static input scale per part becomes their
maximum: the one activation tensor they share is quantized once, and the largest scale
clips none of it.
"""

from __future__ import annotations

import torch
from torch import nn

from common.quantization import QuantSpec
from kernels.fp8_gemv import fp8_gemv
from kernels.gemv import GEMV_MAX_ROWS
from kernels.norm_seam import ResidualSum, SeamNorm
from kernels.quant import FP8_DTYPE, quantize_per_token, quantize_static, scaled_mm
from services.worker.layers.quantization.base import QuantMethod, ceil_div, quant_parameter

DTYPES = {"fp8": FP8_DTYPE, "int8": torch.int8}


def check_whole_blocks(layer: nn.Module, input_size: int, output_sizes: list[int],
                       block: tuple[int, int]) -> None:
    """Under tensor parallelism a rank's share of each fused part, and of a row-parallel
    layer's input, must be whole blocks: a block split between ranks has one scale."""
    if layer.tp_size == 1:
        return
    if layer.input_split:
        split = input_size % block[1] != 0
    else:
        split = any(size % block[0] for size in output_sizes)
    if split:
        raise ValueError(f"{type(layer).__name__}: a rank's {output_sizes} output and "
                         f"{input_size} input features do not split into whole blocks of "
                         f"{block[0]}x{block[1]}; use a smaller --tensor-parallel-size")


class W8A8Method(QuantMethod):
    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.name = spec.method
        self.qdtype = DTYPES[spec.weight_type]

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        spec, out = self.spec, sum(output_sizes)
        layer.output_parts = output_sizes
        weight_dtype = dtype if spec.online else self.qdtype
        layer.weight = quant_parameter(torch.empty(out, input_size, dtype=weight_dtype),
                                       output_dim=0, input_dim=1, loader=layer.weight_loader)
        if spec.online:
            return
        if spec.weight_strategy == "block":
            block_n, block_k = spec.block
            check_whole_blocks(layer, input_size, output_sizes, spec.block)
            rows = sum(ceil_div(size, block_n) for size in output_sizes)
            layer.weight_scale_inv = quant_parameter(
                torch.empty(rows, ceil_div(input_size, block_k), dtype=torch.float32),
                output_dim=0, input_dim=1, output_block=block_n, loader=layer.weight_loader)
        elif spec.weight_strategy == "channel":
            layer.weight_scale = quant_parameter(torch.empty(out, 1, dtype=torch.float32),
                                                 output_dim=0, input_dim=None,
                                                 loader=layer.weight_loader)
        else:
            layer.weight_scale = self.per_part(layer, len(output_sizes))
        if spec.activations == "static":
            layer.input_scale = self.per_part(layer, len(output_sizes))

    @staticmethod
    def per_part(layer: nn.Module, parts: int) -> nn.Parameter:
        return quant_parameter(torch.empty(parts, dtype=torch.float32), output_dim=None,
                               input_dim=None, per_part=True, loader=layer.weight_loader)

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        """Every layer's scales as scaled_mm takes them: [out, 1] rows, or blocks."""
        spec, parts = self.spec, layer.output_parts
        layer.block_n, layer.group_k = 1, layer.weight.shape[1]
        if spec.online:
            # per output channel, as activations are per token
            q, scale = quantize_per_token(layer.weight.data, self.qdtype)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        elif spec.weight_strategy == "tensor":
            rows = torch.repeat_interleave(layer.weight_scale.data,
                                           torch.tensor(parts, device=layer.weight.device))
            layer.weight_scale = nn.Parameter(rows[:, None].contiguous(), requires_grad=False)
        elif spec.weight_strategy == "block":
            self.blocks_after_loading(layer)
        if spec.activations == "static":
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1, 1),
                                             requires_grad=False)

    def blocks_after_loading(self, layer: nn.Module) -> None:
        """Block scales stay blocks when every fused part is whole blocks of rows; else
        (a tiny model's q/k/v of 64 rows each) each part's rows take their block's scale."""
        block_n, block_k = self.spec.block
        layer.group_k = block_k
        parts = layer.output_parts
        if all(size % block_n == 0 for size in parts):
            layer.block_n = block_n
            layer.weight_scale = layer.weight_scale_inv
        else:
            blocks = layer.weight_scale_inv.data.split([ceil_div(s, block_n) for s in parts])
            rows = [b.repeat_interleave(block_n, 0)[:size] for b, size in zip(blocks, parts)]
            layer.weight_scale = nn.Parameter(torch.cat(rows), requires_grad=False)
        del layer.weight_scale_inv

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.takes_gemv(rows):
            y = fp8_gemv(rows, layer.weight, layer.weight_scale, bias,
                         block=(layer.block_n, layer.group_k))
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.spec.activations == "static":
            q = quantize_static(rows, layer.input_scale, self.qdtype)
            scale = layer.input_scale.expand(rows.shape[0], 1)
        else:
            group = layer.group_k if self.spec.activations == "group" else None
            q, scale = quantize_per_token(rows, self.qdtype, group)
        y = scaled_mm(q, scale, layer.weight, layer.weight_scale, layer.block_n, layer.group_k,
                      x.dtype, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def takes_seam(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """One row that takes the fp8 GEMV."""
        return x.numel() == x.shape[-1] and self.takes_gemv(x.reshape(1, -1))

    def apply_seam(self, layer: nn.Module, x: torch.Tensor | SeamNorm,
                   bias: torch.Tensor | None, add_to: torch.Tensor | None = None
                   ) -> torch.Tensor | ResidualSum:
        return fp8_gemv(x, layer.weight, layer.weight_scale, bias,
                        block=(layer.block_n, layer.group_k), add_to=add_to)

    def takes_gemv(self, rows: torch.Tensor) -> bool:
        """fp8 weights, a decode-sized step of 16-bit activations on CUDA (the CPU keeps
        the W8A8 twin that prefill takes)."""
        return (self.qdtype == FP8_DTYPE and rows.is_cuda and rows.shape[0] <= GEMV_MAX_ROWS
                and rows.dtype in (torch.float16, torch.bfloat16))
