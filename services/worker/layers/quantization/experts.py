"""How a FusedMoE layer holds its routed experts: stacked tensors [E, ...] in the model's
dtype, or fp8 (e4m3) with their scales for kernels/moe.py's fp8 grouped GEMMs.

Each parameter is made by `expert_parameter`, which tells FusedMoE's weight_loader how to
take one expert's checkpoint tensor: which of its dims holds the intermediate features
that tensor parallelism splits (and how many features one element covers: 128 for a block
scale), or that it is one scale per part (a per-tensor scale of gate, up or down).

fp8 formats, as W8A8Method reads them for dense layers:
- per tensor (compressed-tensors FP8, fp8 without blocks): one `weight_scale` per expert
  and part; gate's and up's each spread over their own rows of w13 after loading, which
  is exact (vLLM instead requantizes both to the larger scale). Static `input_scale`s
  become the largest over the experts and parts of each GEMM, which clips none of the
  one activation tensor that all experts share;
- per channel (FP8_DYNAMIC, and --quantization fp8 on unquantized weights): w13's
  [E, 2I, 1] and w2's [E, H, 1] scales, activations per token;
- 128 x 128 blocks (Hugging Face fp8, `weight_scale_inv`): activations per 1 x 128 group.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from common.quantization import QuantSpec
from kernels.moe import ExpertScales, fused_moe
from kernels.quant import FP8_DTYPE, quantize_per_token
from services.worker.layers.quantization.base import ceil_div

GATE_UP, DOWN = ("gate", "up"), ("down",)


def expert_parameter(layer: nn.Module, tensor: torch.Tensor, parts: tuple[str, ...], *,
                     split_dim: int | None, block: int = 1, per_part: bool = False
                     ) -> nn.Parameter:
    """A stacked parameter [E, ...] filled from each expert's checkpoint tensors of
    `parts`. split_dim: the dim of one expert's slice along which tensor parallelism
    splits the intermediate features (None: not split); block: features per element
    there; per_part: one element per part (a per-tensor scale)."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.parts, param.split_dim, param.block, param.per_part = parts, split_dim, block, per_part
    param.weight_loader = layer.weight_loader
    return param


class ExpertsMethod(abc.ABC):
    @abc.abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       intermediate: int, dtype: torch.dtype) -> None:
        """Register w13 [E, 2I, H], w2 [E, H, I] and any scales; intermediate is this
        rank's I."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Requantize or reshape once every checkpoint tensor is in."""

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, sum_slots: bool = True) -> torch.Tensor:
        """The experts' weighted sum for x [T, H] ([T, k, H] terms unsummed: fused_moe)."""


def stacked_weights(layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                    dtype: torch.dtype) -> None:
    layer.w13 = expert_parameter(
        layer, torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), GATE_UP,
        split_dim=0)
    layer.w2 = expert_parameter(
        layer, torch.empty(num_experts, hidden, intermediate, dtype=dtype), DOWN, split_dim=1)


class UnquantizedExperts(ExpertsMethod):
    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       intermediate: int, dtype: torch.dtype) -> None:
        stacked_weights(layer, num_experts, hidden, intermediate, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, sum_slots: bool = True) -> torch.Tensor:
        return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.experts_read,
                         sum_slots=sum_slots)


class Fp8Experts(ExpertsMethod):
    def __init__(self, spec: QuantSpec) -> None:
        if spec.weight_type != "fp8":
            raise ValueError(f"{spec.describe()}: mixture-of-experts layers take fp8 "
                             "weights only (fp8, compressed-tensors FP8 / FP8_DYNAMIC)")
        self.spec = spec

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       intermediate: int, dtype: torch.dtype) -> None:
        spec, e = self.spec, num_experts
        stacked_weights(layer, e, hidden, intermediate, dtype if spec.online else FP8_DTYPE)
        if spec.online:
            return
        if spec.weight_strategy == "block":
            block_n, block_k = spec.block
            if layer.tp_size > 1 and intermediate % block_n + intermediate % block_k:
                raise ValueError(f"FusedMoE: a rank's {intermediate} expert intermediate "
                                 f"features do not split into whole blocks of {block_n}x"
                                 f"{block_k}; use a smaller --tensor-parallel-size")
            layer.w13_weight_scale_inv = expert_parameter(
                layer, torch.empty(e, 2 * ceil_div(intermediate, block_n),
                                   ceil_div(hidden, block_k)), GATE_UP,
                split_dim=0, block=block_n)
            layer.w2_weight_scale_inv = expert_parameter(
                layer, torch.empty(e, ceil_div(hidden, block_n),
                                   ceil_div(intermediate, block_k)), DOWN,
                split_dim=1, block=block_k)
        elif spec.weight_strategy == "channel":
            layer.w13_weight_scale = expert_parameter(
                layer, torch.empty(e, 2 * intermediate, 1), GATE_UP, split_dim=0)
            layer.w2_weight_scale = expert_parameter(layer, torch.empty(e, hidden, 1), DOWN,
                                                     split_dim=None)
        else:
            layer.w13_weight_scale = expert_parameter(layer, torch.empty(e, 2), GATE_UP,
                                                      split_dim=None, per_part=True)
            layer.w2_weight_scale = expert_parameter(layer, torch.empty(e, 1), DOWN,
                                                     split_dim=None, per_part=True)
        if spec.activations == "static":
            layer.w13_input_scale = expert_parameter(layer, torch.empty(e, 2), GATE_UP,
                                                     split_dim=None, per_part=True)
            layer.w2_input_scale = expert_parameter(layer, torch.empty(e, 1), DOWN,
                                                    split_dim=None, per_part=True)

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        """The scales as ExpertScales takes them: per output channel or per block."""
        spec = self.spec
        block_n, group_k = 1, None
        if spec.online:  # per output channel, as activations are per token
            layer.w13, w13_scale = quantize_experts(layer.w13)
            layer.w2, w2_scale = quantize_experts(layer.w2)
        elif spec.weight_strategy == "tensor":
            rows = layer.w13.shape[1] // 2
            w13_scale = layer.w13_weight_scale.data.repeat_interleave(rows, dim=1)[..., None]
            w2_scale = layer.w2_weight_scale.data[:, :, None].expand(-1, layer.w2.shape[1], 1)
        elif spec.weight_strategy == "channel":
            w13_scale, w2_scale = layer.w13_weight_scale.data, layer.w2_weight_scale.data
        else:
            block_n, group_k = spec.block
            w13_scale, block_n = block_rows(layer.w13_weight_scale_inv.data,
                                            layer.w2.shape[2], block_n)
            w2_scale = layer.w2_weight_scale_inv.data
            if block_n == 1:  # w2's rows (H) take their block's scale too
                w2_scale = w2_scale.repeat_interleave(spec.block[0], 1)[:, :layer.w2.shape[1]]
        for name in ("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_inv",
                     "w2_weight_scale_inv"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.w13_scale = nn.Parameter(w13_scale.float().contiguous(), requires_grad=False)
        layer.w2_scale = nn.Parameter(w2_scale.float().contiguous(), requires_grad=False)
        layer.block_n, layer.group_k = block_n, group_k
        if spec.activations == "static":
            layer.w13_input_scale = nn.Parameter(layer.w13_input_scale.data.max().reshape(1),
                                                 requires_grad=False)
            layer.w2_input_scale = nn.Parameter(layer.w2_input_scale.data.max().reshape(1),
                                                requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, sum_slots: bool = True) -> torch.Tensor:
        inputs = (layer.w13_input_scale, layer.w2_input_scale) \
            if self.spec.activations == "static" else None
        scales = ExpertScales(layer.w13_scale, layer.w2_scale, layer.block_n, layer.group_k,
                              inputs)
        return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.experts_read,
                         scales, sum_slots)


def quantize_experts(w: nn.Parameter) -> tuple[nn.Parameter, torch.Tensor]:
    """[E, N, K] -> fp8 [E, N, K] and float32 scales [E, N, 1], one per output channel."""
    experts, rows, cols = w.shape
    q, scale = quantize_per_token(w.data.reshape(-1, cols), FP8_DTYPE)
    return (nn.Parameter(q.view(experts, rows, cols), requires_grad=False),
            scale.view(experts, rows, 1))


def block_rows(w13_blocks: torch.Tensor, intermediate: int, block_n: int
               ) -> tuple[torch.Tensor, int]:
    """w13's block scales stay blocks when gate's and up's rows are whole blocks; else
    (a tiny model's 32 rows) each part's rows take their block's scale (block_n 1)."""
    if intermediate % block_n == 0:
        return w13_blocks, block_n
    gate, up = w13_blocks.chunk(2, dim=1)
    return torch.cat([part.repeat_interleave(block_n, 1)[:, :intermediate]
                      for part in (gate, up)], dim=1), 1
