"""A decode step's device time in each of its context bounds' graphs (cuda_graphs.py): the
offline engine at Qwen3-0.6B's shapes (dummy weights, max_model_len 2048) captures its
graphs; a batch of B requests at context C is written into the static buffers once (its
cache slots -1: nothing written), and each decode graph of size B, one per bound, is
replayed 200 times back to back between CUDA events, so no host work sits between
replays. Then the same with the sampling head after each replay.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/span_replay.py MODEL_DIR
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

os.environ["HEADRACE_WORKER_PROCESS"] = "0"  # the runner in this process, to reach its graphs

from services import LLM  # noqa: E402

REPLAYS = 200


def replay_us(replay) -> float:
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / REPLAYS


def main(model: str) -> None:
    llm = LLM(model, load_format="dummy", max_model_len=2048)
    graphs = llm.engine.runner.graphs
    print(torch.cuda.get_device_name(), "bounds:", {s: graphs.decode_spans[s] for s in (1, 8)})
    per = 2048 // llm.engine.runner.block_size
    for batch, context in ((1, 62), (8, 62), (1, 300), (1, 1000), (8, 1000)):
        graphs.block_tables[:batch, :per] = torch.arange(batch * per).view(batch, per)
        graphs.seq_lens.zero_()
        graphs.seq_lens[:batch] = context
        graphs.positions[:batch] = context - 1
        graphs.slot_mapping.fill_(-1)
        keys = [key for key in graphs.graphs if not key.mixed and key.size == batch]
        for key in keys:
            head = graphs.heads[(key, 0)]
            alone = statistics.median(replay_us(graphs.graphs[key].replay) for _ in range(3))
            both = statistics.median(replay_us(lambda: (graphs.graphs[key].replay(),
                                                        head.replay())) for _ in range(3))
            print(f"batch {batch} context {context} bound {key.span}: {alone:.1f} us, "
                  f"with its head {both:.1f} us", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
