"""`headrace generate --model M --prompt P [sampling flags]`: offline completions, printed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from common.config import ConfigError, add_engine_args, engine_config_from_args
from common.errors import ApiError
from common.model_support import REFUSED_EXIT, UnsupportedModel, refusal_line
from common.sampling_params import CLIENT_PARAMS, SamplingError, SamplingParams, json_kinds

# --seed is the engine's (weights of dummy models, unseeded sampling), as in vLLM
_DESTS = {"seed": "sampling_seed"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace generate", description=__doc__)
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeat the flag for several)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the chat template")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    add_sampling_args(parser.add_argument_group("sampling"))
    add_engine_args(parser)
    return parser


def add_sampling_args(group: argparse._ArgumentGroup) -> None:
    """One flag per client sampling parameter; a list parameter repeats its flag."""
    defaults = SamplingParams()
    for name in CLIENT_PARAMS:
        dest = _DESTS.get(name, name)
        flag, kinds = "--" + dest.replace("_", "-"), json_kinds(name)
        text = f"default {getattr(defaults, name)!r}"
        if kinds == (bool,):
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        elif kinds == (list,):
            item = str if name in ("stop", "bad_words") else int
            group.add_argument(flag, dest=dest, action="append", type=item, default=None,
                               help=text + " (repeat the flag for several)")
        elif kinds == (dict,):
            group.add_argument(flag, dest=dest, type=_json_object, default=None,
                               help=text + ", as a JSON object")
        else:
            group.add_argument(flag, dest=dest, type=float if float in kinds else int,
                               default=None, help=text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
        overrides = {name: getattr(args, _DESTS.get(name, name)) for name in CLIENT_PARAMS
                     if getattr(args, _DESTS.get(name, name)) is not None}
    except ConfigError as e:
        parser.error(str(e))
    from services.offline.llm import LLM  # torch is imported only once the flags are valid

    try:
        llm = LLM(**dataclasses.asdict(config))
    except UnsupportedModel as e:  # one line, as `headrace serve` refuses it
        print(refusal_line(e), file=sys.stderr)
        return REFUSED_EXIT
    except ConfigError as e:  # what the model's files show: a size that cannot split it
        parser.error(str(e))
    try:
        params = llm.engine.info.defaults.params_for(overrides)
    except SamplingError as e:
        parser.error(str(e))
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except ApiError as e:  # a request the engine refuses: a prompt too long, a bad grammar
        parser.error(e.message)
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
