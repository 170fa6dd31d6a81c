"""Random LoRA adapters at a model's shapes, for benchmarking mixed-adapter steps.

Written as PEFT saves them (adapter_config.json beside adapter_model.safetensors), but by
hand: PEFT would first build the whole base model in host memory (16 GB at 8B) only to
name its modules, and a benchmark needs nothing from it but the file layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.lora import TARGET_MODULES, WEIGHTS_FILE
from common.messages import LoRARequest

# A's rows and B's columns: small, so that the adapted model stays near the base one
INIT_STD = 0.02


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT target module of one decoder layer."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or (
        hidden // hf_config.num_attention_heads)
    q = hf_config.num_attention_heads * head_dim
    kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_random_adapter(hf_config, out: Path, rank: int, seed: int,
                         dtype: torch.dtype = torch.bfloat16) -> None:
    """One adapter of every target module of every layer, A and B both random (a
    freshly trained PEFT adapter has B = 0: it would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (fan_in, fan_out) in projection_shapes(hf_config).items():
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            for part, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
                weights[f"{name}.lora_{part}.weight"] = (
                    INIT_STD * torch.randn(shape, generator=generator)).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGET_MODULES), "bias": "none", "use_rslora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def random_adapters(hf_config, count: int, rank: int, root: Path,
                    dtype: torch.dtype = torch.bfloat16) -> list[LoRARequest]:
    """`count` distinct adapters under `root`, as the requests that name them."""
    requests = []
    for i in range(count):
        path = root / f"adapter-{i}"
        write_random_adapter(hf_config, path, rank, seed=i, dtype=dtype)
        requests.append(LoRARequest(f"bench-{i}", i + 1, str(path)))
    return requests
