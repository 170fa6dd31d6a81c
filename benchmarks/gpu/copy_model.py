"""A checkpoint at a real model's shapes whose greedy continuation of the latency benchmark's
repeating prompt is that prompt's cycle: the prompt contains the answer, as in code editing,
so ngram speculation's drafts are accepted. Random weights cannot show that (their output
never repeats), and no real 8B checkpoint reaches the device.

How: o_proj and down_proj are zero, so every layer adds nothing and the final hidden state
is the current token's embedding; lm_head's row for the motif's next token is that token's
embedding row (a permutation of the embedding rows), so the argmax is the motif's next
token. Every layer still runs at full size: zeros cost a matmul what any weights cost.

    PYTHONPATH=. python benchmarks/gpu/copy_model.py --config-dir .devkit/models/llama-3.1-8b-shape \\
        --out /tmp/copy-8b --context-len 1000 --prompt-period 16
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from benchmarks.bench.adapters import projection_shapes
from benchmarks.bench.workloads import fixed_workload

STD = 0.02
ZEROED = ("o_proj", "down_proj")


def motif_of_the_latency_prompt(vocab_size: int, batch_size: int, context_len: int,
                                period: int) -> list[int]:
    """The tokens `headrace bench latency --prompt-period` repeats (its first request's)."""
    prompt = fixed_workload("latency", batch_size, context_len, 1, vocab_size=vocab_size)
    motif = prompt.prompts[0][:period]
    assert len(set(motif)) == period, "the motif repeats a token: no cycle to follow"
    return motif


def layer_weights(config, layer: int, device: str) -> dict[str, torch.Tensor]:
    weights = {}
    for module, (fan_in, fan_out) in projection_shapes(config).items():
        block = "self_attn" if module[0] in "qkvo" else "mlp"
        make = torch.zeros if module in ZEROED else lambda *s, **kw: STD * torch.randn(*s, **kw)
        weights[f"model.layers.{layer}.{block}.{module}.weight"] = make(
            fan_out, fan_in, device=device, dtype=torch.bfloat16)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        weights[f"model.layers.{layer}.{norm}.weight"] = torch.ones(
            config.hidden_size, device=device, dtype=torch.bfloat16)
    return weights


def head_weights(config, motif: list[int], device: str) -> dict[str, torch.Tensor]:
    embed = STD * torch.randn(config.vocab_size, config.hidden_size, device=device,
                              dtype=torch.bfloat16)
    lm_head = embed.clone()
    for token, after in zip(motif, motif[1:] + motif[:1]):
        lm_head[after] = embed[token]
    return {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head,
            "model.norm.weight": torch.ones(config.hidden_size, device=device,
                                            dtype=torch.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context-len", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-period", type=int, default=16)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.config_dir)
    assert not config.tie_word_embeddings, "the permuted lm_head needs its own weights"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    for item in args.config_dir.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            shutil.copy(item, args.out / item.name)
    motif = motif_of_the_latency_prompt(config.vocab_size, args.batch_size,
                                        args.context_len, args.prompt_period)
    save_file({k: v.cpu() for k, v in head_weights(config, motif, device).items()},
              str(args.out / "model-head.safetensors"))
    for layer in range(config.num_hidden_layers):
        save_file({k: v.cpu() for k, v in layer_weights(config, layer, device).items()},
                  str(args.out / f"model-layer-{layer:03d}.safetensors"))
    print(f"wrote {args.out}: greedy decoding follows the cycle {motif}")


if __name__ == "__main__":
    main()
