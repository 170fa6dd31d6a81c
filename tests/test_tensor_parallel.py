"""Tensor parallelism on the CPU, gloo ranks in real processes: each rank reads only its
shard; every position's logits equal one rank's and transformers'; greedy tokens through
the offline API equal one rank's. The Redis pipeline at two ranks is
tests/test_tensor_parallel_serve.py."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections import Counter
from contextvars import ContextVar
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.model_files import load_hf_config
from common.model_info import check_tensor_parallel
from common.sampling_params import SamplingParams
from services import LLM
from services.worker.layers import parallel
from services.worker.layers.checkpoint import CheckpointSlice
from services.worker.loader import load_model
from tests.test_models import Paged, rel_err, token_ids
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")
TOLERANCE = 1e-4  # against transformers, as in tests/test_models.py
SAME_AS_ONE_RANK = 1e-5  # the largest logit difference to the single-rank model


# --- loading: rank 1 of 2, in this process ----------------------------------------------

def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    """The layers built next, for the rest of the test, take rank `rank` of `size`, with no
    process group."""
    monkeypatch.setattr(parallel, "_BUILDING",
                        ContextVar("tp_group", default=parallel.TPGroup(rank, size)))


def count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Elements read from safetensors files, whole tensors and shards apart."""
    read: Counter = Counter()
    narrow, whole = CheckpointSlice.narrow, CheckpointSlice.read

    def counted_narrow(self, dim, start, length):
        out = narrow(self, dim, start, length)
        read["shards"] += out.numel()
        return out

    def counted_read(self):
        out = whole(self)
        read["whole"] += out.numel()
        return out
    monkeypatch.setattr(CheckpointSlice, "narrow", counted_narrow)
    monkeypatch.setattr(CheckpointSlice, "read", counted_read)
    return read


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_a_rank_reads_only_its_shard_of_the_checkpoint(arch, tmp_path, monkeypatch):
    """qwen2 has q/k/v biases and a tied LM head; llama an untied one; phi3 fused qkv_proj
    and gate_up_proj tensors, of which a rank reads only its rows. The tiny vocabulary
    splits evenly, so a rank holds no padding rows."""
    model_dir = make_tiny_model(tmp_path, arch)
    hf_config = load_hf_config(model_dir)
    config = EngineConfig(model=str(model_dir), dtype="float32")
    read = count_reads(monkeypatch)
    whole = load_model(config, hf_config, CPU, torch.float32)
    assert read["shards"] + read["whole"] == sum(p.numel() for p in whole.parameters())

    read.clear()
    as_rank(monkeypatch, 1, 2)
    shard = load_model(config, hf_config, CPU, torch.float32)
    norms = sum(p.numel() for n, p in shard.named_parameters() if "norm" in n)
    # the norms and the row-parallel biases are whole on every rank; nothing else is
    assert read["whole"] == norms + sum(p.numel() for n, p in shard.named_parameters()
                                        if "o_proj.bias" in n or "down_proj.bias" in n)
    assert read["shards"] + read["whole"] == sum(p.numel() for p in shard.parameters())
    assert read["shards"] + read["whole"] < 0.6 * sum(p.numel() for p in whole.parameters())


def test_sizes_that_do_not_split_the_model_are_refused():
    smollm = type("Config", (), dict(num_attention_heads=9, num_key_value_heads=3,
                                     intermediate_size=1536))
    check_tensor_parallel(smollm, 3)
    for size in (2, 4, 6):
        with pytest.raises(ConfigError, match=f"--tensor-parallel-size {size} does not split"):
            check_tensor_parallel(smollm, size)
    llama8b = type("Config", (), dict(num_attention_heads=32, num_key_value_heads=8,
                                      intermediate_size=14336))
    for size in (1, 2, 4, 8, 16):  # 16 ranks replicate each KV head twice
        check_tensor_parallel(llama8b, size)
    with pytest.raises(ConfigError, match="12 does not split"):
        check_tensor_parallel(llama8b, 12)


# --- logits: gloo ranks against one rank and transformers -------------------------------

def rank_logits(rank: int, world: int, init_file: str, model_dirs: list[str],
                load_format: str, ids: list[int], results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for model_dir in model_dirs:
            results.put((rank, model_dir, *logits_of(model_dir, load_format, ids, world)))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # every result is in the pipe
    # skip the interpreter's teardown, which a CI run saw abort in both ranks after their
    # results were in ("terminate called without an active exception", SIGABRT)
    os._exit(0)


def logits_of(model_dir: str, load_format: str, ids: list[int], world: int = 1
              ) -> tuple[int, object]:
    """One prefill's logits at every position (numpy: a tensor would share its storage
    with a process about to exit), and the KV heads the rank holds."""
    hf_config = load_hf_config(model_dir)
    config = EngineConfig(model=model_dir, tensor_parallel_size=world,
                          load_format=load_format)
    with parallel.building_for(world_group(world)):
        model = load_model(config, hf_config, CPU, torch.float32)
    paged = Paged(model, hf_config, block_size=4, tp_size=world)
    (logits,) = paged.step([(paged.blocks(len(ids)), ids, 0)])
    return model.num_kv_heads, logits.numpy()


def world_group(world: int) -> parallel.TPGroup:
    """The ranks' group: torch.distributed's world, or a group of one."""
    import torch.distributed as dist

    return parallel.TPGroup.of(dist.group.WORLD) if world > 1 else parallel.TPGroup()


def run_ranks(world: int, model_dirs: list[Path], load_format: str, ids: list[int],
              tmp_path: Path) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_logits, args=(rank, world, str(tmp_path / "init"),
                                                   [str(d) for d in model_dirs],
                                                   load_format, ids, results))
             for rank in range(world)]
    for p in procs:
        p.start()
    out = {}
    for rank, model_dir, num_kv_heads, logits in collect(results, procs,
                                                         world * len(model_dirs)):
        out[(rank, model_dir)] = (num_kv_heads, torch.from_numpy(logits))
    return out


def collect(results, procs: list, count: int, timeout_s: float = 120) -> list:
    """`count` results of rank processes, failing as soon as one of them does; then every
    rank's clean exit."""
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        assert time.monotonic() < deadline, "tensor-parallel ranks timed out"
        try:
            out.append(results.get(timeout=1))
        except queue.Empty:
            assert all(p.exitcode in (None, 0) for p in procs), "a rank failed"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


@pytest.mark.parametrize("world,archs,kv_heads,load_format", [
    (2, ["llama", "qwen2", "qwen3"], 1, "auto"),
    (2, ["llama", "qwen3"], 1, "dummy"),
    (2, ["gemma2", "phi3", "mistral-window", "qwen2-window"], 1, "auto"),
    (4, ["qwen3"], 1, "auto")])
def test_every_rank_has_the_logits_of_one_rank(world, archs, kv_heads, load_format,
                                               tmp_path):
    """At every position, to 1e-5; and transformers' from the checkpoint. Dummy weights are
    the same model at any size. With 4 ranks and 2 KV heads each KV head is replicated on
    two ranks. gemma2: its norms after o_proj and down_proj take all-reduced inputs, with
    soft caps and sliding windows per rank's heads; phi3: fused checkpoint tensors split
    per rank, a sliding window; mistral and qwen2 with windows of 8 (the prompt
    is 19 tokens)."""
    from transformers import AutoModelForCausalLM

    dirs = [make_tiny_model(tmp_path / arch, arch) for arch in archs]
    ids = token_ids(19, seed=8)
    out = run_ranks(world, dirs, load_format, ids, tmp_path)
    for model_dir in dirs:
        _, one_rank = logits_of(str(model_dir), load_format, ids)
        one_rank = torch.from_numpy(one_rank)
        if load_format == "auto":
            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                assert rel_err(one_rank, ref(torch.tensor([ids])).logits[0]) < TOLERANCE
        for rank in range(world):
            num_kv_heads, logits = out[(rank, str(model_dir))]
            assert num_kv_heads == kv_heads
            difference = (logits - one_rank).abs().max().item()
            assert difference <= SAME_AS_ONE_RANK, (model_dir.name, rank, difference)


# --- the offline API --------------------------------------------------------------------

PROMPTS = [token_ids(n, seed=n) for n in (5, 17, 3, 40)]


def generate_each(model_dir: Path, size: int, each: list[SamplingParams],
                  **engine_args) -> list[list[list[int]]]:
    """The tokens of PROMPTS under each of `each` in turn, from one engine."""
    with LLM(str(model_dir), tensor_parallel_size=size, device="cpu", seed=3,
             **engine_args) as llm:
        return [[o.outputs[0].token_ids
                 for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                       use_tqdm=False)]
                for params in each]


def generate(model_dir: Path, size: int, params: SamplingParams,
             **engine_args) -> list[list[int]]:
    return generate_each(model_dir, size, [params], **engine_args)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_offline_api_at_two_ranks_gives_one_ranks_tokens(arch, tmp_path):
    """Greedy, and seeded sampling: the ranks draw alike, or their KV caches would part.
    One engine of each size runs both, one after the other (the second from a warm prefix
    cache on both sizes)."""
    model_dir = make_tiny_model(tmp_path, arch)
    each = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)]
    two, one = generate_each(model_dir, 2, each), generate_each(model_dir, 1, each)
    for params, tokens, expected in zip(each, two, one):
        assert tokens == expected, params


def test_an_fp8_kv_cache_at_two_ranks_gives_one_ranks_tokens(tmp_path):
    """Each rank's cache holds its heads in fp8 with the same per-layer scales."""
    model_dir = make_tiny_model(tmp_path, "llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert generate(model_dir, 2, params, kv_cache_dtype="fp8") == \
        generate(model_dir, 1, params, kv_cache_dtype="fp8")


def test_calculated_kv_scales_at_two_ranks_give_one_ranks_tokens(tmp_path):
    """--calculate-kv-scales: each rank sees only its KV heads, and the ranks agree on the
    largest value, so the scales, and the tokens, are one rank's."""
    model_dir = make_tiny_model(tmp_path, "llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert generate(model_dir, 2, params, kv_cache_dtype="fp8", calculate_kv_scales=True) == \
        generate(model_dir, 1, params, kv_cache_dtype="fp8", calculate_kv_scales=True)


def embed(model_dir: Path, size: int) -> torch.Tensor:
    with LLM(str(model_dir), tensor_parallel_size=size, device="cpu", seed=3,
             pooling_type="MEAN", max_num_batched_tokens=16, max_num_seqs=4) as llm:
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_embeddings_at_two_ranks_are_one_ranks(tmp_path):
    """The final norm's output is whole on every rank: rank 0 pools it alone, over chunks."""
    model_dir = make_tiny_model(tmp_path, "llama")
    torch.testing.assert_close(embed(model_dir, 2), embed(model_dir, 1),
                               atol=SAME_AS_ONE_RANK, rtol=0)


def test_an_engine_of_another_size_waits_for_the_group_to_close(tmp_path):
    """Until the LLM is collected: then its follower and its process group are gone. A
    model built meanwhile outside the executor is whole: layers take the group they are
    built for, not torch.distributed's world."""
    import gc

    import torch.distributed as dist

    model_dir = make_tiny_model(tmp_path, "llama")
    hf_config = load_hf_config(model_dir)
    llm = LLM(str(model_dir), tensor_parallel_size=2, device="cpu")
    followers = llm.engine.executor.followers.processes
    with pytest.raises(RuntimeError, match="close its engine first"):
        LLM(str(model_dir), device="cpu")
    whole = load_model(EngineConfig(model=str(model_dir)), hf_config, CPU, torch.float32)
    assert whole.num_kv_heads == hf_config.num_key_value_heads == 2
    del llm
    gc.collect()
    assert not dist.is_initialized() and all(p.exitcode == 0 for p in followers)
    LLM(str(model_dir), device="cpu")


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_tensor_parallel_llms_one_after_another_give_one_ranks_tokens(tmp_path):
    """close(), then a `with` block: each lets its follower and its process group go, so
    the next tensor-parallel LLM of the script starts (it raised "a tensor-parallel group
    is open" before LLM could be closed)."""
    import torch.distributed as dist

    model_dir = str(make_tiny_model(tmp_path, "qwen3"))
    with LLM(model_dir, device="cpu", seed=3) as one:
        want = greedy_tokens(one)
    first = LLM(model_dir, tensor_parallel_size=2, device="cpu", seed=3)
    followers = first.engine.executor.followers.processes
    assert greedy_tokens(first) == want
    first.close()
    first.close()  # a second close does nothing
    assert not dist.is_initialized() and all(p.exitcode == 0 for p in followers)
    with LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=1,
             data_parallel_size=1, device="cpu", seed=3) as second:
        followers = second.engine.executor.followers.processes
        assert greedy_tokens(second) == want
    assert not dist.is_initialized() and all(p.exitcode == 0 for p in followers)


def test_parallel_sizes_one_engine_cannot_run_are_refused(tmp_path):
    """As vLLM's LLM takes them; refused before any model loads (the directory is empty).
    Pipeline stages are tests/test_pipeline_parallel.py's."""
    with pytest.raises(ValueError, match=r"^data_parallel_size=2: an LLM is one engine"):
        LLM(str(tmp_path), tensor_parallel_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"^--pipeline-parallel-size must be positive"):
        LLM(str(tmp_path), pipeline_parallel_size=0)


# --- peer-memory all-reduce: two GPUs only ----------------------------------------------

def on_gpu_rank(rank: int, init_file: str, results, body) -> None:
    """Rank `rank` of an NCCL group of two with peer-memory all-reduces set up for 512
    rows of 4096: puts `body(group, device)`'s numpy arrays in `results`."""
    import torch.distributed as dist

    from services.worker.ranks import leave_group

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    device = torch.device("cuda", rank)
    group = parallel.TPGroup.of(dist.group.WORLD)
    try:
        assert group.use_peer_all_reduce(512, HIDDEN, torch.bfloat16, device)
        out = body(group, device)
        torch.cuda.synchronize()
        results.put((rank, [[t.float().cpu().numpy() for t in row] for row in out]))
        dist.barrier()
    finally:
        leave_group(group)


def on_two_gpus(body, tmp_path: Path) -> dict[int, list]:
    """Each rank's rows of tensors from `body(group, device)` (a module-level function)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=on_gpu_rank, args=(rank, str(tmp_path / "init"), results,
                                                   body))
             for rank in range(2)]
    for p in procs:
        p.start()
    return dict(collect(results, procs, 2))


HIDDEN = 4096


def nccl_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    x = x.clone()
    dist.all_reduce(x)
    return x


def peer_sums(group: parallel.TPGroup, device: torch.device
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sums of every message size through peer memory and through NCCL, eagerly and
    replayed from a CUDA graph with new inputs each time."""
    generator = torch.Generator(device).manual_seed(device.index)
    out = []
    for numel in (1, HIDDEN, 7 * HIDDEN, 512 * HIDDEN):  # 1: too short, NCCL's
        x = torch.randn(numel, generator=generator, device=device, dtype=torch.bfloat16)
        out.append((group.all_reduce(x.clone()), nccl_sum(x)))
    static = torch.zeros(HIDDEN, dtype=torch.bfloat16, device=device)
    group.all_reduce(static.clone())  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        summed = group.all_reduce(static)
    for _ in range(3):
        static.copy_(torch.randn(HIDDEN, generator=generator, device=device,
                                 dtype=torch.bfloat16))
        graph.replay()
        out.append((summed.clone(), nccl_sum(static)))
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_peer_all_reduce_sums_like_nccl(tmp_path):
    sums = on_two_gpus(peer_sums, tmp_path)
    for rank in range(2):
        assert len(sums[rank]) == 7
        for peer, nccl in sums[rank]:
            torch.testing.assert_close(torch.from_numpy(peer), torch.from_numpy(nccl),
                                       rtol=1.6e-2, atol=1e-2)
        assert all((a == b).all() for (a, _), (b, _) in zip(sums[0], sums[1]))


def fused_norms(group: parallel.TPGroup, device: torch.device
                ) -> list[tuple[torch.Tensor, ...]]:
    """The all-reduce fused with the residual add and RMSNorm, against its torch twin on
    every rank's parts (gathered through NCCL): eagerly for several row counts (more rows
    than programs among them), then replayed from a CUDA graph with new inputs, between
    bare all-reduces. Rows of (normed, residual, twin's normed, twin's residual)."""
    import torch.distributed as dist

    from kernels.all_reduce import all_reduce_rms_norm_ref
    from kernels.norm import rms_norm_ref

    eps = 1e-5
    shared = torch.Generator(device).manual_seed(7)  # the same on both ranks
    own = torch.Generator(device).manual_seed(device.index)

    def draw(rows: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(rows, HIDDEN, generator=generator, device=device,
                           dtype=torch.bfloat16)

    def twin(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(parts, x)
        return all_reduce_rms_norm_ref(parts, residual, weight, eps)
    weight = draw(1, shared)[0]
    out = []
    for rows in (1, 7, 64, 100, 512):
        x, residual = draw(rows, own), draw(rows, shared)
        out.append((*group.all_reduce_rms_norm(x, residual, weight, eps),
                    *twin(x, residual)))
    x, residual = draw(16, own), draw(16, shared)
    group.all_reduce_rms_norm(x, residual, weight, eps)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = group.all_reduce_rms_norm(x, residual, weight, eps)
        bare = group.all_reduce(first[0])
        second = group.all_reduce_rms_norm(bare, first[1], weight, eps)
    for _ in range(3):
        x.copy_(draw(16, own))
        residual.copy_(draw(16, shared))
        graph.replay()
        out.append((first[0].clone(), first[1].clone(), *twin(x, residual)))
        # both ranks hold the same normed rows: bare is twice them, its sum four times
        out.append((second[0].clone(), second[1].clone(),
                    *rms_norm_ref(first[0] * 4, weight, eps, first[1])))
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_fused_all_reduce_and_norm_matches_its_twin(tmp_path):
    outs = on_two_gpus(fused_norms, tmp_path)
    for rank in range(2):
        assert len(outs[rank]) == 5 + 2 * 3
        for normed, residual, want_normed, want_residual in outs[rank]:
            torch.testing.assert_close(torch.from_numpy(residual),
                                       torch.from_numpy(want_residual), rtol=0, atol=0)
            torch.testing.assert_close(torch.from_numpy(normed),
                                       torch.from_numpy(want_normed), rtol=1.6e-2, atol=1e-2)
    for a, b in zip(outs[0], outs[1]):  # every rank holds the same rows
        assert all((x == y).all() for x, y in zip(a[:2], b[:2]))
