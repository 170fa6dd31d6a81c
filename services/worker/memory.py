"""How many KV cache blocks fit: a byte budget on the CPU, a profiled budget on a GPU."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from common.config import EngineConfig
from services.worker.cuda_graphs import graph_tokens

log = logging.getLogger("headrace.worker")

CPU_DEFAULT_KV_BYTES = 1 << 30


class Profilable(Protocol):
    device: torch.device

    def profile_run(self) -> None: ...

    def graph_head_bytes(self) -> int: ...


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype,
                             tp_size: int = 1, num_layers: int | None = None) -> int:
    """num_layers: those of a pipeline stage; the model's by default."""
    num_layers = num_layers or hf_config.num_hidden_layers
    num_kv_heads = max(1, hf_config.num_key_value_heads // tp_size)
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def plan_num_blocks(config: EngineConfig, runner: Profilable, bytes_per_block: int) -> int:
    """bytes_per_block: kv_cache_bytes_per_block of the cache's dtype, so an fp8 cache gets
    twice the blocks of a 16-bit one in the same budget."""
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif runner.device.type == "cuda":
        num_blocks = _profiled_budget(config, runner) // bytes_per_block
    else:
        num_blocks = (config.kv_cache_memory or CPU_DEFAULT_KV_BYTES) // bytes_per_block
    if num_blocks < 1:
        raise MemoryError(
            "no memory is left for the KV cache: raise --gpu-memory-utilization or "
            "--kv-cache-memory, or lower --max-num-batched-tokens / --max-num-seqs")
    assert config.max_model_len is not None
    per_request = -(-config.max_model_len // config.block_size)
    log.info("KV cache (%s): %d blocks of %d tokens (%.2f GiB); maximum concurrency for "
             "%d tokens per request: %.2fx", config.kv_cache_dtype, num_blocks,
             config.block_size, num_blocks * bytes_per_block / 2**30, config.max_model_len,
             num_blocks / per_request)
    return num_blocks


def _profiled_budget(config: EngineConfig, runner: Profilable) -> int:
    """gpu_memory_utilization of the device, minus what the weights, the largest step's
    activations (a vision-language model's encoder pass over the largest images included:
    ModelRunner.profile_run), the CUDA graphs' own memory pool and everything outside torch's
    allocator (CUDA context, library workspaces) take. --kv-cache-memory-bytes replaces
    that budget (as in vLLM, gpu_memory_utilization no longer counts), once the same
    profile shows that it fits beside the rest in the whole device."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    runner.profile_run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    outside_torch = max((total - free) - torch.cuda.memory_reserved(), 0)
    torch.cuda.empty_cache()
    graphs = _graph_reserve(config, peak - weights, runner)
    budget = int(total * config.gpu_memory_utilization) - peak - outside_torch - graphs
    log.info("memory profile: total %.2f GiB, weights %.2f GiB, activation peak %.2f GiB, "
             "CUDA graphs %.2f GiB, outside torch %.2f GiB, KV budget %.2f GiB",
             total / 2**30, weights / 2**30, (peak - weights) / 2**30, graphs / 2**30,
             outside_torch / 2**30, budget / 2**30)
    if config.kv_cache_memory is None:
        return max(budget, 0)
    room = total - peak - outside_torch - graphs
    if config.kv_cache_memory > room:
        raise MemoryError(
            f"--kv-cache-memory-bytes {config.kv_cache_memory} does not fit: the device "
            f"has {max(room, 0)} bytes left beside the weights, activations and CUDA graphs; "
            "lower it, or leave it out for --gpu-memory-utilization to size the cache")
    return config.kv_cache_memory


def _graph_reserve(config: EngineConfig, activations: int, runner: Profilable) -> int:
    """CUDA graphs keep their activations in a pool of their own, captured after the KV
    cache exists: the profiled activations scaled to the largest graph's tokens, room for
    the per-graph workspaces, and the logits of the decode graphs' sampling heads (the
    scaled share holds a fraction of the sampler's, which does not shrink with the
    tokens). On a pipeline stage after the first the profile holds the hidden states
    received too, so the scaled share covers the graphs' buffer for them; every stage
    captures, each its own layers."""
    if config.enforce_eager:
        return 0
    assert config.max_num_batched_tokens is not None
    tokens = graph_tokens(config.max_num_seqs, config.max_num_batched_tokens)
    return (activations * tokens // config.max_num_batched_tokens + 256 * 2**20
            + runner.graph_head_bytes())
