"""Greedy tokens of one rank against N tensor-parallel ranks, the same prompts and weights
(`--load-format dummy` draws the same model at any size). Where a sequence parts from the
single rank's, the single rank's logprobs of the two tokens say whether it was a tie at
bf16 precision. Writes a JSON summary; exits 1 if any parting was not a tie.

    python benchmarks/gpu/tp_tokens.py --model .devkit/models/llama-3.1-8b-shape \
        --tensor-parallel-size 2 --json $OUT/r/tp-tokens.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from pathlib import Path

import torch

from common.model_files import load_hf_config, resolve_model
from services import LLM, SamplingParams

# Logprob gaps below which rounding can swap the top two tokens. Random weights give flat
# logits, so near-ties are common; a bf16 logit of such a model sits near 8 to 16, where
# one bf16 step is 0.0625, and the ranks' different summation orders move it a step or two.
TIE = {"bfloat16": 0.125, "float32": 1e-3}


def greedy(args: argparse.Namespace, size: int, prompts: list[list[int]]) -> list:
    llm = LLM(args.model, tensor_parallel_size=size, load_format=args.load_format,
              dtype=args.dtype, max_model_len=args.prompt_len + args.output_len + 16)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=False)
    llm.engine.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0] for o in outputs]


def parting(one, many, tie: float) -> dict | None:
    """Where `many` first differs from `one`, and the single rank's gap there."""
    for i, (a, b) in enumerate(zip(one.token_ids, many.token_ids)):
        if a != b:
            top = one.logprobs[i]  # the single rank's five likeliest tokens, `a` first
            gap = top[a].logprob - top[b].logprob if b in top else float("inf")
            return {"position": i, "one_rank": a, "ranks": b, "gap": gap, "tie": gap <= tie}
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TIE))
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    vocab = load_hf_config(resolve_model(args.model, args.load_format)).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    one = greedy(args, 1, prompts)
    many = greedy(args, args.tensor_parallel_size, prompts)
    partings = [parting(a, b, TIE[args.dtype]) for a, b in zip(one, many)]
    summary = {"command": "python benchmarks/gpu/tp_tokens.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "identical": sum(p is None for p in partings), "prompts": len(prompts),
               "partings": [p for p in partings if p is not None]}
    Path(args.json).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0 if all(p is None or p["tie"] for p in partings) else 1


if __name__ == "__main__":
    raise SystemExit(main())
