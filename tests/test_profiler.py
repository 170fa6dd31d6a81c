"""The layerwise profiler: the seed's step arithmetic and error checks, the event tree ->
tables core on real CPU profiles (a small module, then the engine on a tiny Llama) and on a
hand-built tree with CUDA kernels, and the three commands end to end."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.autograd import DeviceType

from benchmarks.profiler import plot, run, table
from benchmarks.profiler.layerwise import (PYTHON_ROW, REST_OF_STEP, STEP_RANGE, Kernel,
                                           ModelRow, ModuleRanges, PhaseStats, device_work,
                                           phase_stats, profile_step)
from benchmarks.profiler.run import (ProfileSettings, fit_error, kv_error, output_lengths,
                                     requests_per_step)
from common.config import EngineConfig
from tests.conftest import run_command
from tests.tiny_models import make_tiny_model

# --- which requests run how long ---------------------------------------------------------------


def test_the_seeds_example():
    settings = ProfileSettings(prompt_len=8, batch_size=128, complete_num_requests_per_step=32)
    steps = requests_per_step(settings)
    assert steps == [128, 128, 96, 64, 32, 1]
    assert output_lengths(128, steps) == {2: 32, 3: 32, 4: 32, 5: 31, 6: 1}


def test_run_num_steps_gives_every_request_the_same_length():
    steps = requests_per_step(ProfileSettings(prompt_len=8, batch_size=4, num_steps=3))
    assert steps == [4, 4, 4]
    assert output_lengths(4, steps) == {3: 4}
    assert output_lengths(1, [1]) == {1: 1}  # the prefill alone


@pytest.mark.parametrize("batch, per_step, steps, lengths", [
    (4, 2, [4, 4, 2, 1], {4: 1, 3: 1, 2: 2}),
    (5, 2, [5, 5, 3, 1], {4: 1, 3: 2, 2: 2}),  # the last drop already leaves one request
    (3, 8, [3, 3, 1], {3: 1, 2: 2}),  # more per step than the batch
    (1, 1, [1, 1], {2: 1}),
])
def test_run_to_completion(batch, per_step, steps, lengths):
    settings = ProfileSettings(prompt_len=8, batch_size=batch,
                               complete_num_requests_per_step=per_step)
    assert requests_per_step(settings) == steps
    assert output_lengths(batch, steps) == lengths


def resolved(**overrides) -> EngineConfig:
    values = dict(model="m", max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=8)
    return EngineConfig(**{**values, **overrides})


def test_the_seeds_three_checks():
    ok = ProfileSettings(prompt_len=128, batch_size=8, num_steps=2)
    assert fit_error(ok, resolved(), max_output_len=2) is None
    too_many_tokens = fit_error(ProfileSettings(prompt_len=129, batch_size=8), resolved(), 2)
    assert "batch_size * prompt_len (8 * 129 = 1032)" in too_many_tokens
    assert "max_num_batched_tokens (1024)" in too_many_tokens
    too_many_seqs = fit_error(ProfileSettings(prompt_len=8, batch_size=9), resolved(), 2)
    assert "batch_size (9) is larger than max_num_seqs (8)" in too_many_seqs
    too_long = fit_error(ProfileSettings(prompt_len=500, batch_size=1), resolved(), 13)
    assert "prompt_len + max_output_len (500 + 13 = 513)" in too_long
    assert "max_model_len (512)" in too_long


def test_the_batch_must_fit_the_kv_cache():
    settings = ProfileSettings(prompt_len=30, batch_size=4, num_steps=3)
    assert kv_error(settings, 3, block_size=16, num_blocks=12) is None  # 33 tokens: 3 blocks
    error = kv_error(settings, 3, block_size=16, num_blocks=11)
    assert "needs 12 KV cache blocks" in error and "has 11" in error


# --- the core on a real profile of a small module --------------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.shared = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.shared(self.block(x)))


def test_model_and_summary_tables_of_a_real_profile():
    net, x = Net(), torch.randn(16, 32)
    ranges = ModuleRanges(net)
    stats = profile_step(lambda: (net(x), (3, 16))[1], ranges, use_cuda=False).stats
    assert stats.num_running_requests == 3 and stats.num_tokens == 16
    root, rest = stats.model
    assert (root.path, root.module, root.invocations) == ("", "Net", 1)
    assert rest.path == REST_OF_STEP
    block, shared = root.children
    assert (block.path, block.module, block.invocations) == ("block", "Block", 1)
    assert (shared.path, shared.module, shared.invocations) == ("shared", "Linear", 2)
    assert [(c.path, c.invocations) for c in block.children] == [("block.proj", 1)]
    # CPU time nests: a module's range holds its callees'
    for parent in (root, block):
        assert parent.cpu_time_us >= sum(c.cpu_time_us for c in parent.children) > 0
    assert root.cpu_time_us + rest.cpu_time_us == pytest.approx(stats.cpu_time_us)
    assert stats.cuda_time_us == 0 and all(r.cuda_time_us == 0 for r in stats.summary)
    names = {r.name: r for r in stats.summary}
    assert names["aten::addmm"].invocations == 3 and names["aten::addmm"].kind == "op"
    assert names[PYTHON_ROW].kind == "python"
    assert sum(r.pct_cpu_time for r in stats.summary) == pytest.approx(100.0)
    assert sum(r.cpu_time_us for r in stats.summary) == pytest.approx(stats.cpu_time_us)


def test_ranges_come_off_after_the_step():
    net, x = Net(), torch.randn(2, 32)
    sampler = Counter()
    ranges = ModuleRanges(net, {"sampler": (sampler, "sample")})
    profile_step(lambda: (net(x), sampler.sample(), (1, 1))[2], ranges, False)
    assert "sample" not in vars(sampler) and sampler.calls == 1
    assert not net._forward_pre_hooks and not net.block.proj._forward_hooks
    stats = profile_step(lambda: (sampler.sample(), (1, 1))[1], ranges, False).stats
    assert [r.path for r in stats.model] == ["sampler", REST_OF_STEP]
    assert stats.model[0].module == "Counter"


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def sample(self) -> None:
        self.calls += 1


# --- the core on a tree with CUDA kernels (the GPU path, without a GPU) ------------------------

@dataclass
class Event:
    name: str
    cpu_time_total: float
    self_cpu_time_total: float
    is_user_annotation: bool = False
    device_type: DeviceType = DeviceType.CPU
    cpu_children: list[Event] = field(default_factory=list)
    id: int = 0


def test_kernels_are_charged_to_the_modules_that_launched_them():
    # an aten op launching a GEMM through cuLaunchKernelEx (correlation id 900), and a
    # Triton kernel launched straight from a module's forward (id 901); the aten op's own
    # id is 901 too, as ids of ops and of runtime calls come from different counters
    gemm = Event("cuLaunchKernelEx", 10, 10, id=900)
    mm = Event("aten::mm", 30, 20, cpu_children=[gemm], id=901)
    triton = Event("cuLaunchKernelEx", 8, 8, id=901)
    inner = Event("block", 15, 7, True, cpu_children=[triton])
    model = Event("Net", 80, 35, True, cpu_children=[mm, inner])
    memcpy = Event("cudaMemcpyAsync", 6, 6, id=902)
    step = Event(STEP_RANGE, 100, 14, True, cpu_children=[model, memcpy])
    launches = {900: [Kernel("sm90_gemm", 50)], 901: [Kernel("_rms_norm_kernel", 10)],
                902: [Kernel("Memcpy HtoD", 5)]}
    modules = {"Net": ("", "Net"), "block": ("block", "Block")}
    # on a GPU every range also leaves a twin on the device's timeline
    gpu_step = Event(STEP_RANGE, 0, 0, True, DeviceType.CUDA)
    stats = phase_stats([step, gpu_step, mm, gemm], launches, modules,
                        num_running_requests=2, num_tokens=2)
    assert stats.cuda_time_us == 65 and stats.cpu_time_us == 100
    net, rest = stats.model
    assert (net.cuda_time_us, net.cpu_time_us) == (60, 80)
    assert (net.children[0].cuda_time_us, net.children[0].cpu_time_us) == (10, 15)
    assert (rest.cuda_time_us, rest.cpu_time_us) == (5, 20)
    rows = {r.name: r for r in stats.summary}
    assert stats.summary[0].name == "sm90_gemm"  # the most CUDA time first
    assert rows["sm90_gemm"].pct_cuda_time == pytest.approx(100 * 50 / 65)
    assert rows["_rms_norm_kernel"].invocations == 1
    assert rows["cuLaunchKernelEx"].cpu_time_us == 18
    assert rows[PYTHON_ROW].cpu_time_us == 14 + 35 + 7
    assert sum(r.cpu_time_us for r in stats.summary) == 100
    assert sum(r.pct_cuda_time for r in stats.summary) == pytest.approx(100.0)
    again = PhaseStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again == stats


@dataclass
class RawEvent:
    """The methods device_work reads of torch's raw (kineto) events."""
    event_name: str
    device: DeviceType
    correlation: int
    start: int
    end: int
    annotation: bool = False

    def name(self) -> str:
        return self.event_name

    def device_type(self) -> DeviceType:
        return self.device

    def correlation_id(self) -> int:
        return self.correlation

    def start_ns(self) -> int:
        return self.start

    def end_ns(self) -> int:
        return self.end

    def is_user_annotation(self) -> bool:
        return self.annotation


def test_device_work_by_correlation_id():
    raw = [RawEvent("cuLaunchKernelEx", DeviceType.CPU, 7, 0, 1000),
           RawEvent("_rms_norm_kernel", DeviceType.CUDA, 7, 5000, 7500),
           RawEvent("model.layers.0.mlp", DeviceType.CUDA, 3, 5000, 9000, annotation=True),
           RawEvent("Memset (Device)", DeviceType.CUDA, 8, 9000, 9500)]
    assert device_work(raw) == {7: [Kernel("_rms_norm_kernel", 2.5)],
                                8: [Kernel("Memset (Device)", 0.5)]}


def test_a_profile_needs_one_step_range():
    with pytest.raises(ValueError, match="expected one 'engine_step' range"):
        phase_stats([Event("aten::mm", 1, 1)], {}, {})


# --- the commands on the engine ---------------------------------------------------------------

BATCH, PROMPT = 4, 16


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """`headrace profile` of a tiny Llama, run to completion two requests per step."""
    root = tmp_path_factory.mktemp("profile")
    model = make_tiny_model(root, "llama")
    code = run.main(["--model", str(model), "--prompt-len", str(PROMPT), "--batch-size",
                     str(BATCH), "--csv", str(root / "tiny.csv"), "--json",
                     str(root / "tiny"), "--save-chrome-traces-folder", str(root / "traces"),
                     "--num-gpu-blocks-override", "64", "--device", "cpu",
                     "run_to_completion", "-n", "2"])
    assert code == 0
    return root, model


def test_profile_writes_every_step(profiled, capsys):
    root, _ = profiled
    data = json.loads((root / "tiny.json").read_text())
    phases = ["prefill", "decode_1", "decode_2", "decode_3"]
    assert list(data) == ["context"] + phases
    # steps of 4, 4, 2 and 1 requests: the planned output lengths held in the engine
    assert [data[p]["num_running_requests"] for p in phases] == [4, 4, 2, 1]
    assert [data[p]["num_tokens"] for p in phases] == [BATCH * PROMPT, 4, 2, 1]
    context = data["context"]
    assert context["batch_size"] == BATCH and context["prompt_len"] == PROMPT
    assert context["complete_num_requests_per_step"] == 2 and context["device"] == "cpu"
    assert context["engine"]["enforce_eager"] is True
    assert context["torch_version"] == torch.__version__ and context["cuda_devices"] == []
    for phase in phases:
        stats = PhaseStats.from_dict(data[phase])
        assert stats.cpu_time_us > 0 and stats.cuda_time_us == 0
        assert [r.path for r in stats.model] == ["", "lm_head", "sampler", REST_OF_STEP]


def test_profile_of_two_ranks_profiles_rank_0(profiled, tmp_path):
    _, model = profiled
    result = run_command("profile", "--model", str(model), "--prompt-len", str(PROMPT),
                         "--batch-size", "2", "--json", str(tmp_path / "tp2"),
                         "--num-gpu-blocks-override", "64", "--device", "cpu",
                         "--tensor-parallel-size", "2", "run_num_steps", "-n", "2",
                         timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "tp2.json").read_text())
    assert data["context"]["engine"]["tensor_parallel_size"] == 2
    stats = PhaseStats.from_dict(data["decode_1"])
    assert [r.path for r in stats.model] == ["", "lm_head", "sampler", REST_OF_STEP]


def test_the_engines_model_table(profiled):
    root, _ = profiled
    stats = PhaseStats.from_dict(json.loads((root / "tiny.json").read_text())["decode_1"])
    model = stats.model[0]
    assert model.module == "LlamaForCausalLM"
    (inner,) = model.children
    assert [c.path for c in inner.children] == ["model.embed_tokens", "model.layers.0",
                                                "model.layers.1", "model.norm"]
    for layer in inner.children[1:3]:
        assert layer.invocations == 1 and layer.module == "LlamaDecoderLayer"
        attn = next(c for c in layer.children if c.module == "LlamaAttention")
        # rotary runs inside the attention's fused input kernel (kernels/attention_inputs.py)
        assert f"{attn.path}.attn" in [c.path for c in attn.children]
    rows = list(table.model_rows(stats))
    assert rows[0][2] == "LlamaForCausalLM"
    assert [(d, name) for d, _, name in rows[2:4]] == [(2, "embed_tokens"), (2, "layers.0")]


def test_csv_files_and_chrome_traces(profiled):
    root, _ = profiled
    for phase in ("prefill", "decode"):
        model_csv = (root / f"tiny_{phase}_model_table.csv").read_text().splitlines()
        assert model_csv[0].startswith("depth,path,module,cuda_time_us")
        assert model_csv[1].startswith("0,LlamaForCausalLM,LlamaForCausalLM,")
        summary_csv = (root / f"tiny_{phase}_summary_table.csv").read_text().splitlines()
        assert summary_csv[0] == ",".join(table.SUMMARY_COLUMNS)
    for name in ("prefill", "decode_1", "decode_2", "decode_3"):
        trace = json.loads((root / "traces" / f"{name}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"model.layers.1.mlp", STEP_RANGE, "sampler"} <= names


def test_profile_table_command(profiled, capsys):
    root, _ = profiled
    trace = str(root / "tiny.json")
    assert table.main(["--json-trace", trace, "--phase", "decode_2", "--table", "model"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == table.MODEL_COLUMNS
    assert any(line.startswith("    layers.1 ") for line in out)
    assert table.main(["--json-trace", trace, "--phase", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "aten::mm" in out and PYTHON_ROW in out
    assert table.main(["--json-trace", trace, "--phase", "decode_9"]) == 2
    assert "decode_3" in capsys.readouterr().err


def test_profile_plot_command(profiled, tmp_path, capsys):
    root, _ = profiled
    trace = str(root / "tiny.json")
    out = tmp_path / "plots"
    assert plot.main(["--json-trace", trace, "--output-directory", str(out),
                      "--plot-metric", "pct_cpu_time"]) == 0
    for name in ("modules_pct_cpu_time.png", "ops_pct_cpu_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.main(["--json-trace", trace, "--output-directory", str(out),
                      "--plot-metric", "pct_cuda_time"]) == 2
    assert "no CUDA time" in capsys.readouterr().err


def test_plot_stacks_add_up(profiled):
    root, _ = profiled
    phases = table.load_phases(root / "tiny.json")
    for by in ("modules", "ops"):
        order, values = plot.stack(phases, "pct_cpu_time", by)
        for name in phases:
            assert sum(values[name].values()) == pytest.approx(100.0, abs=0.01)
        assert len(order) <= plot.MAX_GROUPS
    order, values = plot.stack(phases, "cpu_time_us", "modules")
    assert {"Attention", "Sampler", "RMSNorm", REST_OF_STEP} <= set(order)
    assert sum(values["prefill"].values()) == pytest.approx(phases["prefill"].cpu_time_us)


@pytest.mark.parametrize("name, category", [
    ("aten::mm", "gemm"), ("nvjet_tst_192x8_64x4_2x1_v_bz_TNT", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("_paged_attention_kernel", "attention"), ("_rms_norm_kernel", "norm"),
    ("_silu_and_mul_kernel", "activation"), ("_write_kv_kernel", "kv cache write"),
    ("cudaLaunchKernel", "cuda runtime"), ("aten::sort", "sampling"),
    ("aten::index_select", "copy and index"), ("aten::view", "views"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "elementwise"), (PYTHON_ROW, "python")])
def test_op_categories(name, category):
    assert plot.category(name) == category


def test_profile_refuses_what_does_not_fit(profiled, capsys):
    _, model = profiled
    assert run.main(["--model", str(model), "--prompt-len", "300", "--batch-size", "4",
                     "--max-num-batched-tokens", "1024", "run_num_steps", "-n", "2"]) == 1
    assert "ERROR: chosen batch_size * prompt_len (4 * 300 = 1200)" in capsys.readouterr().err
    assert run.main(["--model", str(model), "--prompt-len", "511",
                     "run_to_completion", "-n", "1"]) == 1  # batch 1: steps [1, 1]
    assert "(511 + 2 = 513) is larger than the model's max_model_len (512)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--model", str(model), "run_num_steps", "-n", "0"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("module", [run, table, plot])
def test_help_describes_every_flag(module, capsys):
    parser = module.build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and action.option_strings[-1] in text, action.dest
    subparsers = [a for a in parser._actions if hasattr(a, "choices") and
                  isinstance(a.choices, dict)]
    for sub in subparsers:
        for mode, sub_parser in sub.choices.items():
            assert mode in text
            assert all(a.help for a in sub_parser._actions if a.option_strings)


def test_model_row_names_relative_to_their_caller():
    parent = ModelRow("model.layers.1.self_attn", "LlamaAttention")
    assert table.display_name(ModelRow("model.layers.1.self_attn.qkv_proj", "Q"),
                              parent) == "qkv_proj"
    assert table.display_name(ModelRow("model.layers.0.self_attn.rotary_emb", "R"),
                              parent) == "model.layers.0.self_attn.rotary_emb"
    assert table.display_name(ModelRow("", "LlamaForCausalLM"), None) == "LlamaForCausalLM"
