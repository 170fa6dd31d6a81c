"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and kernels/moe.py.

The models against transformers on the same tiny random weights, through the paged cache
(tests/test_models.py's cases, run here on the MoE fixture), at two gloo ranks against one,
with dummy weights, and on CUDA through the engine. The align step on its edge cases; the
routing, align and fused GEMM Triton kernels against their torch twins in the interpreter
(tiny shapes, a subprocess with TRITON_INTERPRET=1, as tests/test_kernels_triton.py does)
and on CUDA at Qwen3-30B-A3B's and Mixtral 8x7B's shapes, and replayed in a CUDA graph; the
fp8 experts' GEMMs (per-channel, static-input and 128x128-block scales) likewise, their
fp8 activations written by the quantization kernel on CUDA only (see kernels/quant.py). The
benchmarks' floor counting the experts read; LoRA and unsplittable sizes refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.model_files import load_hf_config
from common.model_info import check_tensor_parallel, resolve_engine
from kernels.moe import (ExpertScales, MoEBlocks, fused_moe, fused_moe_gemv, fused_moe_ref,
                         fused_moe_triton, max_aligned_rows, moe_align, moe_align_ref,
                         moe_align_triton, moe_blocks, select_experts_ref,
                         select_experts_triton)
from services.worker.layers.moe import FusedMoE
from services.worker.loader import iter_safetensors, load_model, load_weights
from services.worker.models import model_class
from tests.test_models import (  # noqa: F401  (collected here, on this module's fixture)
    Paged, ours_and_reference, rel_err, test_chunked_prefill_through_the_cache,
    test_steps_padded_into_the_graph_buffers_compute_the_same, test_teacher_forced_decode,
    test_varlen_batches_with_shared_prefix_blocks, test_whole_prompt_prefill, token_ids)
from benchmarks.bench.workloads import (ModelShape, StepCost, Trace, experts_read,
                                        reset_experts_read)
from tests.test_bench_engine import run_throughput
from tests.test_tensor_parallel import SAME_AS_ONE_RANK, logits_of, run_ranks
from tests.tiny_models import make_tiny_model, tiny_config

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# fp8 experts against the twin in the same dtype: a sum in another order may round an
# activation to the neighbouring fp8 value (e4m3's 6% steps), now and then
FP8_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --- the models against transformers ------------------------------------------------------

@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny(request, tmp_path_factory):
    """What tests/test_models.py's cases take: our model, its config, transformers'
    logits of a prompt."""
    return ours_and_reference(request.param, tmp_path_factory)


def test_each_architecture_has_its_layers(tiny):
    """Qwen3-MoE's layer 0 is dense (mlp_only_layers), every other layer routed; Qwen2-MoE
    has its shared expert."""
    model, hf_config, _ = tiny
    arch = hf_config.architectures[0]
    for i, layer in enumerate(model.model.layers):
        dense = arch == "Qwen3MoeForCausalLM" and i == 0
        assert hasattr(layer.mlp, "experts") != dense, (arch, i)
        if not dense:
            assert layer.mlp.experts.w13.shape == (8, 64, 64)
            assert (layer.mlp.shared_expert is not None) == (arch == "Qwen2MoeForCausalLM")


# --- loading ----------------------------------------------------------------------------

def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path, "mixtral")
    hf_config = load_hf_config(model_dir)
    model = model_class(hf_config)(hf_config)
    dropped = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    weights = [(n, t) for n, t in iter_safetensors(model_dir) if n != dropped]
    with pytest.raises(ValueError, match=r"lacks 1 weights .*experts\.w13\[\(5, 'up'\)\]"):
        load_weights(model, weights)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_dummy_weights_fill_every_expert_and_repeat(arch):
    """Each expert's part drawn apart: all filled, distinct, and the same on a rebuild."""
    hf_config = tiny_config(arch)
    config = EngineConfig(model="unused", load_format="dummy", dtype="float32", seed=3)
    first, second = (load_model(config, hf_config, CPU, torch.float32) for _ in range(2))
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    experts = [m for m in first.modules() if isinstance(m, FusedMoE)]
    assert experts
    for moe in experts:
        gate, up = moe.w13.chunk(2, dim=1)
        assert 0.015 < moe.w13.std().item() < 0.025 and 0.015 < moe.w2.std().item() < 0.025
        assert not torch.equal(gate, up) and not torch.equal(moe.w2[0], moe.w2[1])
    ids = token_ids(9, seed=1)
    paged = Paged(first, hf_config, block_size=4)
    (logits,) = paged.step([(paged.blocks(9), ids, 0)])
    assert logits.isfinite().all()


# --- the benchmarks' floor: the experts a step reads ---------------------------------------

def test_the_floor_counts_the_routed_experts_a_run_read(tiny):
    """ModelShape leaves the routed experts out of the weights every step reads and counts
    k of them per token in the products; each layer's counter gains the distinct experts
    of each forward."""
    model, hf_config, _ = tiny
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    shape = ModelShape.of(model, hf_config, 1, 4)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    expert = (moe[0].w13[0].numel() + moe[0].w2[0].numel())
    assert shape.expert_bytes == 4 * expert and shape.num_moe_layers == len(moe)
    assert shape.weight_bytes == all_bytes - len(moe) * 8 * shape.expert_bytes
    assert shape.num_params == sum(p.numel() for p in model.parameters()) \
        - len(moe) * (8 - 2) * expert
    assert shape.decode_expert_bytes(1) == len(moe) * 2 * shape.expert_bytes
    assert shape.decode_expert_bytes(6) == len(moe) * 8 * shape.expert_bytes

    expected = []  # each layer's distinct experts, from its router's logits
    hooks = [m.gate.register_forward_hook(
        lambda _, __, logits: expected.append(logits.topk(2).indices.unique().numel()))
        for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    reset_experts_read(model)
    paged = Paged(model, hf_config, block_size=4)
    try:
        paged.step([(paged.blocks(9), token_ids(9, seed=5), 0)])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(expected) == len(moe) and experts_read(model) == sum(expected)

    trace = Trace()
    trace.steps = [StepCost(1000, 0), StepCost(1000, 0)]
    trace.count_experts(shape, experts_read=3 * 2 * len(moe))  # 3 per layer and step
    assert trace.experts_per_layer_step == 3
    assert trace.floor_seconds(bandwidth=1.0, matmul_rate=1.0) == 2 * (
        1000 + 3 * len(moe) * shape.expert_bytes)


def test_throughput_bench_reports_the_experts_read(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3_moe")
    stdout, data = run_throughput(model_dir, tmp_path, "inprocess")
    assert "routed experts read per layer per step, mean: " in stdout
    assert 2 <= data["experts_per_layer_step"] <= 8  # top-2 of 8


# --- what is refused ---------------------------------------------------------------------

def test_lora_on_a_mixture_of_experts_is_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3_moe")
    resolve_engine(EngineConfig(model=str(model_dir)))
    with pytest.raises(ConfigError, match="--enable-lora: LoRA is not supported on "
                       "mixture-of-experts models \\(Qwen3MoeForCausalLM has 8 experts"):
        resolve_engine(EngineConfig(model=str(model_dir), enable_lora=True))


def test_a_size_that_does_not_split_the_experts_is_refused():
    """The experts' and the shared expert's sizes must split too, not only the dense one."""
    config = tiny_config("qwen3_moe", num_attention_heads=32, num_key_value_heads=4,
                         intermediate_size=128, moe_intermediate_size=48)
    check_tensor_parallel(config, 16)
    with pytest.raises(ConfigError, match="128/48 MLP features must divide by 32"):
        check_tensor_parallel(config, 32)
    with pytest.raises(ConfigError, match="40/40/48 MLP features must divide by 5"):
        check_tensor_parallel(tiny_config("qwen2_moe", intermediate_size=40,
                                          moe_intermediate_size=40,
                                          shared_expert_intermediate_size=48,
                                          num_attention_heads=5, num_key_value_heads=5), 5)


# --- tensor parallelism: two gloo ranks ---------------------------------------------------

@pytest.mark.parametrize("archs,load_format", [(MOE_ARCHS, "auto"), (["qwen2_moe"], "dummy")])
def test_two_ranks_have_the_logits_of_one_rank(archs, load_format, tmp_path):
    """Each rank holds half of every expert's intermediate rows (and of the shared
    expert's); the norm after the block sums the ranks."""
    dirs = [make_tiny_model(tmp_path / arch, arch) for arch in archs]
    ids = token_ids(19, seed=8)
    out = run_ranks(2, dirs, load_format, ids, tmp_path)
    for model_dir in dirs:
        _, one_rank = logits_of(str(model_dir), load_format, ids)
        for rank in range(2):
            _, logits = out[(rank, str(model_dir))]
            difference = (logits - torch.from_numpy(one_rank)).abs().max().item()
            assert difference <= SAME_AS_ONE_RANK, (model_dir.name, rank, difference)


# --- the align step -----------------------------------------------------------------------

def check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Against the list built by hand: each expert's slots in order, padded to blocks."""
    counter = torch.tensor([5])
    align = moe_align(topk_ids, num_experts, block_m, counter)
    flat = topk_ids.reshape(-1).tolist()
    assert counter.item() == 5 + len(set(flat))  # the experts read, added
    pad = len(flat)
    expected, experts = [], []
    for e in range(num_experts):
        run = [s for s, x in enumerate(flat) if x == e]
        run += [pad] * (-len(run) % block_m)
        expected += run
        experts += [e] * (len(run) // block_m)
    total = max_aligned_rows(len(flat), num_experts, block_m)
    assert align.sorted_slots.shape == (total,) and len(expected) <= total
    assert align.num_rows.tolist() == [len(expected)]
    assert align.sorted_slots.tolist() == expected + [pad] * (total - len(expected))
    blocks = align.block_expert.tolist()
    assert blocks[:len(experts)] == experts
    assert all(e == num_experts for e in blocks[len(experts):])


def align_cases() -> list[tuple[torch.Tensor, int, int]]:
    """(topk_ids, experts, block_m)."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 8, (13, 2), generator=g), 8, 4),  # a mix
        (torch.tensor([[3, 5]]), 8, 16),  # one decode token: six experts idle
        (torch.full((9, 1), 6), 8, 4),  # everything to one expert, 9 -> 12 rows
        (torch.tensor([[0, 7], [7, 0], [0, 7], [7, 0]]), 8, 4),  # exact blocks
        # Qwen3-30B-A3B's routing width; more slots than the kernel's chunk
        (torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(40)]), 128, 16),
        (torch.randint(0, 8, (100, 2), generator=g), 8, 32)]


def test_align_edge_cases():
    for topk_ids, num_experts, block_m in align_cases():
        check_alignment(topk_ids, num_experts, block_m)


def test_block_sizes_grow_with_the_rows_per_expert():
    assert moe_blocks(1, 8, 128).block_m == 16  # a decode step
    assert moe_blocks(2048, 8, 128).block_m == 64
    assert moe_blocks(512, 2, 8).block_m == 64 and moe_blocks(8, 2, 8).block_m == 16


# --- the fused kernel against its twin ----------------------------------------------------

def moe_inputs(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
               top_k: int, dtype: torch.dtype, device: str, seed: int,
               skewed: bool = False) -> tuple[torch.Tensor, ...]:
    """Weights scaled as trained ones are (outputs of order 1); skewed routing sends most
    tokens to a few experts and leaves others without any."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate ** -0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skewed:
        logits[:, :3] += 4.0
    weights, ids = logits.softmax(-1).topk(top_k)
    tensors = [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights)]
    return (*tensors, ids.to(device))


def check_fused_moe(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
                    top_k: int, dtype: torch.dtype, device: str,
                    blocks: MoEBlocks | None = None, skewed: bool = False) -> None:
    seed = num_tokens * 1000 + hidden
    inputs = moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, device,
                        seed, skewed)
    out = fused_moe_triton(*inputs, blocks=blocks)
    # the twin in float32: the reference for the kernel's low-precision rounding too
    floats = [t.float() if t.is_floating_point() else t for t in inputs]
    ref = fused_moe_ref(*floats)
    error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    what = f"T={num_tokens} H={hidden} I={intermediate} E={num_experts} k={top_k} {dtype}"
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.3g}"
    # the k terms left unsummed (for the next norm): the same terms, each in its slot
    terms = fused_moe_triton(*inputs, blocks=blocks, sum_slots=False)
    assert terms.shape == (num_tokens, top_k, hidden), what
    assert torch.equal(terms.sum(1), out), what
    ref_terms = fused_moe_ref(*floats, sum_slots=False)
    assert torch.allclose(ref_terms.sum(1), ref, atol=1e-5), what
    error = ((terms.double() - ref_terms.double()).norm() / ref_terms.double().norm()).item()
    assert error <= TOLERANCE[dtype], f"{what}, unsummed: relative error {error:.3g}"


def fp8_experts(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] in e4m3 and their scales: per output channel
    ([E, N, 1]) or per 128 x 128 block, each scale its block's amax / 448 (written here,
    independent of the kernels' quantization)."""
    experts, rows, cols = w.shape
    block = 128 if mode == "blocks" else None
    row_step, col_step = block or 1, block or cols
    blocks_r, blocks_c = -(-rows // row_step), -(-cols // col_step)
    padded = torch.nn.functional.pad(w, (0, blocks_c * col_step - cols,
                                         0, blocks_r * row_step - rows))
    parts = padded.view(experts, blocks_r, row_step, blocks_c, col_step)
    scale = parts.abs().amax(dim=(2, 4)) / 448.0
    q = (parts / scale[:, :, None, :, None]).view(experts, blocks_r * row_step, -1)
    return q[:, :rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale


def fp8_moe_inputs(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
                   top_k: int, dtype: torch.dtype, device: str, mode: str, seed: int
                   ) -> tuple[tuple[torch.Tensor, ...], ExpertScales]:
    """moe_inputs with fp8 experts: mode "channel" (activations per token), "static"
    (per-channel weights, static input scales) or "blocks" (128 x 128, activations per
    1 x 128 group)."""
    x, w13, w2, weights, ids = moe_inputs(num_tokens, hidden, intermediate, num_experts,
                                          top_k, torch.float32, "cpu", seed)
    (q13, s13), (q2, s2) = fp8_experts(w13, mode), fp8_experts(w2, mode)
    blocked = mode == "blocks"
    # x's amax, and some 4 for the down projection's input (values of order 1)
    inputs = (x.abs().max() / 448.0, torch.tensor(4.0 / 448.0)) if mode == "static" else None
    to = {"device": device}
    scales = ExpertScales(s13.to(**to), s2.to(**to), 128 if blocked else 1,
                          128 if blocked else None,
                          None if inputs is None else tuple(t.to(**to) for t in inputs))
    return (x.to(device=device, dtype=dtype), q13.to(**to), q2.to(**to), weights.to(**to),
            ids.to(**to)), scales


def on_cpu(scales: ExpertScales) -> ExpertScales:
    inputs = scales.input_scales
    return ExpertScales(scales.w13.cpu(), scales.w2.cpu(), scales.block_n, scales.group_k,
                        None if inputs is None else tuple(t.cpu() for t in inputs))


def check_fp8_fused_moe(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
                        top_k: int, dtype: torch.dtype, device: str, mode: str,
                        blocks: MoEBlocks | None = None) -> None:
    """The fp8 grouped GEMMs against the twin on the same fp8 weights and the twin's
    activation quantization on the CPU (in the interpreter the kernel path quantizes
    with the twin too: see kernels/quant.py). Against a twin in the same dtype: an
    activation a rounding apart may quantize to the neighbouring fp8 value, so a float32
    twin of a low-precision run would be some 1e-2 off."""
    inputs, scales = fp8_moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k,
                                    dtype, device, mode, seed=num_tokens * 100 + hidden)
    out = fused_moe_triton(*inputs, blocks=blocks, scales=scales)
    ref = fused_moe_ref(*(t.cpu() for t in inputs), scales=on_cpu(scales))
    error = ((out.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
    what = f"fp8 {mode} T={num_tokens} H={hidden} I={intermediate} E={num_experts} {dtype}"
    assert error <= FP8_TOLERANCE[dtype], f"{what}: relative error {error:.3g}"


def check_select_experts(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype,
                         device: str) -> None:
    """The routing kernel against its twin: the same experts in the same order, and the
    same weights (within one rounding of the dtype where they are rounded to it)."""
    g = torch.Generator().manual_seed(num_tokens * num_experts)
    # distinct in every row and exact in bf16 (multiples of 1/16 below 256 / 16): a tie
    # could be broken either way by each side
    ranks = torch.rand(num_tokens, num_experts, generator=g).argsort(-1).float()
    logits = ((ranks - num_experts / 2) / 16).to(device=device, dtype=dtype)
    for renormalize in (False, True):
        for round_weights in (False, True):
            args = (logits, top_k, renormalize, round_weights)
            (ours, ours_ids), (ref, ref_ids) = select_experts_triton(*args), \
                select_experts_ref(*args)
            assert torch.equal(ours_ids, ref_ids), (renormalize, round_weights)
            rtol = torch.finfo(dtype).eps if round_weights else 1e-5
            assert torch.allclose(ours, ref, rtol=rtol, atol=0), (renormalize, round_weights)


def check_gemv_counts_experts() -> None:
    """The GEMV path adds the distinct experts of its slots to experts_read, as the align
    kernel does: token 0 and token 1 share expert 3."""
    x, w13, w2, weights, _ = moe_inputs(2, 64, 32, 8, 2, torch.float32, "cpu", 7)
    ids = torch.tensor([[3, 5], [3, 0]])
    counter = torch.zeros(1, dtype=torch.int64)
    fused_moe_gemv(x, w13, w2, weights, ids, counter)
    assert counter.item() == 3


def interpreter_checks() -> None:
    """The fused kernel: partial K and N tiles, padding rows, idle experts, a decode token
    alone; fp32 and fp16 (the interpreter multiplies bf16 as raw bits, see
    tests/test_kernels_triton.py). The routing kernel, and the align kernel on the edge
    cases, equal to their twins.
    One subprocess for all: its imports cost more than the checks."""
    check_fused_moe(1, 64, 48, 16, 4, torch.float32, "cpu", MoEBlocks(16, 32, 32))
    for dtype in (torch.float32, torch.float16):
        check_fused_moe(13, 96, 40, 8, 2, dtype, "cpu", MoEBlocks(16, 32, 64))
    check_fused_moe(40, 64, 64, 8, 2, torch.float16, "cpu", MoEBlocks(32, 64, 32),
                    skewed=True)
    for num_tokens in (3, 100, 300):  # moe_blocks' own tiles: decode, middle, prefill
        check_fused_moe(num_tokens, 160, 96, 8, 2, torch.float16, "cpu")
    # a few slots take the GEMVs: partial K and N blocks, up to GEMV_MAX_SLOTS slots
    check_fused_moe(1, 300, 40, 16, 4, torch.float32, "cpu")
    check_fused_moe(2, 96, 264, 16, 8, torch.float16, "cpu")
    check_gemv_counts_experts()
    # fp8 experts: partial tiles and blocks (H 320: three K groups, the last partial),
    # per-channel scales in the epilogue, block scales per K tile, static input scales
    for dtype, mode, blocks in ((torch.float32, "channel", MoEBlocks(16, 32, 32)),
                                (torch.float16, "static", MoEBlocks(16, 32, 64))):
        check_fp8_fused_moe(13, 96, 40, 8, 2, dtype, "cpu", mode, blocks)
    check_fp8_fused_moe(9, 320, 128, 4, 2, torch.float32, "cpu", "blocks",
                        MoEBlocks(16, 64, 64))
    check_fp8_fused_moe(1, 256, 256, 4, 2, torch.float16, "cpu", "blocks",
                        MoEBlocks(16, 32, 128))
    check_select_experts(5, 8, 2, torch.float32, "cpu")
    check_select_experts(3, 60, 4, torch.float16, "cpu")  # experts off a power of 2
    for topk_ids, num_experts, block_m in align_cases():  # the one-program align kernel
        counters = torch.zeros(2, 1, dtype=torch.int64)
        ours, ref = (align(topk_ids, num_experts, block_m, counter) for align, counter in
                     zip((moe_align_triton, moe_align_ref), counters))
        for field in ("sorted_slots", "block_expert", "num_rows"):
            assert torch.equal(getattr(ours, field), getattr(ref, field)), (field, topk_ids)
        assert counters[0] == counters[1] == topk_ids.unique().numel()


def test_fused_moe_under_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.test_moe"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# (experts, top-k, hidden, expert intermediate)
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 256, 2048])
@pytest.mark.parametrize("model", sorted(MOE_SHAPES))
def test_fused_moe_cuda(model: str, num_tokens: int) -> None:
    num_experts, top_k, hidden, intermediate = MOE_SHAPES[model]
    check_fused_moe(num_tokens, hidden, intermediate, num_experts, top_k, torch.bfloat16,
                    "cuda")


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 256])
@pytest.mark.parametrize("mode", ["channel", "blocks", "static"])
def test_fp8_fused_moe_cuda(mode: str, num_tokens: int) -> None:
    """At Qwen3-30B-A3B's shapes, bf16 activations, the Triton quantization kernel
    writing the fp8 activations (the interpreter cannot, see kernels/quant.py)."""
    num_experts, top_k, hidden, intermediate = MOE_SHAPES["qwen3-30b-a3b"]
    check_fp8_fused_moe(num_tokens, hidden, intermediate, num_experts, top_k, torch.bfloat16,
                        "cuda", mode)


@needs_cuda
@pytest.mark.parametrize("model", sorted(MOE_SHAPES))
def test_select_experts_cuda(model: str) -> None:
    num_experts, top_k, _, _ = MOE_SHAPES[model]
    for num_tokens in (1, 256):
        check_select_experts(num_tokens, num_experts, top_k, torch.bfloat16, "cuda")


@needs_cuda
def test_align_kernel_on_cuda_equals_its_twin() -> None:
    for topk_ids, num_experts, block_m in align_cases():
        ours = moe_align(topk_ids.cuda(), num_experts, block_m)  # the kernel: few slots
        ref = moe_align_ref(topk_ids, num_experts, block_m)
        for field in ("sorted_slots", "block_expert", "num_rows"):
            assert torch.equal(getattr(ours, field).cpu(), getattr(ref, field)), field


@needs_cuda
def test_fused_moe_dispatch_takes_triton_on_cuda(monkeypatch) -> None:
    import kernels.moe as moe
    inputs = moe_inputs(4, 128, 64, 8, 2, torch.bfloat16, "cuda", seed=1)
    monkeypatch.setattr(moe, "fused_moe_ref", None)  # any call to the twin fails
    assert fused_moe(*inputs).shape == (4, 128)


@needs_cuda
def test_fused_moe_replays_in_cuda_graph() -> None:
    """Captured once at Qwen3-30B-A3B's routing (capture fails on any host sync), replayed
    with new routings: a spread one, then all tokens on the same two experts."""
    num_experts, top_k, hidden, intermediate = MOE_SHAPES["qwen3-30b-a3b"]
    num_tokens = 16
    static = list(moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k,
                             torch.bfloat16, "cuda", seed=2))
    fused_moe(*static)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*static)
    for seed, skewed in ((3, False), (4, True)):
        fresh = moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k,
                           torch.bfloat16, "cuda", seed, skewed)
        for i in (0, 3, 4):  # x, the weights, the ids; the experts' weights stay
            static[i].copy_(fresh[i])
        graph.replay()
        ref = fused_moe_ref(*(t.float() if t.is_floating_point() else t for t in static))
        error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert error <= TOLERANCE[torch.bfloat16], (seed, error)


if __name__ == "__main__":
    interpreter_checks()
