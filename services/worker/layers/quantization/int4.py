"""INT4 weight-only checkpoints (W4A16): AWQ, GPTQ (v1 and v2 zeros, with and without
act-order) and compressed-tensors' pack-quantized W4A16 scheme.

Each method registers the checkpoint's own tensors at this rank's sizes, converts them once
after loading to the one layout kernels/int4.py reads (its docstring says which and why),
and multiplies with kernels.int4.w4a16_gemm. On disk (K input, N output features, group g):

- AWQ (GEMM version): qweight int32 [K, N/8], packed along N with nibble i holding column
  AWQ_PACK_ORDER[i] of its eight; qzeros int32 [K/g, N/8] the same way; scales [K/g, N].
  W[n, k] = (q - z) * s.
- GPTQ: qweight int32 [K/8, N] packed along K, nibble j = row 8r + j; qzeros int32
  [K/g, N/8] packed along N in order; scales [K/g, N]; g_idx int32 [K], each input
  feature's group (not k // g under act-order). The v1 format ("gptq") stores zero - 1,
  v2 ("gptq_v2") the zero itself.
- compressed-tensors pack-quantized: weight_packed int32 [N, K/8] packed along K in order,
  values offset by 8 (signed -8..7 stored as 0..15); weight_scale [N, K/g];
  weight_zero_point int32 [N/8, K/g] packed along N, offset by 8 (asymmetric only; a
  symmetric zero is 0, stored 8); weight_shape [2]; weight_g_idx [K] under actorder "group".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from common.quantization import QuantSpec
from kernels.int4 import PACK_FACTOR, SYMMETRIC_ZERO, pack_int4, unpack_int4, w4a16_gemm
from services.worker.layers.quantization.base import QuantMethod, quant_parameter

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column ORDER[i]
SEQUENTIAL_ORDER = tuple(range(PACK_FACTOR))


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """The canonical layout (kernels/int4.py): qweight int32 [N, K/8], scales [N, K/g],
    zeros uint8 [N, K/g], perm [K] int32 or None."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None


# --- unpacking and conversion ----------------------------------------------------------------

def unpack_int4_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] packed along columns -> uint8 [R, 8C]: nibble i of word [r, c] is
    column 8c + order[i]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] by nibble
    columns = torch.empty_like(nibbles)
    columns[..., list(order)] = nibbles
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def sort_groups(g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    """The permutation that makes each group's input features contiguous (act-order), or
    None when they already are (g_idx = k // g, or absent)."""
    if g_idx is None:
        return None
    in_order = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), in_order):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], in_order):
        raise ValueError(f"g_idx does not give each group of this rank's input features "
                         f"exactly {group_size} of them; act-order with the input features "
                         "split over ranks is not supported")
    return perm.to(torch.int32)


def to_int4_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, group_size: int) -> Int4Weight:
    """q uint8 [K, N] in checkpoint order, zeros [K/g, N], scales [K/g, N] by group."""
    perm = sort_groups(g_idx, group_size)
    if perm is not None:
        q = q[perm.long()]
    return Int4Weight(pack_int4(q.T.contiguous()), scales.T.contiguous(),
                      zeros.T.to(torch.uint8).contiguous(), perm)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> Int4Weight:
    q = unpack_int4_columns(qweight, AWQ_PACK_ORDER)
    zeros = unpack_int4_columns(qzeros, AWQ_PACK_ORDER)
    return to_int4_weight(q, zeros, scales, None, group_size)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, group_size: int, v1_zeros: bool) -> Int4Weight:
    """g_idx: each of these input features' group among these scales' groups.
    v1_zeros: the checkpoint stores zero - 1 (format "gptq"), so a stored 15 is a zero
    of 16, as vLLM's and transformers' GPTQ kernels read it."""
    zeros = unpack_int4_columns(qzeros, SEQUENTIAL_ORDER).to(torch.int32) + int(v1_zeros)
    return to_int4_weight(unpack_int4(qweight.T).T, zeros, scales, g_idx, group_size)


def compressed_tensors_to_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                               weight_zero_point: torch.Tensor | None,
                               g_idx: torch.Tensor | None, group_size: int) -> Int4Weight:
    q = unpack_int4_columns(weight_packed, SEQUENTIAL_ORDER).T  # [K, N], offset by 8
    if weight_zero_point is None:
        zeros = torch.full(weight_scale.T.shape, SYMMETRIC_ZERO, dtype=torch.uint8,
                           device=weight_scale.device)
    else:
        zeros = unpack_int4(weight_zero_point.T)
    return to_int4_weight(q, zeros, weight_scale.T, g_idx, group_size)


# --- parameters ------------------------------------------------------------------------------

def check_sizes(method: str, input_size: int, output_sizes: list[int],
                group_size: int) -> None:
    if input_size % group_size or group_size % PACK_FACTOR:
        raise ValueError(f"{method}: {input_size} input features per rank do not split into "
                         f"groups of {group_size} (a multiple of {PACK_FACTOR} is needed); "
                         "use fewer tensor-parallel ranks")
    if any(size % PACK_FACTOR for size in output_sizes):
        raise ValueError(f"{method}: output sizes per rank {output_sizes} must be multiples "
                         f"of {PACK_FACTOR} (int4 packed in int32)")


def replace_parameters(layer: nn.Module, stale: tuple[str, ...], weight: Int4Weight) -> None:
    """The checkpoint's tensors give way to the canonical ones. qweight counts its eight
    values a word (pack_factor) where the benchmarks count the weights. Zeros that are all
    SYMMETRIC_ZERO (a symmetric scheme, whatever the format stored) become None, which the
    kernels multiply without loading any."""
    for name in stale:
        if hasattr(layer, name):
            delattr(layer, name)
    for name in ("qweight", "scales"):
        setattr(layer, name, nn.Parameter(getattr(weight, name), requires_grad=False))
    symmetric = bool((weight.zeros == SYMMETRIC_ZERO).all())
    layer.zeros = None if symmetric else nn.Parameter(weight.zeros, requires_grad=False)
    layer.qweight.pack_factor = PACK_FACTOR
    layer.perm = None if weight.perm is None else nn.Parameter(weight.perm,
                                                               requires_grad=False)


def load_shared(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                shard_id=None) -> None:
    """A g_idx: each fused part's checkpoint (q, k, v; gate, up) holds one for the input
    the parts share, and the one fused matmul needs them all equal."""
    first = param.data.clone() if param.parts_loaded else None
    layer.weight_loader(param, loaded, shard_id)
    if first is not None and not torch.equal(first, param.data):
        raise ValueError(f"{type(layer).__name__}[{shard_id}]: its g_idx differs from the "
                         "other fused parts'; one fused layer needs the same act-order "
                         "grouping in each")
    param.parts_loaded += 1


def optional(layer: nn.Module, name: str) -> torch.Tensor | None:
    param = getattr(layer, name, None)
    return None if param is None else param.data


# --- methods ---------------------------------------------------------------------------------

class Int4Method(QuantMethod):
    """What every INT4 method shares: the settings, the checks, the group index and the
    multiply over the canonical layout. Subclasses register the checkpoint's tensors and
    convert them."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.name = spec.method

    def group(self, input_size: int) -> int:
        """The group size at this rank's input size (-1: one group over all of them)."""
        return input_size if self.spec.group_size == -1 else self.spec.group_size

    def check_layer(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> int:
        """This rank's group size, once its sizes are known to pack and group."""
        if self.spec.act_order and layer.input_split and layer.tp_size > 1:
            raise ValueError(f"{self.name}: act-order checkpoints (g_idx) with the input "
                             f"features of {type(layer).__name__} split over tensor-parallel "
                             "ranks are not supported; use --tensor-parallel-size 1")
        group_size = self.group(input_size)
        check_sizes(self.name, input_size, output_sizes, group_size)
        return group_size

    def groups_dim(self, dim: int) -> int | None:
        """A per-channel scale (group -1) covers every input feature of every rank: whole
        on each rank rather than split along the input."""
        return None if self.spec.group_size == -1 else dim

    def group_index(self, layer: nn.Module, input_size: int) -> nn.Parameter:
        """g_idx [input_size]: each input feature's group, whole on a column-parallel
        layer, this rank's features of a row-parallel one. It starts in order, which
        --load-format dummy keeps (drawn values would group nothing)."""
        groups = input_size // self.group(input_size)
        in_order = torch.arange(input_size, dtype=torch.int32) // self.group(input_size)
        param = quant_parameter(in_order + self.first_group(layer, groups), output_dim=None,
                                input_dim=0, loader=functools.partial(load_shared, layer))
        param.keep_for_dummy, param.parts_loaded = True, 0
        return param

    def first_group(self, layer: nn.Module, groups: int) -> int:
        """The checkpoint's g_idx numbers every group of the layer: a row-parallel rank's
        `groups` groups start at tp_rank * groups (act-order there is refused); a
        per-channel scale is one group on every rank."""
        if not layer.input_split or self.spec.group_size == -1:
            return 0
        return layer.tp_rank * groups

    def rank_groups(self, layer: nn.Module, g_idx: torch.Tensor) -> torch.Tensor:
        """g_idx numbering this rank's groups from 0."""
        groups = g_idx.numel() // self.group(g_idx.numel())
        return g_idx - self.first_group(layer, groups)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(layer, x, bias, summed=True)

    def apply_unsummed(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The one-row GEMV splits o's and down's K in two at 8B shapes: the next norm adds
        the halves (64 launches a step fewer)."""
        return self.matmul(layer, x, None, summed=False)

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
               summed: bool) -> torch.Tensor:
        group_size = layer.qweight.shape[1] * PACK_FACTOR // layer.scales.shape[1]
        return w4a16_gemm(x, layer.qweight, layer.scales, layer.zeros, group_size,
                          layer.perm, bias, summed)


class AWQMethod(Int4Method):
    """AutoAWQ's GEMM checkpoints: qweight, qzeros and scales."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        g = self.check_layer(layer, input_size, output_sizes)
        n, groups, loader = sum(output_sizes), input_size // g, layer.weight_loader
        gdim = self.groups_dim(0)
        packed = dict(output_dim=1, pack_dim=1, pack_factor=PACK_FACTOR, loader=loader)
        layer.qweight = quant_parameter(
            torch.empty(input_size, n // PACK_FACTOR, dtype=torch.int32), input_dim=0,
            **packed)
        layer.qzeros = quant_parameter(
            torch.empty(groups, n // PACK_FACTOR, dtype=torch.int32), input_dim=gdim,
            **packed)
        layer.scales = quant_parameter(torch.empty(groups, n, dtype=dtype), output_dim=1,
                                       input_dim=gdim, loader=loader)

    def process_after_loading(self, layer: nn.Module) -> None:
        weight = awq_to_int4(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                             self.group(layer.qweight.shape[0]))
        replace_parameters(layer, ("qweight", "qzeros", "scales"), weight)


class GPTQMethod(Int4Method):
    """GPTQ checkpoints (v1 or v2 zeros): qweight, qzeros, scales and g_idx."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        g = self.check_layer(layer, input_size, output_sizes)
        n, groups, loader = sum(output_sizes), input_size // g, layer.weight_loader
        gdim = self.groups_dim(0)
        layer.qweight = quant_parameter(
            torch.empty(input_size // PACK_FACTOR, n, dtype=torch.int32), output_dim=1,
            input_dim=0, pack_dim=0, pack_factor=PACK_FACTOR, loader=loader)
        layer.qzeros = quant_parameter(
            torch.empty(groups, n // PACK_FACTOR, dtype=torch.int32), output_dim=1,
            input_dim=gdim, pack_dim=1, pack_factor=PACK_FACTOR, loader=loader)
        layer.scales = quant_parameter(torch.empty(groups, n, dtype=dtype), output_dim=1,
                                       input_dim=gdim, loader=loader)
        layer.g_idx = self.group_index(layer, input_size)

    def process_after_loading(self, layer: nn.Module) -> None:
        input_size = layer.qweight.shape[0] * PACK_FACTOR
        weight = gptq_to_int4(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                              self.rank_groups(layer, layer.g_idx.data),
                              self.group(input_size), self.spec.stored_zero_offset == 1)
        replace_parameters(layer, ("qweight", "qzeros", "scales", "g_idx"), weight)


class CompressedTensorsW4A16(Int4Method):
    """compressed-tensors' pack-quantized scheme with 4-bit integer weights and no
    activation quantization, per group or per channel: weight_packed, weight_scale,
    weight_shape, weight_zero_point (asymmetric), weight_g_idx (actorder "group")."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        g = self.check_layer(layer, input_size, output_sizes)
        n, groups, loader = sum(output_sizes), input_size // g, layer.weight_loader
        gdim = self.groups_dim(1)
        layer.weight_packed = quant_parameter(
            torch.empty(n, input_size // PACK_FACTOR, dtype=torch.int32), output_dim=0,
            input_dim=1, pack_dim=1, pack_factor=PACK_FACTOR, loader=loader)
        layer.weight_scale = quant_parameter(torch.empty(n, groups, dtype=dtype), output_dim=0,
                                             input_dim=gdim, loader=loader)
        # each part's [rows, input features]; the parameters' shapes already say it
        layer.weight_shape = quant_parameter(torch.empty(2, dtype=torch.int64),
                                             output_dim=None, input_dim=None, loader=loader)
        if self.spec.zero_points:
            layer.weight_zero_point = quant_parameter(
                torch.empty(n // PACK_FACTOR, groups, dtype=torch.int32), output_dim=0,
                input_dim=gdim, pack_dim=0, pack_factor=PACK_FACTOR, loader=loader)
        if self.spec.act_order:
            layer.weight_g_idx = self.group_index(layer, input_size)

    def process_after_loading(self, layer: nn.Module) -> None:
        input_size = layer.weight_packed.shape[1] * PACK_FACTOR
        g_idx = optional(layer, "weight_g_idx")
        weight = compressed_tensors_to_int4(
            layer.weight_packed.data, layer.weight_scale.data,
            optional(layer, "weight_zero_point"),
            None if g_idx is None else self.rank_groups(layer, g_idx), self.group(input_size))
        replace_parameters(layer, ("weight_packed", "weight_scale", "weight_zero_point",
                                   "weight_shape", "weight_g_idx"), weight)


# quant_method of a QuantSpec with int4 weights -> its method
INT4_METHODS: dict[str, type[Int4Method]] = {
    "awq": AWQMethod, "gptq": GPTQMethod, "compressed-tensors": CompressedTensorsW4A16}
