"""`headrace generate --model M --prompt P [sampling flags]`: offline completions, printed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from common.config import ConfigError, add_engine_args, engine_config_from_args
from common.sampling_params import SamplingError, SamplingParams

_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                   "min_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logprobs", "ignore_eos")
# --seed is the engine's (weights of dummy models, unseeded sampling), as in vLLM
_DESTS = {"seed": "sampling_seed"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace generate", description=__doc__)
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeat the flag for several)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the chat template")
    parser.add_argument("--stop", action="append", default=None, help="a stop string")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    sampling = parser.add_argument_group("sampling")
    defaults = SamplingParams()
    for name in _SAMPLING_FLAGS:
        default = getattr(defaults, name)
        dest = _DESTS.get(name, name)
        flag = "--" + dest.replace("_", "-")
        if isinstance(default, bool):
            sampling.add_argument(flag, dest=dest, action="store_true",
                                  help=f"default {default}")
        else:
            kind = float if isinstance(default, float) else int
            sampling.add_argument(flag, dest=dest, type=kind, default=None,
                                  help=f"default {default}")
    add_engine_args(parser)
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
        overrides = {name: getattr(args, _DESTS.get(name, name)) for name in _SAMPLING_FLAGS
                     if getattr(args, _DESTS.get(name, name)) not in (None, False)}
        if args.stop:
            overrides["stop"] = args.stop
    except ConfigError as e:
        parser.error(str(e))
    from services.llm import LLM  # torch is imported only once the flags are valid

    llm = LLM(**dataclasses.asdict(config))
    try:
        params = llm.engine.info.defaults.params_for(overrides)
    except SamplingError as e:
        parser.error(str(e))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": completion.index,
                                  "text": completion.text, "token_ids": completion.token_ids,
                                  "finish_reason": completion.finish_reason}))
            else:
                print(f"Prompt: {prompt!r}, Generated text: {completion.text!r}")
    sys.stdout.flush()
    return 0
