"""Building a model on its device and filling its weights: from a Hugging Face directory's
*.safetensors (of a GGUF file, its float32 conversion, see common/model_files), from a
GGUF file's own blocks (the gguf quant method), or random at the real shapes
(`load_format="dummy"`). Either way each parameter's own weight_loader takes its
tensor-parallel shard: from a safetensors or GGUF file a rank reads only those rows, and
dummy weights are drawn whole, so every tensor-parallel size holds the same model. A
pipeline stage skips the tensors of the layers other stages hold (CausalLM.stage_name)."""

from __future__ import annotations

import contextlib
import logging
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from common.config import EngineConfig
from common.model_files import gguf_to_hf_dir, resolve_model
from common.quantization import GGUF_FILE_ATTR, gguf_default, quant_spec
from services.worker.layers.checkpoint import CheckpointSlice, read_whole
from services.worker.layers.linear import Checkpoint, LinearBase
from services.worker.layers.moe import FusedMoE
from services.worker.layers.norm import RMSNorm
from services.worker.layers.quantization import (GGUFMethod, QuantMethod, building_with,
                                                 quant_method_for)
from services.worker.layers.quantization.gguf import iter_gguf
from services.worker.models import CausalLM, model_class

# a fused parameter's part (q/k/v, gate/up), or an expert's (expert, part)
ShardId = str | int | tuple[int, str] | None
DUMMY_STD = 0.02
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
log = logging.getLogger("headrace.worker.loader")


def load_model(config: EngineConfig, hf_config, device: torch.device, dtype: torch.dtype,
               model_dir: str | os.PathLike | None = None) -> CausalLM:
    """The model of `hf_config` on `device` in `dtype`, with its weights. `model_dir` is the
    resolved model directory; without it `config.model` is resolved here."""
    cls = model_class(hf_config)
    quantization = gguf_default(hf_config, config.quantization, device.type == "cuda",
                                config.load_format)
    method = quant_method_for(hf_config, quantization)
    with default_dtype(dtype), torch.device(device), building_with(method):
        model = cls(hf_config)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, checkpoint_tensors(config, hf_config, model_dir, method))
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedMoE)):
            module.method.process_after_loading(module)
    log.info("%s weights: %s, %.3f GiB", cls.__name__, describe(hf_config, quantization),
             weight_bytes(model) / 2 ** 30)
    return model.eval()


def checkpoint_tensors(config: EngineConfig, hf_config, model_dir: str | os.PathLike | None,
                       method: QuantMethod) -> Iterator[tuple[str, Checkpoint]]:
    """The checkpoint's tensors: a GGUF file's own (its blocks) for the gguf method, else
    the directory's *.safetensors (of a GGUF file, its float32 conversion, written by the
    first worker that needs it)."""
    gguf_file = getattr(hf_config, GGUF_FILE_ATTR, None)
    if isinstance(method, GGUFMethod):
        return iter_gguf(gguf_file)
    if gguf_file:
        return iter_safetensors(gguf_to_hf_dir(Path(gguf_file)), config.use_tqdm_on_load)
    directory = Path(model_dir) if model_dir is not None else resolve_model(
        config.model, config.load_format)
    return iter_safetensors(directory, config.use_tqdm_on_load)


def describe(hf_config, quantization: str | None) -> str:
    spec = quant_spec(hf_config, quantization)
    return "unquantized" if spec is None else spec.describe()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter (quantized weights and their scales included)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Normal(0, 0.02) everywhere except RMSNorm weights, which scale by 1 (a weight of 1,
    or 0 under Gemma's 1 + w): activations stay finite at any depth; and index tensors
    (int4's g_idx), which keep the in-order values their method built. Each checkpoint
    tensor is drawn whole on the parameters' device, from a generator seeded by its name,
    and handed to its weight_loader like a loaded one."""
    norm_weights = {id(m.weight): 0.0 if m.gemma else 1.0
                    for m in model.modules() if isinstance(m, RMSNorm)}
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
            continue
        if getattr(param, "keep_for_dummy", False):  # an index (int4's g_idx): as built
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        for shard_id, shape in module.checkpoint_shapes(param).items():
            key = f"{model.checkpoint_name(name)}[{shard_id}]".encode()
            generator = torch.Generator(param.device).manual_seed(seed ^ zlib.crc32(key))
            # fp8 and integer tensors have no normal_: drawn in float32, cast on copy
            draw = param.dtype if param.element_size() > 1 and param.is_floating_point() \
                else torch.float32
            full = torch.empty(shape, dtype=draw, device=param.device)
            param.weight_loader(param, full.normal_(0.0, DUMMY_STD, generator=generator),
                                shard_id)


def iter_safetensors(directory: Path, progress: bool = True
                     ) -> Iterator[tuple[str, CheckpointSlice]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}; use "
                                "--load-format dummy for random weights")
    counts = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            counts.append(len(f.keys()))
    with tqdm(total=sum(counts), desc="Loading weights", unit="tensor",
              disable=not progress) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, CheckpointSlice(f.get_slice(name))
                    bar.update()


@torch.no_grad()
def load_weights(model: CausalLM,
                 weights: Iterable[tuple[str, torch.Tensor | CheckpointSlice]]) -> None:
    """Routes each checkpoint tensor to its parameter's weight_loader (q/k/v and gate/up
    into their fused parameters) and checks that every parameter got all its shards."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    loaded: set[tuple[str, ShardId]] = set()
    for name, tensor in weights:
        name = model.checkpoint_name(name)
        if name.endswith(IGNORED_SUFFIXES) or (
                model.tie_word_embeddings and name == "lm_head.weight"):
            continue
        name = model.stage_name(name)
        if name is None:  # another pipeline stage's
            continue
        if name.endswith(KV_SCALE_SUFFIXES):
            load_kv_scale(buffers, name, tensor)
            continue
        target, shard_id = route(name, model)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                             f"{type(model).__name__}; is config.json the checkpoint's?")
        param = params[target]
        param.weight_loader(param, tensor, shard_id)
        loaded |= {(target, shard) for shard in covered_shards(model, target, param, shard_id)}
    missing = sorted(f"{name}[{shard}]" if shard is not None else name
                     for name, shard in expected_shards(model, params) - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights of "
                         f"{type(model).__name__}, e.g. {', '.join(missing[:5])}")


def load_kv_scale(buffers: dict[str, torch.Tensor], name: str,
                  tensor: torch.Tensor | CheckpointSlice) -> None:
    """An fp8 checkpoint's per-tensor KV cache scale (vLLM and llm-compressor write
    self_attn.k_scale or self_attn.attn.k_scale) into its Attention's buffer. Every
    tensor-parallel rank takes the whole scale: it covers all heads."""
    target = name if ".attn." in name else name.replace(".self_attn.", ".self_attn.attn.")
    if target not in buffers:
        raise ValueError(f"checkpoint tensor {name!r} has no KV cache scale to load into")
    buffers[target].copy_(read_whole(tensor).float().reshape(1))


def route(name: str, model: CausalLM) -> tuple[str, ShardId]:
    """Checkpoint name -> (our parameter name, shard id). An expert's tensor
    (`...experts.{e}.<module>.weight`) goes to its stacked parameter with shard id
    (e, part), before packed_modules sees a module name that dense MLPs share; its
    scales (`.weight_scale`, `.weight_scale_inv`, `.input_scale`) to the stacked scale of
    that name (`w13_weight_scale`)."""
    parts = [model.module_renames.get(part, part) for part in name.split(".")]
    for i, part in enumerate(parts):
        if (part == "experts" and len(parts) > i + 3 and parts[i + 1].isdigit()
                and parts[i + 2] in model.expert_weights):
            stacked, which = model.expert_weights[parts[i + 2]]
            tensor = ".".join(parts[i + 3:])
            target = stacked if tensor == "weight" else f"{stacked}_{tensor}"
            return ".".join(parts[:i + 1] + [target]), (int(parts[i + 1]), which)
        if part in model.packed_modules:
            fused, shard_id = model.packed_modules[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard_id
    return ".".join(parts), None


def covered_shards(model: CausalLM, target: str, param: torch.nn.Parameter,
                   shard_id: ShardId) -> list[ShardId]:
    """The shard ids one checkpoint tensor filled: its own, or, for a fused layer's whole
    tensor (Phi-3's qkv_proj, loaded with no shard id), every shard of the layer."""
    if shard_id is not None:
        return [shard_id]
    return list(model.get_submodule(target.rpartition(".")[0]).checkpoint_shapes(param))


def expected_shards(model: CausalLM, params: dict[str, torch.nn.Parameter]
                    ) -> set[tuple[str, ShardId]]:
    """Every (parameter, shard id) a checkpoint must fill: the shard ids its module takes,
    as init_dummy_weights draws them."""
    expected: set[tuple[str, ShardId]] = set()
    for name, param in params.items():
        module = model.get_submodule(name.rpartition(".")[0])
        expected |= {(name, shard_id) for shard_id in module.checkpoint_shapes(param)}
    return expected
