"""Where do PDL graphs first write other KV than plain graphs? Each configuration builds an
engine in this process (HEADRACE_WORKER_PROCESS=0), runs the 12 prompts of pdl_bisect.py
for STEPS greedy tokens and keeps its KV cache; then every layer's K and V, slot by slot,
against the first configuration's. Prints, per configuration, the first layer that
differs and the slots that differ there (slot = block * 16 + offset; request 0 holds
slots 0..), and the tokens."""
import os, sys

import torch

import kernels.pdl
from common.sampling_params import SamplingParams
from services import LLM

model, steps = "/tmp/rm", int(os.environ.get("STEPS", "2"))
prompts = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village at the edge of a great forest,",
           "List three primary colors:"] * 3
configs = [("graphs-plain", False, False), ("graphs-pdl", False, True),
           ("eager-plain", True, False), ("eager-pdl", True, True)]
caches = {}
for name, eager, pdl in configs:
    kernels.pdl.ENABLED = pdl
    llm = LLM(model, num_gpu_blocks_override=512, max_num_seqs=16, max_model_len=2048,
              enforce_eager=eager, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(name, "tokens rows 0-2:", [o.outputs[0].token_ids for o in outs[:3]], flush=True)
    caches[name] = [(k.flatten(0, 1).float().clone(), v.flatten(0, 1).float().clone())
                    for k, v in llm.engine.runner.kv_caches]
    llm.close()
    del llm
    torch.cuda.empty_cache()
base = caches[configs[0][0]]
for name, *_ in configs[1:]:
    for layer, ((k, v), (k0, v0)) in enumerate(zip(caches[name], base)):
        diff = torch.maximum((k - k0).abs().amax(dim=(1, 2)), (v - v0).abs().amax(dim=(1, 2)))
        slots = diff.nonzero().flatten().tolist()
        if slots:
            print(name, "vs", configs[0][0], "first differs at layer", layer, "slots",
                  slots[:24], "max", [round(diff[s].item(), 4) for s in slots[:8]], flush=True)
            break
    else:
        print(name, "vs", configs[0][0], "no KV differs", flush=True)
