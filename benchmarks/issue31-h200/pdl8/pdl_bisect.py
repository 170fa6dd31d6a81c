"""Which kernel's PDL launch changes the greedy tokens of bf16 decode graphs?
HEADRACE_PDL=1 with the kernels of the modules in OFF (comma list, e.g. "norm,gemv")
launched plainly, or with ONLY set, every module but those launched plainly; EAGER=1 runs
without graphs; HEADRACE_GEMV=gemv or cublas: every 16-bit projection takes the Triton GEMV
at 1-16 rows, or cuBLAS, instead of the start-up timing's choice. Prints a digest of all tokens and row 0's and row 1's first six.
Random Qwen3-0.6B weights, saved once under /tmp/rm (pdl_determinism.py's model)."""
import hashlib, importlib, os, shutil
from pathlib import Path

import torch

MODULES = ["activation", "attention_inputs", "gemv", "norm", "triton_attention"]
off = [m for m in os.environ.get("OFF", "").split(",") if m]
if os.environ.get("ONLY"):
    off = [m for m in MODULES if m not in os.environ["ONLY"].split(",")]
for name in off:
    setattr(importlib.import_module(f"kernels.{name}"), "pdl_launch", lambda t: {"PDL": False})

from services import LLM  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

out = Path("/tmp/rm")
if not out.exists():
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = Path(".devkit/models/qwen3-0.6b-shape")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape),
                                     dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(shape / name, out / name)
prompts = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village at the edge of a great forest,",
           "List three primary colors:"] * 3
eager = os.environ.get("EAGER") == "1"
llm = LLM(str(out), num_gpu_blocks_override=512, max_num_seqs=16, max_model_len=2048,
          enforce_eager=eager)
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
label = "eager" if eager else f"off={','.join(off) or '-'}"
label += f" gemv={os.environ.get('HEADRACE_GEMV', 'timed')}"
print("RESULT", label, hashlib.md5(str(toks).encode()).hexdigest()[:8], toks[0][:6],
      toks[1][:6], flush=True)
