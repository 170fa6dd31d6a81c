"""The offline engine's step thread drives tensor-parallel and pipeline-parallel executors
as it drives one rank (issue 31 item 1), gloo ranks on the CPU: the tokens, greedy and
seeded, are the in-line loop's (and greedy ones one rank's), every submit runs on the
step thread, close(), a `with` block and collection leave no follower, thread or process
group, and an executor error reaches the caller with the engine still closable.
tests/test_offline_overlap.py is the same engine at one rank."""

from __future__ import annotations

import functools
import gc
import threading

import pytest
import torch.distributed as dist

from common.sampling_params import SamplingParams
from services.offline import llm as llm_module
from services.offline.engine import Engine
from services.offline.llm import LLM
from services.offline.steps import InlineSteps, ThreadedSteps
from tests.test_models import token_ids
from tests.test_offline_overlap import engine_threads, wait_until
from tests.tiny_models import make_tiny_model

PROMPTS = [token_ids(n, seed=n) for n in (5, 17, 3, 40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
SIZES = {"tp": dict(tensor_parallel_size=2), "pp": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Three layers: two stages split them 2 + 1."""
    return str(make_tiny_model(tmp_path_factory.mktemp("ranks"), "llama",
                               num_hidden_layers=3))


def make_llm(tiny: str, step_thread: bool = True, **sizes) -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_module, "Engine", functools.partial(Engine,
                                                              step_thread=step_thread))
        return LLM(tiny, device="cpu", seed=3, **sizes)


def tokens(llm: LLM) -> list[list[int]]:
    """Greedy and seeded completions of the prompts, in one batch."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           [GREEDY, SEEDED] * 2, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def submitting_threads(llm: LLM) -> set[int]:
    """Records the threads that call the executor's submit from now on."""
    threads: set[int] = set()
    submit = llm.engine.executor.submit

    def recorded(plan):
        threads.add(threading.get_ident())
        return submit(plan)
    llm.engine.executor.submit = recorded
    return threads


def gone(followers: list) -> bool:
    return not dist.is_initialized() and all(p.exitcode == 0 for p in followers)


# long: 130 s of CI; every two-rank and two-stage engine of test_tensor_parallel.py and
# test_pipeline_parallel.py runs on the step thread now and is checked against one rank
@pytest.mark.long
@pytest.mark.parametrize("size", SIZES)
def test_the_step_thread_gives_the_inline_loops_tokens(tiny, size):
    """Greedy and seeded: those of the in-line loop at the same size, and greedy ones
    one rank's. Every submit runs on the step thread."""
    with make_llm(tiny, step_thread=False, **SIZES[size]) as inline:
        assert isinstance(inline.engine.steps, InlineSteps)
        want = tokens(inline)
    with LLM(tiny, device="cpu", seed=3) as one:
        greedy = tokens(one)[::2]
    with make_llm(tiny, **SIZES[size]) as llm:
        assert isinstance(llm.engine.steps, ThreadedSteps)
        threads = submitting_threads(llm)
        got = tokens(llm)
    assert got == want
    assert got[::2] == greedy
    assert threads and threading.get_ident() not in threads


# long: 100 s of CI for what test_tensor_parallel.py's release tests already cover at one
# size; this adds the step thread and the stages (`make test-long` runs it)
@pytest.mark.long
@pytest.mark.parametrize("size", SIZES)
def test_close_with_and_collection_leave_no_follower(tiny, size):
    """Each ending lets the step thread, every follower (exit code 0) and the process
    group go, so the next engine of the script starts."""
    for ending in ("close", "with", "collection"):
        llm = make_llm(tiny, **SIZES[size])
        followers = llm.engine.executor.followers.processes
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert len(engine_threads()) == 2
        if ending == "close":
            llm.close()
        elif ending == "with":
            with llm:
                pass
        else:
            del llm
            gc.collect()
        assert gone(followers), (ending, [p.exitcode for p in followers])
        assert wait_until(lambda: engine_threads() == []), engine_threads()


@pytest.mark.parametrize("size", SIZES)
def test_an_executor_error_reaches_the_caller_and_the_engine_closes(tiny, size):
    """Rank 0 fails inside its third step, after the followers took it: the error is
    raised (again on the next step, never a hang), and close() ends the followers, which
    wait in a collective rank 0 left, and the group."""
    llm = make_llm(tiny, **SIZES[size])
    followers = llm.engine.executor.followers.processes
    runner = llm.engine.runner
    submit, calls = runner.submit, []

    def fail_third(plan):
        calls.append(plan.step)
        if len(calls) == 3:
            raise ValueError("device lost")
        return submit(plan)
    runner.submit = fail_third
    with pytest.raises(ValueError, match="device lost"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="device lost"):
        llm.engine.step()
    llm.close()
    assert not dist.is_initialized() and all(p.exitcode is not None for p in followers)
    assert wait_until(lambda: engine_threads() == []), engine_threads()
