"""GGUF files kept quantized: the reader that yields a file's tensors under Hugging Face
names, and the "gguf" quant method whose linear layers keep Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K
blocks on the device and multiply through kernels/gguf.py.

Reading: each GGUF tensor of a kept type arrives as a QuantizedCheckpoint, its rows of
raw blocks read only when a loader narrows it (a tensor-parallel rank reads its own rows).
llama.cpp's converter permutes the rows of a Llama q/k projection (it interleaves each
head's two RoPE halves); transformers' GGUF loader permutes them back, and so does this
one, on whole rows, which rows of independent blocks allow. Every other tensor (norms,
embeddings, types not kept quantized) arrives dequantized to float32 by the `gguf`
package, as the converted checkpoint had it.

A fused layer's parts (q/k/v, gate/up) may come in different types (Q4_K_M files keep
some v and down projections in Q6_K), so each part is held on its own until every one has
loaded; parts of one type are then stacked into one weight and one matmul.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.gguf import GGUFType, bytes_per_row, gguf_linear, gguf_type, layout
from services.worker.layers.checkpoint import CheckpointSlice
from services.worker.layers.quantization.base import QuantMethod, quant_parameter

# GGUF tensor name (without the block prefix) -> Hugging Face module, for the Llama
# family; gguf-py's TensorNameMap maps the other way (tests check the two agree)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
ARCHITECTURES = ("llama", "qwen2", "qwen3")
PERMUTED_ARCHITECTURES = ("llama",)  # whose q/k rows llama.cpp's converter permutes
IGNORED_TENSORS = ("rope_freqs.weight",)  # llama.cpp's own RoPE factors (from config)
# modules whose weights stay quantized: the linear layers of the quant method
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")


# --- reading ----------------------------------------------------------------------------

class QuantizedCheckpoint(CheckpointSlice):
    """A GGUF tensor of raw blocks, uint8 [rows, bytes per row], rows in Hugging Face order
    (`order`: the file's row for each, None when unpermuted); read as a loader narrows it."""

    def __init__(self, data: np.ndarray, qtype: int, cols: int,
                 order: np.ndarray | None = None) -> None:
        self.data, self.qtype, self.cols, self.order = data, gguf_type(qtype), cols, order
        self.shape = torch.Size(data.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = slice(start, start + length) if dim == 0 else slice(None)
        cols = slice(start, start + length) if dim == 1 else slice(None)
        picked = self.data[rows if self.order is None else self.order[rows]]
        return torch.from_numpy(np.array(picked[:, cols]))  # a copy: the map is read-only

    def read(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


@dataclass(frozen=True, slots=True)
class GGUFHeads:
    """The head counts the q/k row permutation needs."""
    num_heads: int
    num_kv_heads: int


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    module, _, suffix = gguf_name.rpartition(".")
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{suffix}"
    if module in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[module]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name; supported: "
                     f"{', '.join(GLOBAL_NAMES)} and blk.N.{{{', '.join(BLOCK_NAMES)}}}")


def unpermute_order(rows: int, heads: int) -> np.ndarray:
    """The file's row for each Hugging Face row of a q/k projection: llama.cpp stores each
    head's rows as (half, pair) interleaved, Hugging Face as (pair, half) halves."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def field_value(reader: gguf.GGUFReader, key: str):
    if key not in reader.fields:
        raise ValueError(f"GGUF file lacks the metadata key {key!r}")
    return reader.fields[key].contents()


def read_heads(reader: gguf.GGUFReader, arch: str) -> GGUFHeads:
    heads = int(field_value(reader, f"{arch}.attention.head_count"))
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = int(field_value(reader, kv_key)) if kv_key in reader.fields else heads
    return GGUFHeads(heads, kv_heads)


def row_order(name: str, rows: int, heads: GGUFHeads | None) -> np.ndarray | None:
    """The unpermuting order of a q/k weight's rows (or bias), as transformers applies it."""
    if heads is None:
        return None
    if ".attn_q." in name:
        return unpermute_order(rows, heads.num_heads)
    if ".attn_k." in name:
        return unpermute_order(rows, heads.num_kv_heads)
    return None


def keeps_quantized(name: str, qtype: int) -> bool:
    module = name.rpartition(".")[0].rpartition(".")[2]
    return (name.endswith(".weight") and module in QUANTIZED_MODULES
            and int(qtype) in set(GGUFType))


def read_tensor(tensor, name: str, heads: GGUFHeads | None
                ) -> torch.Tensor | QuantizedCheckpoint:
    order = row_order(tensor.name, int(tensor.data.shape[0]), heads)
    if keeps_quantized(name, tensor.tensor_type):
        return QuantizedCheckpoint(tensor.data, tensor.tensor_type, int(tensor.shape[0]), order)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if order is not None:
        values = values[order]
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the map is read-only


def iter_gguf(path: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedCheckpoint]]:
    """(Hugging Face name, tensor) for each tensor of a GGUF file: linear weights of the
    kept types as QuantizedCheckpoint, the rest float32."""
    reader = gguf.GGUFReader(path)
    arch = str(field_value(reader, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not read quantized; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    heads = read_heads(reader, arch) if arch in PERMUTED_ARCHITECTURES else None
    for tensor in reader.tensors:
        if tensor.name in IGNORED_TENSORS:
            continue
        name = hf_name(tensor.name)
        yield name, read_tensor(tensor, name, heads)


# --- the quant method -------------------------------------------------------------------

@dataclass(slots=True)
class GGUFPart:
    """Rows of a layer's weight: raw blocks of `qtype`, or float values (qtype None: a
    tensor the file stores unquantized, or in a type not kept quantized)."""
    qtype: int | None
    weight: torch.Tensor


SHARD_ORDER = ("q", "k", "v")  # a QKV layer's shard ids, in output_sizes' order


def part_index(shard_id) -> int:
    if shard_id is None:
        return 0
    return SHARD_ORDER.index(shard_id) if shard_id in SHARD_ORDER else int(shard_id)


class GGUFMethod(QuantMethod):
    """Quant method "gguf": a layer's weight as GGUF blocks, [out, bytes per row] uint8 per
    part, rows split across tensor-parallel ranks whole (output_dim 0); an input split
    (row-parallel) must fall on block boundaries."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        """`weight` is a placeholder [out, 0] whose loader takes each part's checkpoint
        tensor (its type and so its row size known only then) into layer.gguf_parts."""
        layer.gguf_input_size, layer.gguf_output_sizes = input_size, list(output_sizes)
        layer.gguf_dtype = dtype
        layer.gguf_parts = [None] * len(output_sizes)
        placeholder = torch.empty(sum(output_sizes), 0, dtype=torch.uint8)
        layer.weight = quant_parameter(placeholder, output_dim=0, input_dim=1,
                                       loader=lambda param, loaded, shard_id=None:
                                       self.load_weight(layer, param, loaded, shard_id))

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded,
                    shard_id=None) -> None:
        """The layer's own loader shards `loaded` into a buffer of this rank's rows sized
        for its type; each part it filled is kept as that buffer's rows."""
        input_size, sizes = layer.gguf_input_size, layer.gguf_output_sizes
        if isinstance(loaded, QuantizedCheckpoint):
            qtype = loaded.qtype
            check_input_split(loaded, input_size)
            buffer = torch.empty(sum(sizes), bytes_per_row(qtype, input_size),
                                 dtype=torch.uint8, device=param.device)
        else:
            qtype = None
            buffer = torch.empty(sum(sizes), input_size, dtype=layer.gguf_dtype,
                                 device=param.device)
        staging = quant_parameter(buffer, output_dim=0, input_dim=1,
                                  loader=layer.weight_loader)
        layer.weight_loader(staging, loaded, shard_id)
        filled = range(len(sizes)) if shard_id is None else [part_index(shard_id)]
        for i in filled:
            start = sum(sizes[:i])
            layer.gguf_parts[i] = GGUFPart(qtype, buffer[start:start + sizes[i]].clone())

    def process_after_loading(self, layer: nn.Module) -> None:
        """Adjacent parts of one type stacked into one weight (one matmul), registered as
        the layer's parameters: `weight` (all of it when the parts share a type: uint8
        [out, bytes per row]), then `weight_part1`..."""
        missing = [i for i, part in enumerate(layer.gguf_parts) if part is None]
        if missing:
            raise ValueError(f"GGUF layer {type(layer).__name__}: parts {missing} of its "
                             "weight were never loaded")
        merged: list[GGUFPart] = []
        for part in layer.gguf_parts:
            if merged and merged[-1].qtype == part.qtype:
                merged[-1] = GGUFPart(part.qtype, torch.cat([merged[-1].weight, part.weight]))
            else:
                merged.append(part)
        for i, part in enumerate(merged):
            name = "weight" if i == 0 else f"weight_part{i}"
            setattr(layer, name, quant_parameter(part.weight, output_dim=0, input_dim=1,
                                                 loader=layer.weight_loader))
        layer.gguf_parts = merged

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        outputs = [part_linear(x, part, layer.gguf_input_size) for part in layer.gguf_parts]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y if bias is None else y + bias


def part_linear(x: torch.Tensor, part: GGUFPart, cols: int) -> torch.Tensor:
    if part.qtype is None:
        return F.linear(x, part.weight)
    return gguf_linear(x, part.weight, part.qtype, cols)


def check_input_split(loaded: QuantizedCheckpoint, input_size: int) -> None:
    """A row-parallel rank takes input_size of the loaded.cols columns: whole blocks only."""
    block = layout(loaded.qtype).values
    if loaded.cols != input_size and input_size % block:
        raise ValueError(f"a {loaded.qtype.name} weight of {loaded.cols} input features "
                         f"splits across tensor-parallel ranks only at its {block}-value "
                         f"block boundaries, not into {input_size} per rank; use a "
                         "tensor-parallel size that divides its blocks")
