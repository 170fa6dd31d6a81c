"""`headrace profile`: a layerwise profile of the in-process engine's prefill and decode steps.

    headrace profile --model DIR --load-format dummy --batch-size 4 --prompt-len 512 \\
        --max-num-batched-tokens 8192 --json llama8b.json run_num_steps -n 2
    headrace profile --model DIR --batch-size 128 --prompt-len 64 --csv out/smol \\
        run_to_completion -n 32

`batch-size` requests of `prompt-len` random token ids (ignore_eos, temperature 0.8,
top_p 0.95) are prefilled in one step, then decoded; each step is profiled on its own with
torch.profiler (CPU activity, and CUDA activity on a GPU) and reduced to a model table
(time per nn.Module) and a summary table (time per CUDA kernel and CPU op). Decode steps
run eagerly by default (--enforce-eager), since a CUDA graph replay runs no module code.

Then read the JSON with `headrace profile-table` and `headrace profile-plot`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.profiler.layerwise import ModuleRanges, StepProfile, profile_step
from benchmarks.profiler.table import format_phase_table, write_model_csv, write_summary_csv
from common.config import ConfigError, EngineConfig, add_engine_args, engine_config_from_args
from common.log import configure_logging
from common.model_info import resolve_engine
from common.sampling_params import SamplingParams
from services.offline.engine import Engine

BATCH_SIZE_DEFAULT = 1
PROMPT_LEN_DEFAULT = 256
LINE_WIDTH = 80


@dataclass(slots=True)
class ProfileSettings:
    prompt_len: int
    batch_size: int
    # one of the two modes: every request runs num_steps engine steps, or
    # complete_num_requests_per_step requests finish at every decode step
    num_steps: int | None = None
    complete_num_requests_per_step: int | None = None
    save_chrome_traces_folder: str | None = None


# --- which requests run how long -----------------------------------------------------------

def requests_per_step(settings: ProfileSettings) -> list[int]:
    """How many requests each profiled step runs; the first step is the prefill of all.
    With complete_num_requests_per_step K the batch shrinks by K after the first decode,
    and a last step of one request is added (the latency of a lone request is worth
    seeing): batch 128, K 32 -> [128, 128, 96, 64, 32, 1]."""
    batch = settings.batch_size
    if settings.num_steps:
        return [batch] * settings.num_steps
    per_step = settings.complete_num_requests_per_step
    assert per_step is not None and per_step > 0
    steps = [batch, batch]
    running = batch - per_step
    while running > 0:
        steps.append(running)
        running -= per_step
    if steps[-1] != 1:
        steps.append(1)
    return steps


def output_lengths(batch_size: int, step_requests: list[int]) -> dict[int, int]:
    """{output length: number of requests} so that step i runs step_requests[i] requests:
    a request of output length L takes part in steps 1..L. Assigned from the last step
    back: batch 128, steps [128, 128, 96, 64, 32, 1] -> {6: 1, 5: 31, 4: 32, 3: 32, 2: 32}."""
    assert step_requests[0] == batch_size, "the prefill step runs every request"
    lengths: dict[int, int] = {}
    assigned = 0
    for length in range(len(step_requests), 0, -1):
        if assigned == batch_size:
            break
        unassigned = step_requests[length - 1] - assigned
        assert unassigned >= 0, f"steps must not grow: {step_requests}"
        if unassigned:
            lengths[length] = unassigned
            assigned += unassigned
    assert sum(lengths.values()) == batch_size, (batch_size, step_requests, lengths)
    return lengths


def fit_error(settings: ProfileSettings, config: EngineConfig, max_output_len: int) -> str | None:
    """Why the requests cannot run as planned (one prefill step, one batch), or None.
    `config` is resolved (max_model_len and the token budget filled in)."""
    batch, prompt = settings.batch_size, settings.prompt_len
    budget, max_len = config.max_num_batched_tokens, config.max_model_len
    assert budget is not None and max_len is not None
    if batch * prompt > budget:
        return (f"chosen batch_size * prompt_len ({batch} * {prompt} = {batch * prompt}) is "
                f"larger than max_num_batched_tokens ({budget}) and therefore cannot be run "
                "in a single profile step, please choose a smaller batch size or prompt "
                "length, or increase --max-num-batched-tokens")
    if batch > config.max_num_seqs:
        return (f"chosen batch_size ({batch}) is larger than max_num_seqs "
                f"({config.max_num_seqs}) and therefore cannot be run in a single profile "
                "step, please choose a smaller batch size or increase --max-num-seqs")
    if prompt + max_output_len > max_len:
        return (f"chosen prompt_len + max_output_len ({prompt} + {max_output_len} = "
                f"{prompt + max_output_len}) is larger than the model's max_model_len "
                f"({max_len}), please choose a smaller prompt_len or max_output_len, or "
                "increase --max-model-len")
    return None


def kv_error(settings: ProfileSettings, max_output_len: int, block_size: int,
             num_blocks: int) -> str | None:
    """The batch must fit the KV cache whole: a preemption would change the steps."""
    per_request = -(-(settings.prompt_len + max_output_len) // block_size)
    needed = settings.batch_size * per_request
    if needed > num_blocks:
        return (f"the batch needs {needed} KV cache blocks ({settings.batch_size} requests * "
                f"{per_request} blocks of {block_size} tokens) but the cache has {num_blocks}; "
                "please choose a smaller batch size or prompt length, or give the cache more "
                "memory (--gpu-memory-utilization, --kv-cache-memory)")
    return None


# --- the engine ---------------------------------------------------------------------------

def add_requests(engine: Engine, prefix: str, settings: ProfileSettings,
                 lengths: dict[int, int], generator: torch.Generator) -> list[str]:
    vocab_size = engine.runner.model.vocab_size
    rids = []
    max_tokens = [length for length, count in lengths.items() for _ in range(count)]
    for i, n in enumerate(max_tokens):
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True)
        prompt = torch.randint(vocab_size, (settings.prompt_len,), generator=generator)
        rids.append(f"{prefix}{i}")
        engine.add_request(rids[-1], prompt.tolist(), params)
    return rids


def warm_up(engine: Engine, settings: ProfileSettings, lengths: dict[int, int],
            generator: torch.Generator) -> None:
    """A prefill and a decode step, then abort: kernels are compiled and caches warm."""
    rids = add_requests(engine, "warmup-", settings, lengths, generator)
    engine.step()
    engine.step()
    for rid in rids:
        engine.abort(rid)
    engine.step()  # collects a step still in flight, so the profile starts from rest


def profile_steps(engine: Engine, num_steps: int, use_cuda: bool) -> list[StepProfile]:
    """Profile `num_steps` engine steps, each on its own. A step's size is its plan's
    (requests, tokens): with the scheduler planning ahead, requests whose last token is
    still on its way are not running any more, though the scheduler still holds them."""
    plans: list[tuple[int, int]] = []
    engine.on_plan = lambda plan: plans.append((len(plan.req_ids),
                                                sum(plan.num_scheduled_tokens)))

    def step() -> tuple[int, int]:
        plans.clear()
        engine.step()
        return plans[-1] if plans else (0, 0)

    ranges = ModuleRanges(engine.runner.model, {"sampler": (engine.runner.sampler, "sample")})
    profiles = [profile_step(step, ranges, use_cuda)]
    for _ in tqdm(range(num_steps - 1), desc="decode steps"):
        profiles.append(profile_step(step, ranges, use_cuda))
    engine.on_plan = None
    return profiles


# --- output -------------------------------------------------------------------------------

def phase_names(num_steps: int) -> list[str]:
    return ["prefill"] + [f"decode_{i}" for i in range(1, num_steps)]


def banner(title: str, settings: ProfileSettings) -> str:
    rule = "=" * LINE_WIDTH
    return (f"{rule}\n= {title} (prompt_len={settings.prompt_len}, "
            f"batch_size={settings.batch_size})\n{rule}\n")


def print_tables(profiles: list[StepProfile], settings: ProfileSettings) -> None:
    shown = [("Prefill", profiles[0])] + ([("First Decode Step", profiles[1])]
                                          if len(profiles) > 1 else [])
    for table in ("model", "summary"):
        for title, prof in shown:
            print(banner(f"{title} {table.title()} Table", settings))
            print(format_phase_table(prof.stats, table))
            print()


def write_csv(profiles: list[StepProfile], base: str) -> None:
    base = base[:-4] if base.endswith(".csv") else base
    shown = [("prefill", profiles[0])] + ([("decode", profiles[1])] if len(profiles) > 1
                                          else [])
    for phase, prof in shown:
        write_model_csv(prof.stats, Path(f"{base}_{phase}_model_table.csv"))
        write_summary_csv(prof.stats, Path(f"{base}_{phase}_summary_table.csv"))


def context_info(settings: ProfileSettings, config: EngineConfig, device: torch.device
                 ) -> dict[str, Any]:
    devices = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {
        "python_version": sys.version,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "device": device.type,
        "cpu": platform.processor() or platform.machine(),
        "cuda_devices": [{"name": d.name, "total_memory": d.total_memory,
                          "capability": f"{d.major}.{d.minor}",
                          "multi_processor_count": d.multi_processor_count} for d in devices],
        **dataclasses.asdict(settings),
        "engine": dataclasses.asdict(config),
    }


def write_json(profiles: list[StepProfile], context: dict[str, Any], path: str) -> None:
    path = path if path.endswith(".json") else path + ".json"
    data: dict[str, Any] = {"context": context}
    for name, prof in zip(phase_names(len(profiles)), profiles):
        data[name] = prof.stats.to_dict()
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def write_traces(profiles: list[StepProfile], folder: str) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, prof in zip(phase_names(len(profiles)), profiles):
        prof.profiler.export_chrome_trace(str(Path(folder) / f"{name}.json"))
    print(f"Chrome traces saved as prefill.json, decode_1.json, ... in {folder}")


# --- the command --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", metavar="BASE", default=None,
                        help="write BASE_prefill_model_table.csv, BASE_prefill_summary_table"
                             ".csv, BASE_decode_model_table.csv and BASE_decode_summary_"
                             "table.csv (the decode tables are of the first decode step)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write every profiled step's tables (prefill, decode_1, ...) "
                             "and the settings to FILE (.json added when missing)")
    parser.add_argument("--save-chrome-traces-folder", metavar="DIR", default=None,
                        help="save each step's Chrome trace as DIR/prefill.json, "
                             "DIR/decode_1.json, ... (open in chrome://tracing or Perfetto)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN_DEFAULT,
                        help="tokens of every random prompt "
                             f"(default {PROMPT_LEN_DEFAULT})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE_DEFAULT,
                        help="requests prefilled together in one step "
                             f"(default {BATCH_SIZE_DEFAULT})")
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    steps = modes.add_parser("run_num_steps", help="profile N engine steps",
                             description="Every request runs N engine steps: the prefill "
                                         "and N-1 decode steps.")
    steps.add_argument("-n", "--num-steps", type=int, required=True,
                       help="engine steps to profile: 1 is the prefill only, 2 adds the "
                            "first decode step, 3 the second, and so on")
    complete = modes.add_parser("run_to_completion",
                                help="profile every step until all requests finish",
                                description="Profile every engine step until the batch is "
                                            "done, K requests finishing at each decode step.")
    complete.add_argument("-n", "--complete-num-requests-per-step", type=int, required=True,
                          help="requests that finish at each decode step: batch 128 with 32 "
                               "runs steps of 128, 128, 96, 64, 32 requests, then a last "
                               "step of 1 request (always added: a lone request's step is "
                               "worth seeing)")
    add_engine_args(parser)
    # module ranges need module code to run: graph replays would leave the tables empty
    parser.set_defaults(enforce_eager=True)
    return parser


def settings_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace
                       ) -> ProfileSettings:
    for name in ("prompt_len", "batch_size", "num_steps", "complete_num_requests_per_step"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    return ProfileSettings(args.prompt_len, args.batch_size, getattr(args, "num_steps", None),
                           getattr(args, "complete_num_requests_per_step", None),
                           args.save_chrome_traces_folder)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_from_args(parser, args)
    try:
        config = engine_config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    configure_logging("profile", level="WARNING")
    steps = requests_per_step(settings)
    lengths = output_lengths(settings.batch_size, steps)
    max_output_len = max(lengths)
    resolved = resolve_engine(config).config
    if error := fit_error(settings, resolved, max_output_len):
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    print("Run profile with:")
    for key, value in dataclasses.asdict(settings).items():
        print(f"  {key} = {value}")
    # each step whole in this thread, inside its profile window
    engine = Engine(config, step_thread=False)
    if error := kv_error(settings, max_output_len, engine.config.block_size,
                         engine.runner.num_blocks):
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(config.seed)
    use_cuda = engine.runner.device.type == "cuda"
    print("Warm up run ...")
    warm_up(engine, settings, lengths, generator)
    print("Profile run ...")
    add_requests(engine, "seq", settings, lengths, generator)
    profiles = profile_steps(engine, len(steps), use_cuda)
    print_tables(profiles, settings)
    if args.csv:
        write_csv(profiles, args.csv)
    if args.json:
        write_json(profiles, context_info(settings, engine.config, engine.runner.device),
                   args.json)
    if settings.save_chrome_traces_folder:
        write_traces(profiles, settings.save_chrome_traces_folder)
    return 0
