"""Is row 0's repeated token a near tie? pdl_bisect.py's 12 prompts, three greedy tokens
with logprobs=3, eager and from graphs (PDL per HEADRACE_PDL), in this process: row 0's
and row 1's top three (token, logprob) at each step."""
import os

from common.sampling_params import SamplingParams
from services import LLM

prompts = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village at the edge of a great forest,",
           "List three primary colors:"] * 3
for eager in (True, False):
    llm = LLM("/tmp/rm", num_gpu_blocks_override=512, max_num_seqs=16, max_model_len=2048,
              enforce_eager=eager)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for row in (0, 1):
        steps = [sorted(((t, round(lp.logprob, 4)) for t, lp in step.items()),
                        key=lambda x: -x[1]) for step in outs[row].outputs[0].logprobs]
        print("eager" if eager else "graphs", "PDL", os.environ.get("HEADRACE_PDL"), "row", row,
              outs[row].outputs[0].token_ids, steps, flush=True)
    llm.close()
