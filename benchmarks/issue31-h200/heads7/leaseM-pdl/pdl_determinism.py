"""Same bf16 graphs, same prompts, twice in one process: are the greedy tokens the same?"""
import hashlib, shutil, sys
from pathlib import Path
import torch
from services import LLM
from common.sampling_params import SamplingParams

out = Path("/tmp/rm")
if not out.exists():
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = Path(".devkit/models/qwen3-0.6b-shape")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(shape / name, out / name)
prompts = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village at the edge of a great forest,",
           "List three primary colors:"] * 3
eager = len(sys.argv) > 1
llm = LLM(str(out), num_gpu_blocks_override=512, max_num_seqs=16, max_model_len=2048, enforce_eager=eager)
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
import os
for run in range(int(os.environ.get("RUNS", "3"))):
    toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print("eager" if eager else "graphs", run, hashlib.md5(str(toks).encode()).hexdigest()[:8], toks[0][:6], toks[1][:6], flush=True)
