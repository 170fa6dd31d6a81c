"""The offline engine's host work per output token, with the device taken out: the demo
model's engine (tokenizer, scheduler, detokenizer process) runs the nano workload's
lengths with steps that return random tokens at once, so what is timed is the loop's own
work (schedule, update, hand-over to the detokenizer process, collect). Prints the cost
per token a step at a time (CUMULATIVE) and at each completion's end (FINAL_ONLY, as
LLM.generate asks), alternating, each under LLM.generate's collector settings
(services/offline/engine.py's fewer_collections), and checks that both give every
completion the same text, token ids and logprobs.

    .venv/bin/python benchmarks/offline-loop-cpu/loop_host_cost.py [--prompts 512] [--logprobs 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench.throughput import with_sampling  # noqa: E402
from benchmarks.bench.workloads import nano_workload  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.messages import StepLogprobs, StepPlan, StepResult  # noqa: E402
from common.sampling_params import RequestOutputKind  # noqa: E402
from common.timing import PhaseClock  # noqa: E402
from services.demo import demo_model_path  # noqa: E402
from services.offline.engine import Engine, fewer_collections  # noqa: E402


# the GPU runs' dummy weights sample over the whole of Qwen3-0.6B's vocabulary, past the
# 49,152 ids of the tokenizer its shape directory carries: the nano workload's logprobs=1
# brought 126k distinct ids on the H200
QWEN3_VOCAB = 151_936


class InstantSteps:
    """Steps whose results are ready when launched: a random token of the tokenizer's for
    each request whose prompt the step finishes, and when asked a made-up logprob for it
    and for its top 1, a random id of the model's vocabulary (the text of ids past the
    tokenizer's is empty, and the streamed text can drop a character they split:
    benchmarks/offline-loop-cpu/README.md)."""

    def __init__(self, logprobs: bool, num_tokens: int, vocab_size: int) -> None:
        self.prompt_len: dict[str, int] = {}
        self.num_tokens, self.vocab_size = num_tokens, vocab_size
        self.done: list[StepResult] = []
        self.logprobs = logprobs
        self.rng = random.Random(0)

    def launch(self, plan: StepPlan) -> None:
        for new in plan.new:
            self.prompt_len[new.req_id] = len(new.token_ids)
        req_ids = [r for r, start, n in zip(plan.req_ids, plan.num_computed_tokens,
                                            plan.num_scheduled_tokens)
                   if start + n >= self.prompt_len[r]]
        tokens = [self.rng.randrange(self.num_tokens) for _ in req_ids]
        top = [self.rng.randrange(self.vocab_size) for _ in req_ids]
        count = len(tokens)
        logprobs = StepLogprobs([2] * count, [x for pair in zip(tokens, top) for x in pair],
                                [-0.5, -1.0] * count, [1] * count) if self.logprobs else None
        self.done.append(StepResult(plan.step, req_ids, tokens, logprobs))

    def results(self, keep: int) -> list[StepResult]:
        count = max(0, len(self.done) - keep)
        done, self.done = self.done[:count], self.done[count:]
        return done

    def close(self) -> None:
        """Nothing runs beside the loop."""


def run(kind: RequestOutputKind, prompts: int, logprobs: int | None,
        vocab_size: int = QWEN3_VOCAB) -> tuple[float, int, dict, dict]:
    engine = Engine(EngineConfig(model=demo_model_path(), max_num_seqs=128,
                                 num_gpu_blocks_override=9000), worker_process=False)
    engine.detokenizer.token_text.preload(vocab_size)  # as with a worker process
    engine.steps.close()
    engine.steps = InstantSteps(logprobs is not None, len(engine.info.tokenizer), vocab_size)
    workload = with_sampling(nano_workload(prompts), logprobs=logprobs)
    for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
        engine.add_request(str(i), prompt, params.replace(output_kind=kind))
    engine.clock = PhaseClock()
    texts: dict[str, tuple] = {}
    start = time.perf_counter()
    with fewer_collections():  # as LLM.generate runs its batch
        while engine.has_unfinished():
            for d in engine.step():
                text, ids, lps = texts.get(d.rid, ("", [], []))
                texts[d.rid] = (text + d.text, ids + d.token_ids, lps + d.logprobs)
    seconds = time.perf_counter() - start
    engine.close()
    tokens = sum(len(ids) for _, ids, _ in texts.values())
    return seconds, tokens, engine.clock.summary(), texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--logprobs", type=int)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    seen = {}
    for round_ in range(args.rounds):
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            seconds, tokens, phases, texts = run(kind, args.prompts, args.logprobs)
            print(f"{kind.name:<11} round {round_ + 1}: {tokens} tokens in {seconds:.2f} s, "
                  f"{seconds / tokens * 1e6:.1f} us/token; {phases}")
            seen[kind] = texts
    same = seen[RequestOutputKind.CUMULATIVE] == seen[RequestOutputKind.FINAL_ONLY]
    print("same text, token ids and logprobs:", same)


if __name__ == "__main__":
    main()
