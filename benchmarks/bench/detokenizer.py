"""`headrace bench detokenizer`: a detokenizer replica's host time per token, no model.

Steps of `--streams` streamed completions, each step one new token a stream with
`--logprobs` top logprobs, as the scheduler sends them (DetokItems with make_context's
window, as a TokenBatch through the wire codec); the text is --tokenizer's encoding of
this repository's README, so most tokens are English words, and the alternatives in the
logprobs are other tokens of it. Each step's batch is decoded from its bytes and
detokenized (services.detokenizer.batch_detokenizer) as a replica does before it writes
the deltas, with the heap frozen as a replica freezes it (common.service.freeze_heap);
the times are microseconds a token.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

from benchmarks.bench.host_json import write_host_json
from common.detok_window import detok_params, make_context
from common.messages import DetokItem, TokenLogprobs, decode, encode
from common.model_files import load_tokenizer
from common.sampling_params import SamplingParams
from common.token_columns import token_batch
from services.detokenizer import batch_detokenizer

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPT_TOKENS = 32


def step_batches(tokenizer, streams: int, steps: int, logprobs: int | None) -> list[bytes]:
    """Each step's TokenBatch, encoded: stream s decodes the README's tokens from its own
    offset, each token with `logprobs` made-up alternatives."""
    ids = tokenizer.encode(README.read_text())
    rng = random.Random(0)
    params = detok_params(SamplingParams(logprobs=logprobs))
    starts = [rng.randrange(PROMPT_TOKENS, len(ids) - steps - 1) for _ in range(streams)]
    batches = []
    for step in range(1, steps + 1):
        items = []
        for s, start in enumerate(starts):
            prompt, outputs = ids[start - PROMPT_TOKENS:start], ids[start:start + step]
            context, num_prompt = make_context(prompt, outputs, 1, 0)
            lps = [] if logprobs is None else [TokenLogprobs(
                [outputs[-1]] + rng.choices(ids, k=logprobs),
                [-0.5] * (logprobs + 1), 1)]
            items.append(DetokItem(f"r{s}", 0, "gw", step - 1, outputs[-1:], context,
                                   num_prompt, params, PROMPT_TOKENS, logprobs=lps))
        batches.append(encode(token_batch(step, items)))
    return batches


def time_run(detokenize, batches: list[bytes], streams: int) -> float:
    """us a token over every batch, decoded from its bytes as a replica reads it."""
    started = time.perf_counter()
    for data in batches:
        detokenize(decode(data))
    return 1e6 * (time.perf_counter() - started) / (len(batches) * streams)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench detokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True,
                        help="a model directory or tokenizer files (no hub access)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs over the steps; the fastest is reported")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    batches = step_batches(tokenizer, args.streams, args.steps, args.logprobs)
    detokenize = batch_detokenizer(tokenizer)
    gc.collect()
    gc.freeze()
    time_run(detokenize, batches[:max(1, len(batches) // 8)], args.streams)  # warm-up
    runs = [time_run(detokenize, batches, args.streams) for _ in range(args.repeat)]
    print(f"{args.streams} streams, {args.steps} steps, logprobs {args.logprobs}: "
          f"{min(runs):.2f} us a token (best of {len(runs)}: "
          f"{', '.join(f'{r:.2f}' for r in runs)})")
    if args.json:
        write_host_json(args.json, {"args": vars(args), "us_per_token": runs})
    return 0
