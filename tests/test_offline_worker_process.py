"""The offline engine's executor in a worker process (issue 31 item 1), real child processes
on the CPU (where the engine keeps its executor in-process unless told otherwise): the
outputs are the in-line engine's to the token through tensor-parallel and pipeline-parallel
ranks (one rank's, with preemption, stop strings and logprobs, are in
tests/test_offline_overlap.py); a refused model, an executor error and a killed child each reach
the caller as an error, never a hang; and nothing the engine starts outlives it.
tests/test_offline_overlap.py is mostly the same engine with its executor on a step
thread."""

from __future__ import annotations

import gc
import os
import signal
import time

import psutil
import pytest
import torch
from safetensors.torch import save_file

from common.config import ConfigError, EngineConfig
from common.lora import WEIGHTS_FILE
from common.messages import LoRARequest
from common.sampling_params import SamplingParams
from common.token_text import TokenTexts
from services.offline.engine import WORKER_PROCESS_ENV, Engine, uses_worker_process
from services.offline.llm import LLM
from services.offline.steps import ThreadedSteps
from services.offline.worker_process import ProcessSteps
from tests.test_offline_overlap import prompts
from tests.test_offline_overlap_ranks import GREEDY, PROMPTS, SIZES, make_llm, tokens
from tests.tiny_models import make_tiny_model

EXIT_S = 15.0  # for a child and its followers to be gone


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Three layers: two stages split them 2 + 1."""
    return str(make_tiny_model(tmp_path_factory.mktemp("worker"), "llama",
                               num_hidden_layers=3))


@pytest.fixture
def in_child(monkeypatch):
    """Every engine built here runs its executor in a worker process (unless it has no
    step thread: the in-line references)."""
    monkeypatch.setenv(WORKER_PROCESS_ENV, "1")


def child_of(llm: LLM) -> psutil.Process:
    steps = llm.engine.steps
    assert isinstance(steps, ProcessSteps)
    return psutil.Process(steps.process.pid)


def all_gone(processes: list[psutil.Process]) -> bool:
    return not psutil.wait_procs(processes, timeout=EXIT_S)[1]


def children() -> set[psutil.Process]:
    """This process's children (its multiprocessing resource tracker, once the in-process
    ranks of a test started one, among them)."""
    return set(psutil.Process().children())


# long: 70 s on two cores; test_close_with_and_collection_leave_no_process runs two ranks
# in the worker process by default
@pytest.mark.long
@pytest.mark.parametrize("size", SIZES)
def test_ranks_in_the_worker_process_give_the_inline_loops_tokens(tiny, size, in_child):
    """Greedy and seeded: those of the in-line loop at the same size, and greedy ones
    one rank's."""
    with make_llm(tiny, step_thread=False, **SIZES[size]) as inline:
        want = tokens(inline)
    with make_llm(tiny, **SIZES[size]) as llm:
        got = tokens(llm)
        followers = child_of(llm).children(recursive=True)
    assert got == want
    assert got[::2] == tokens_of_one_rank(tiny)
    assert followers and all_gone(followers)


def tokens_of_one_rank(tiny: str) -> list[list[int]]:
    with LLM(tiny, device="cpu", seed=3) as one:
        return tokens(one)[::2]


def test_logprobs_from_the_worker_process_are_the_inline_loops(tiny, in_child):
    """A step's logprobs cross the pipe as columns (common/messages.StepLogprobs) and get
    their texts as they come in: every completion's and prompt's logprobs, with their
    tokens' texts, are the in-line loop's; their values to float32's rounding, as the
    child's CPU matmuls may sum in another order (CI saw the sixth digit move)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    asked = [{"prompt_token_ids": p} for p in PROMPTS]
    with make_llm(tiny, step_thread=False) as inline:
        want = inline.generate(asked, params, use_tqdm=False)
    with make_llm(tiny) as llm:
        assert isinstance(llm.engine.steps, ProcessSteps)
        # read while the child loaded the model: every id it may sample
        assert len(llm.engine.detokenizer.token_text._texts) == llm.engine.info.vocab_size
        got = llm.generate(asked, params, use_tqdm=False)
        spelled = TokenTexts(llm.get_tokenizer())
    for field in ("logprobs", "prompt_logprobs"):
        mine, theirs = ([getattr(o.outputs[0] if field == "logprobs" else o, field)
                         for o in outputs] for outputs in (got, want))
        assert entry_keys(mine) == entry_keys(theirs), field
        assert entry_values(mine) == pytest.approx(entry_values(theirs), rel=1e-5, abs=1e-5)
    entries = [e for o in got for position in o.outputs[0].logprobs for e in position.items()]
    assert len(entries) >= 3 * 8 * len(PROMPTS)
    assert all(lp.decoded_token == spelled(token_id) for token_id, lp in entries)


def entry_keys(logprobs: list) -> list:
    """Each position's ids, ranks and texts, None positions kept (a prompt's first)."""
    return [[None if position is None else
             {i: (lp.rank, lp.decoded_token) for i, lp in position.items()}
             for position in completion] for completion in logprobs]


def entry_values(logprobs: list) -> list[float]:
    return [lp.logprob for completion in logprobs for position in completion
            if position is not None for lp in position.values()]


def test_close_with_and_collection_leave_no_process(tiny, in_child):
    """Each ending lets the worker process (exiting with 0), its tensor-parallel follower
    and the detokenizer process go, so the next engine of the script starts."""
    for ending in ("close", "with", "collection"):
        llm = LLM(tiny, device="cpu", tensor_parallel_size=2)
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        child = child_of(llm)
        processes = [child, *child.children(recursive=True),
                     psutil.Process(llm.engine.detokenizer_process.process.pid)]
        assert len(processes) >= 3  # the follower among them
        process = llm.engine.steps.process
        if ending == "close":
            llm.close()
            llm.close()  # a second close does nothing
        elif ending == "with":
            with llm:
                pass
        else:
            del llm
            gc.collect()
        assert all_gone(processes), ending
        assert process.wait(EXIT_S) == 0, ending


def test_an_engine_dropped_without_close_lets_its_worker_process_go(tiny, in_child):
    engine = Engine(EngineConfig(model=tiny, dtype="float32", device="cpu"),
                    detokenizer_process=False)
    engine.add_request("x", prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    child = psutil.Process(engine.steps.process.pid)
    del engine
    gc.collect()
    assert all_gone([child])


def test_a_killed_worker_process_is_an_error_within_seconds(tiny, in_child):
    llm = LLM(tiny, dtype="float32", device="cpu")
    pid = llm.engine.steps.process.pid
    killed_at = []

    def kill_at_third(plan):
        if plan.step == 3:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
    llm.engine.on_plan = kill_at_third
    with pytest.raises(RuntimeError, match=r"worker process exited \(code -9\)"):
        llm.generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=30),
                     use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 5.0
    with pytest.raises(RuntimeError, match="worker process exited"):  # again, no hang
        llm.engine.step()
    llm.close()


def test_an_executor_error_reaches_the_caller(tiny, in_child, tmp_path):
    """A LoRA adapter whose config the engine accepts but whose weights the worker's step
    refuses: the step fails in the child, and the caller gets its error (again on the
    next step, never a hang); close() ends the child."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    save_file({"not_a_lora_weight": torch.zeros(2)}, str(adapter / WEIGHTS_FILE))
    llm = LLM(tiny, dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    child = child_of(llm)
    with pytest.raises(RuntimeError, match="worker process failed: AdapterError: .*"
                                           "is not a LoRA A/B"):
        llm.generate(prompts(2), GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("bad", 1, str(adapter)))
    with pytest.raises(RuntimeError, match="worker process failed"):
        llm.engine.step()
    llm.close()
    assert all_gone([child])


def test_a_model_the_worker_process_refuses_raises_the_engines_error(tiny):
    """Two ranks on a machine without GPUs pass the engine's checks of the model, and the
    child's executor refuses them: the same ConfigError as an engine without a worker
    process, and the child is gone."""
    config = EngineConfig(model=tiny, device="cuda", tensor_parallel_size=2)
    before = children()
    with pytest.raises(ConfigError, match="needs 2 GPUs") as refused:
        Engine(config, worker_process=True)
    assert "worker process" in str(refused.value.__notes__)
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        Engine(config, worker_process=False)
    assert children() == before


def test_the_default_puts_a_model_on_gpus_in_the_worker_process(tiny, monkeypatch):
    """Where the loop's host work bounds the steps (services/offline/engine.py); the
    environment still decides, and the CPU keeps the model here."""
    monkeypatch.delenv(WORKER_PROCESS_ENV, raising=False)
    stages = {"pipeline_parallel_size": 2}
    assert uses_worker_process(EngineConfig(model=tiny, device="cuda", **stages))
    assert uses_worker_process(EngineConfig(model=tiny, device="cuda"))
    assert not uses_worker_process(EngineConfig(model=tiny, device="cpu", **stages))
    assert not uses_worker_process(EngineConfig(model=tiny, device="cpu"))
    assert not uses_worker_process(EngineConfig(model=tiny, device="cuda", **stages),
                                   step_thread=False)
    monkeypatch.setenv(WORKER_PROCESS_ENV, "0")
    assert not uses_worker_process(EngineConfig(model=tiny, device="cuda", **stages))
    assert not uses_worker_process(EngineConfig(model=tiny, device="cuda"))
    monkeypatch.setenv(WORKER_PROCESS_ENV, "1")
    assert uses_worker_process(EngineConfig(model=tiny, device="cpu"))


def test_the_environment_picks_the_mode_and_the_default_keeps_the_model_here(tiny,
                                                                             monkeypatch):
    config = EngineConfig(model=tiny, dtype="float32", device="auto")
    monkeypatch.delenv(WORKER_PROCESS_ENV, raising=False)
    before = children()
    engine = Engine(config, detokenizer_process=False)
    assert isinstance(engine.steps, ThreadedSteps) and engine.runner is not None
    assert children() == before  # no child by default
    engine.close()
    monkeypatch.setenv(WORKER_PROCESS_ENV, "1")
    engine = Engine(config, detokenizer_process=False)
    assert isinstance(engine.steps, ProcessSteps)
    assert engine.scheduler.config.num_blocks > 0  # the child's
    with pytest.raises(RuntimeError, match="worker process; pass worker_process=False"):
        engine.runner
    engine.close()
    monkeypatch.setenv(WORKER_PROCESS_ENV, "0")
    engine = Engine(config, detokenizer_process=False)
    assert isinstance(engine.steps, ThreadedSteps)
    engine.close()
    monkeypatch.setenv(WORKER_PROCESS_ENV, "yes")
    with pytest.raises(ConfigError, match=f"{WORKER_PROCESS_ENV}='yes'"):
        Engine(config)
    with pytest.raises(ValueError, match="step_thread=False"):
        Engine(config, step_thread=False, worker_process=True)
