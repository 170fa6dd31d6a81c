"""Where do PDL graphs lose row 0's input? pdl_bisect.py's run (HEADRACE_WORKER_PROCESS=0,
PDL on for ONLY's modules), with MODE:
  sync_load    torch.cuda.synchronize() after the static buffers are loaded, before replay
  sync_prepare synchronize() before they are loaded (after the step's inputs are gathered)
  sync_replay  synchronize() after the forward graph's replay
  dump         no sync; row 0's and 1's static inputs of each replay, cloned on the stream
               just before it, printed at the end
  alloc        a small tensor allocated and kept before each replay (no kernel)
  kernel       a kernel on a standing tensor before each replay (no allocation)
  nomixed      steps with more than one query per request run eagerly (no mixed graph)
  check        after each replay, the same forward run eagerly on the static buffers:
               its rows 0 and 1 against the graph's (max abs difference)"""
import os, runpy, sys

import torch

from services import LLM

mode = os.environ.get("MODE", "")
seen, kept, diffs = [], [], []
scratch = torch.zeros(8, device="cuda")
generate = LLM.generate


def loaded(self, *args, **kwargs):
    if mode == "sync_prepare":
        torch.cuda.synchronize()
    load(self, *args, **kwargs)
    if mode == "sync_load":
        torch.cuda.synchronize()
    if mode == "alloc":
        kept.append(torch.empty(8, dtype=torch.int64, device="cuda"))
    if mode == "kernel":
        scratch.add_(1)
    if mode == "dump":
        seen.append(torch.stack([self.input_ids[:2], self.positions[:2],
                                 self.slot_mapping[:2], self.seq_lens[:2].long()]).clone())


def ran(self, *args, **kwargs):
    out = run(self, *args, **kwargs)
    if mode == "sync_replay":
        torch.cuda.synchronize()
    if mode == "check" and len(diffs) < 6:
        graph_rows = out[:2].float().clone()
        eager_rows = self.forward(*args[0])[:2].float()
        diffs.append((args[0], (graph_rows - eager_rows).abs().max(dim=-1).values.tolist()))
    return out


def keyed(self, attn, num_tokens):
    found = key(self, attn, num_tokens)
    return None if mode == "nomixed" and found is not None and found[0] else found




def generate_probed(self, *args, **kwargs):
    """The engine's graphs (built with it, steps not yet run) take the probes first."""
    global load, run, key
    graphs = type(self.engine.runner.graphs)
    if graphs.load is not loaded:
        load, run, key = graphs.load, graphs.run, graphs.key
        graphs.load, graphs.run, graphs.key = loaded, ran, keyed
    return generate(self, *args, **kwargs)


LLM.generate = generate_probed
sys.argv = ["pdl_bisect.py"]
runpy.run_path("benchmarks/issue31-h200/pdl8/pdl_bisect.py", run_name="__main__")
print("MODE", mode)
for i, s in enumerate(seen[:8]):
    print("replay", i, "ids/pos/slot/seqlen rows 0,1:", s.tolist())
for graph, diff in diffs:
    print("graph", graph, "rows 0,1 max |graph - eager|:", diff)
