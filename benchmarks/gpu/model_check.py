"""A real model's widths against transformers on the GPU: the same random weights at the real
hidden size, heads, experts and window, cut to a few layers so both models fit at once.
Prompt logprobs of a prompt longer than the sliding window, and greedy tokens, from
`LLM.generate` (Triton kernels, CUDA graphs) against transformers' eager forward in bf16.
Writes a JSON summary; exits 1 when the logprobs part by more than the bf16 tolerance.

    python benchmarks/gpu/model_check.py --model .devkit/models/gemma-2-9b-shape \
        --layers 4 --prompt-len 5000 --json $OUT/r/check-gemma2.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from services import LLM, SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# bf16 logits of random-weight models sit near 10; one bf16 step there is 0.06, and the two
# models round in different places over a few layers
TOLERANCE = {"max": 0.5, "mean": 0.05}


def write_checkpoint(shape_dir: Path, layers: int, tokenizer_dir: Path, out: Path,
                     dtype: torch.dtype = torch.bfloat16):
    """transformers' own random initialisation at the real widths, `layers` deep, saved as a
    model directory; returns the transformers model (bf16, on the GPU, eager attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(shape_dir)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    # initialised on the GPU: a CPU init of Qwen3-30B-A3B's two layers of 128 experts
    # outlasted the script's time limit
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="eager")
    model.save_pretrained(out)
    source = shape_dir if (shape_dir / "tokenizer.json").is_file() else tokenizer_dir
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return model.eval()


@torch.no_grad()
def reference(model, prompt: list[int], output_len: int) -> tuple[list[float], list[int]]:
    ids = torch.tensor([prompt], device="cuda")
    logprobs = model(ids).logits[0].float().log_softmax(-1)
    prompt_lp = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
    tokens = model.generate(ids, max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    return prompt_lp, tokens


def ours(model_dir: Path, prompt: list[int], output_len: int, tensor_parallel_size: int = 1,
         dtype: str = "bfloat16") -> tuple[list[float], list[int]]:
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=len(prompt) + output_len + 16,
              gpu_memory_utilization=0.5, tensor_parallel_size=tensor_parallel_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.engine.close()
    prompt_lp = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:],
                                                                prompt[1:])]
    return prompt_lp, out.outputs[0].token_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a *-shape directory")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="for shapes without tokenizer files (default: qwen3-0.6b-shape "
                             "beside --model)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="float32: both sides exact enough that a router's near-tie "
                             "cannot flip an expert")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizer_dir = args.tokenizer or args.model.parent / "qwen3-0.6b-shape"
    prompt = torch.randint(3, 10000, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_checkpoint(args.model, args.layers, tokenizer_dir, Path(tmp),
                              getattr(torch, args.dtype))
        ref_lp, ref_tokens = reference(hf, prompt, args.output_len)
        del hf
        torch.cuda.empty_cache()
        our_lp, our_tokens = ours(Path(tmp), prompt, args.output_len,
                                  args.tensor_parallel_size, args.dtype)
    diffs = [abs(a - b) for a, b in zip(our_lp, ref_lp)]
    same = next((i for i, (a, b) in enumerate(zip(our_tokens, ref_tokens)) if a != b),
                len(our_tokens))
    result = {"model": args.model.name, "layers": args.layers, "prompt_len": args.prompt_len,
              "tensor_parallel_size": args.tensor_parallel_size, "dtype": args.dtype,
              "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
              "positions_over_0.5": sum(d > 0.5 for d in diffs),
              "greedy_tokens_equal_before_first_difference": same,
              "output_len": args.output_len,
              "ours": our_tokens, "transformers": ref_tokens}
    print(json.dumps({k: v for k, v in result.items() if k not in ("ours", "transformers")}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = result["max_abs_logprob_diff"] <= TOLERANCE["max"] and \
        result["mean_abs_logprob_diff"] <= TOLERANCE["mean"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
