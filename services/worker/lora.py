"""LoRA adapters in the worker: every step mixes requests of several adapters and the base
model.

Each LoRA-wrapped projection keeps `max_loras` GPU slots of stacked A and B weights (rank
padded with zeros to --max-lora-rank), one pair per PEFT module it fuses (q/k/v, gate/up).
`LoRAManager` maps adapters to slots, least recently used first out, and keeps up to
--max-cpu-loras adapters loaded in host memory; a request names its adapter's path, so an
adapter is loaded on first use with nothing broadcast beforehand. Each step the manager
writes every token's slot (-1: the base model) into one static buffer that all layers read
on the device: a CUDA graph replays it like any other input, and slot weights are written
in place, in stream order after the steps still using the old ones.

Under tensor parallelism every rank makes the same calls in the same order, so slots and
the host cache agree across ranks with nothing exchanged; each rank reads the adapter's
files itself and keeps only its shards (see `LoRALinear`). A pipeline stage wraps only
the layers it holds and keeps only their adapters' weights; the other stages check and
keep the rest (layers/pipeline.py).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from common.config import EngineConfig
from common.lora import TARGET_MODULES, WEIGHTS_FILE, AdapterError, read_adapter_config
from common.messages import LoRARequest
from kernels.lora import lora_expand
from services.worker.layers.linear import OutputShard, RowParallelLinear, ShardId
from services.worker.layers.quantization import UnquantizedMethod
from services.worker.models.llama import MissingLayer

_WEIGHT_NAME = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
ModuleKey = tuple[int, str]  # (decoder layer, PEFT module name)


@dataclass(slots=True)
class LoRAAdapter:
    lora_int_id: int
    scaling: float
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]  # A [r, in], B [out, r]


@dataclass(slots=True)
class LoRABatch:
    """What every LoRA layer reads in a step, on the device, in buffers that never move."""
    token_slots: torch.Tensor  # [max tokens] int32: each token's slot, -1 for the base model
    scaling: torch.Tensor  # [max_loras] float32: each slot's adapter's scaling


class LoRALinear(nn.Module):
    """A projection plus each token's adapter on each of its output slices: the PEFT modules
    it fuses, by name, with their place in this rank's output. The slots' A rows are
    stacked below the base weight, in one tensor whose top the base layer keeps as its
    weight, so one matmul does the base projection and every slot's shrink
    (kernels/lora.py); a quantized base runs its own matmul and the shrink is a second.

    Under tensor parallelism the adapters split as the projection does, so that no step
    communicates more than the base model: a column-parallel projection keeps the whole A
    and its rows of each module's B, split as its own output is; a row-parallel one keeps
    its columns of A and the whole B and adds x_shard A_shard^T B^T to its partial sum
    before the all-reduce, whose sum over the ranks is x A^T B^T (scaled once)."""

    def __init__(self, base: nn.Module, slices: dict[str, OutputShard], batch: LoRABatch,
                 max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.base, self.slices, self.batch = base, slices, batch
        self.row_parallel = isinstance(base, RowParallelLinear)
        out_features, self.in_features = base.output_size, base.input_size
        # this rank's block of A's input columns (the whole A for a column-parallel layer)
        self.in_index = base.tp_rank if self.row_parallel else 0
        self.in_full = self.in_features * (base.tp_size if self.row_parallel else 1)
        # a quantized base multiplies its own way (fp8, int8, int4): the shrink is a
        # matmul of its own, in the model's dtype, beside it
        self.stacked = isinstance(base.method, UnquantizedMethod)
        device = base.bias.device if base.bias is not None else next(base.parameters()).device
        a_rows = len(slices) * max_loras * max_rank
        extended = torch.zeros((out_features if self.stacked else 0) + a_rows,
                               self.in_features, dtype=dtype, device=device)
        if self.stacked:
            extended[:out_features] = base.weight
            base.weight.data = extended[:out_features]  # shared: the base weight is a view
        # buffers, not parameters: the base weight is not counted twice
        self.register_buffer("weight", extended, persistent=False)
        self.register_buffer("lora_a", extended[len(extended) - a_rows:].view(
            len(slices), max_loras, max_rank, self.in_features), persistent=False)
        bias = base.bias if base.bias_in_matmul else None
        if bias is not None and self.stacked:
            bias = torch.cat([bias, extended.new_zeros(len(extended) - out_features)])
        self.register_buffer("bias", bias, persistent=False)
        self.lora_b = _zeros(extended, max_loras, out_features, max_rank)
        self.starts = tuple(shard.offset for shard in list(slices.values())[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul gives the base projection (a row-parallel rank's partial sum) and the
        shrink; the expand adds the delta before `finish` reduces over the ranks."""
        rows = x.reshape(-1, self.in_features)
        if self.stacked:
            y = F.linear(rows, self.weight, self.bias)
        else:
            y = torch.cat([self.base.method.apply(self.base, rows, self.bias),
                           F.linear(rows, self.weight)], dim=1)
        y = lora_expand(y, self.lora_b, self.batch.scaling,
                        self.batch.token_slots[:rows.shape[0]], self.starts)
        return self.base.finish(y.view(*x.shape[:-1], y.shape[-1]))

    def shard(self, name: str, a: torch.Tensor, b: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a module's whole A [r, in] and B [out, r], copied so that
        the whole ones can be freed."""
        out = self.slices[name]
        return (a.narrow(1, self.in_index * self.in_features, self.in_features).clone(),
                b.narrow(0, out.index * out.size, out.size).clone())

    def write_slot(self, slot: int, adapter: LoRAAdapter, layer: int) -> None:
        """Slot `slot` takes the adapter's weights (this rank's shards) of this layer's
        modules, zeros where it has none."""
        for i, (name, shard) in enumerate(self.slices.items()):
            a = self.lora_a[i, slot]
            b = self.lora_b[slot, shard.offset:shard.offset + shard.size]
            a.zero_()
            b.zero_()
            pair = adapter.weights.get((layer, name))
            if pair is not None:
                rank = pair[0].shape[0]
                a[:rank].copy_(pair[0])
                b[:, :rank].copy_(pair[1])

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each PEFT module's whole weight, as adapters store it."""
        return {name: (shard.full, self.in_full) for name, shard in self.slices.items()}


def _zeros(like: torch.Tensor, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=like.dtype, device=like.device),
                        requires_grad=False)


# each wrapped projection: PEFT module name -> the projection's shard id (None: the whole
# output of a layer that fuses nothing)
_WRAPPED = {("self_attn", "qkv_proj"): {"q_proj": "q", "k_proj": "k", "v_proj": "v"},
            ("self_attn", "o_proj"): {"o_proj": None},
            ("mlp", "gate_up_proj"): {"gate_proj": 0, "up_proj": 1},
            ("mlp", "down_proj"): {"down_proj": None}}


def _slices(base: nn.Module, shard_ids: dict[str, ShardId]) -> dict[str, OutputShard]:
    if isinstance(base, RowParallelLinear):  # its output is whole on every rank
        out = base.output_size
        return {name: OutputShard(0, out, 0, out) for name in shard_ids}
    shards = base.output_shards()
    return {name: shards[shard_id] for name, shard_id in shard_ids.items()}


def wrap_model(model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int,
               dtype: torch.dtype) -> dict[int, list[LoRALinear]]:
    """Replace the projections of every decoder layer this stage holds by LoRA-wrapped
    ones; returns each such layer's wrapped modules by its index in the model."""
    layers = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer, MissingLayer):
            continue
        modules = []
        for (block, attr), shard_ids in _WRAPPED.items():
            parent = getattr(layer, block)
            base = getattr(parent, attr)
            module = LoRALinear(base, _slices(base, shard_ids), batch, max_loras, max_rank,
                                dtype)
            setattr(parent, attr, module)
            modules.append(module)
        layers[i] = modules
    return layers


def load_adapter(lora: LoRARequest, max_rank: int, shapes: dict[ModuleKey, tuple[int, int]],
                 device: torch.device, dtype: torch.dtype, num_layers: int = 0
                 ) -> LoRAAdapter:
    """The adapter's weights, checked: known modules of existing layers, A and B in pairs
    at the model's shapes and the adapter's rank. `shapes` holds this stage's layers;
    the weights of the model's other layers (of `num_layers`) are another stage's."""
    config = read_adapter_config(lora.lora_path, max_rank)
    path = lora.lora_path
    found: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(f"{path}/{WEIGHTS_FILE}").items():
        match = _WEIGHT_NAME.search(name)
        if match is None or match[2] not in TARGET_MODULES:
            raise AdapterError(f"LoRA adapter {path}: weight {name!r} is not a LoRA A/B "
                               f"of {', '.join(TARGET_MODULES)}")
        key = (int(match[1]), match[2])
        num_layers = max(num_layers, 1 + max(k[0] for k in shapes))
        if key[0] >= num_layers:
            raise AdapterError(f"LoRA adapter {path}: {name!r} names layer {key[0]}, the "
                               f"model has {num_layers}")
        if key not in shapes:
            continue  # another stage's layer
        found.setdefault(key, {})[match[3]] = tensor
    weights = {key: _checked_pair(path, key, pair, shapes[key], config.rank)
               for key, pair in found.items()}
    return LoRAAdapter(lora.lora_int_id, config.scaling,
                       {key: (a.to(device, dtype), b.to(device, dtype))
                        for key, (a, b) in weights.items()})


def _checked_pair(path: str, key: ModuleKey, pair: dict[str, torch.Tensor],
                  shape: tuple[int, int], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"LoRA adapter {path}: layer {key[0]} {key[1]} has lora_"
                           f"{''.join(pair)} without its pair")
    a, b = pair["A"], pair["B"]
    (out, inp) = shape
    if a.shape != (rank, inp) or b.shape != (out, rank):
        raise AdapterError(f"LoRA adapter {path}: layer {key[0]} {key[1]} has A "
                           f"{tuple(a.shape)} and B {tuple(b.shape)}, the model needs "
                           f"{(rank, inp)} and {(out, rank)} (is it this model's adapter?)")
    return a, b


class LoRAManager:
    """Slots on the device, adapters in host memory, and each step's token slots."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_tokens: int) -> None:
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.cpu_loras
        self.dtype = dtype
        self.batch = LoRABatch(
            token_slots=torch.full((max_tokens,), -1, dtype=torch.int32, device=device),
            scaling=torch.zeros(self.max_loras, dtype=torch.float32, device=device))
        self.layers = wrap_model(model, self.batch, self.max_loras, self.max_rank, dtype)
        self.num_layers = len(model.model.layers)
        self.modules = {(i, name): module for i, modules in self.layers.items()
                        for module in modules for name in module.slices}
        self.shapes = {key: module.shapes()[key[1]] for key, module in self.modules.items()}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host copies, LRU first

    def prepare(self, loras: Sequence[LoRARequest | None], num_scheduled: np.ndarray) -> None:
        """Put this step's adapters in slots and write each token's slot. The scheduler
        plans at most max_loras distinct adapters a step."""
        needed = {lora.lora_int_id for lora in loras if lora is not None}
        assert len(needed) <= self.max_loras, "the scheduler bounds adapters per step"
        slots = np.asarray([-1 if lora is None else self._slot(lora, needed)
                            for lora in loras], dtype=np.int32)
        token_slots = np.repeat(slots, num_scheduled)
        buffer = self.batch.token_slots
        buffer[:len(token_slots)].copy_(torch.from_numpy(token_slots), non_blocking=True)
        buffer[len(token_slots):].fill_(-1)  # rows a CUDA graph pads the batch with

    def _slot(self, lora: LoRARequest, needed: set[int]) -> int:
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora.lora_int_id)
            return slot
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used adapter that this step does not need
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        adapter = self._adapter(lora)
        for i, modules in self.layers.items():
            for module in modules:
                module.write_slot(slot, adapter, i)
        self.batch.scaling[slot] = adapter.scaling
        self.slot_of[lora.lora_int_id] = slot
        return slot

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self.loaded.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_adapter(lora, self.max_rank, self.shapes, torch.device("cpu"),
                                   self.dtype, self.num_layers)
            # the host cache keeps only this rank's shards
            adapter.weights = {key: self.modules[key].shard(key[1], a, b)
                               for key, (a, b) in adapter.weights.items()}
            self.loaded[lora.lora_int_id] = adapter
            if len(self.loaded) > self.max_cpu_loras:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(lora.lora_int_id)
        return adapter
