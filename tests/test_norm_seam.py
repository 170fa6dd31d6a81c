"""The norm seam (kernels/norm_seam.py): a projection that adds its output to the residual
stream in its epilogue, and one that norms its input as it loads it, against the same
kernel without the seam beside the unfused ops; and the decoder layers that use it, against
the same model without it.

The kernels run in Triton's interpreter in a fresh subprocess, as tests/test_kernels_triton.py
explains; fp16 activations there (the interpreter multiplies bf16 matrices as raw bits and
rounds to bf16 by truncation). The fp8 one-row kernel is inline assembly: CUDA only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig
from common.model_files import load_hf_config
from kernels.fp8_gemv import PackedTiles, _packed_row_kernel, fp8_gemv_ref, fp8_gemv_triton
from kernels.gemv import GEMV_MAX_ROWS, GemvTiles, _gemv_kernel, gemv_ref, gemv_triton
from kernels.norm import rms_norm, rms_norm_ref
from kernels.norm_seam import ResidualSum, SeamNorm, residual_sum_ref
from services.worker.layers import norm_seam as layer_seams
from services.worker.layers.linear import LinearBase
from services.worker.layers.norm import RMSNorm
from services.worker.layers.quantization import UnquantizedMethod
from services.worker.loader import load_model
from tests.test_kernels_triton import (SM90_PTXAS, assert_close, compile_for_sm90,
                                       fresh_generator, needs_cuda, rand)
from tests.test_models import Paged, token_ids
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
EPS = 1e-6

Project = Callable[..., torch.Tensor | ResidualSum]


def sixteen_bit(n: int, k: int, dtype: torch.dtype, device: str, g: torch.Generator
                ) -> tuple[Project, Project]:
    """(kernel, twin) of a 16-bit [n, k] weight: f(x, tiles=None, add_to=None)."""
    w = rand(g, n, k, dtype=dtype, device=device, scale=k ** -0.5)
    return (lambda x, tiles=None, add_to=None: gemv_triton(x, w, None, tiles, add_to),
            lambda x, add_to=None: gemv_ref(x, w, None, add_to))


def fp8(n: int, k: int, device: str, g: torch.Generator, block: tuple[int, int] | None
        ) -> tuple[Project, Project]:
    """(kernel, twin) of an e4m3 [n, k] weight, scaled per channel (block None) or in
    blocks."""
    w = (rand(g, n, k, dtype=torch.float32, device=device, scale=100.0).clamp(-448, 448)
         .to(torch.float8_e4m3fn))
    count = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = ((0.5 + torch.rand(*count, generator=g)) / (100 * k ** 0.5)).to(device)
    return (lambda x, tiles=None, add_to=None: fp8_gemv_triton(x, w, scale, None, block,
                                                               tiles, add_to),
            lambda x, add_to=None: fp8_gemv_ref(x, w, scale, None, block, add_to))


def check_seam(make: Callable[[int, int, torch.Generator], tuple[Project, Project]],
               hidden: int, k_in: int, n_out: int, dtype: torch.dtype, device: str,
               producer_tiles=None, consumer_tiles=None) -> None:
    """A sublayer's last projection [hidden, k_in] adding to a residual, then the next one
    [n_out, hidden] norming its input. The sum is the unfused add of the same kernel's
    output, bit for bit; its squares' parts add up to the sum's; the consumer's output is
    the same kernel's over the norm kernel's output (equal but where the squares' order
    moves 1/rms by an ulp); and both stay within the twins' tolerance."""
    g, seed = fresh_generator()
    produce, produce_ref = make(hidden, k_in, g)
    consume, consume_ref = make(n_out, hidden, g)
    x = rand(g, 1, k_in, dtype=dtype, device=device)
    residual = rand(g, 1, hidden, dtype=dtype, device=device)
    weight = (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(device=device, dtype=dtype)
    summed = produce(x, producer_tiles, add_to=residual)
    want = residual_sum_ref(produce(x, producer_tiles), residual)
    assert torch.equal(summed.total, want.total), f"the residual sum (seed {seed})"
    torch.testing.assert_close(summed.sumsq.sum(-1), want.sumsq[:, 0], rtol=1e-5, atol=0)
    seam = SeamNorm(summed, weight, EPS)
    fused = consume(seam, consumer_tiles)
    unfused = consume(rms_norm(summed.total, weight, EPS), consumer_tiles)
    differ = (fused != unfused).float().mean().item()
    assert differ <= 0.02, f"{differ:.1%} of the normed projection differs (seed {seed})"
    assert_close(fused, consume_ref(seam), "seam against the twin", seed)
    twin = produce_ref(x, add_to=residual)
    assert_close(twin.total, summed.total, "the twin's residual sum", seed)
    assert torch.equal(consume_ref(SeamNorm(twin, weight, EPS)),
                       consume_ref(rms_norm_ref(twin.total, weight, EPS)))


# --- interpreter checks, each in a subprocess ----------------------------------------------

CHECKS: dict[str, Callable[[], None]] = {}


def interpreter_check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


@interpreter_check
def sixteen_bit_seams() -> None:
    """One row on the CUDA cores, unsplit and with K split in three (the split's sum adds
    the residual), and on tensor cores (x padded to 16 rows)."""
    def make(n: int, k: int, g: torch.Generator) -> tuple[Project, Project]:
        return sixteen_bit(n, k, torch.float16, "cpu", g)
    for producer, consumer in [(GemvTiles(8, 64), GemvTiles(8, 64)),
                               (GemvTiles(8, 32, split_k=3), GemvTiles(16, 32, split_k=2)),
                               (GemvTiles(16, 64, dot=True), GemvTiles(16, 32, dot=True))]:
        check_seam(make, 72, 200, 56, torch.float16, "cpu", producer, consumer)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_under_triton_interpreter(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.test_norm_seam", check],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not SM90_PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_seam_kernels_compile_for_sm90() -> None:
    """Either side of a seam with PDL: the 16-bit GEMV one row on the CUDA cores and on
    tensor cores, the fp8 one-row kernel per channel and per K block."""
    pointers = dict(x_ptr="*bf16", scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
                    res_ptr="*bf16", sumsq_ptr="*fp32", norm_w_ptr="*bf16")
    numbers = dict(parts="i32", eps="fp32")
    sides = [dict(NORM_IN=True, ADD_RESIDUAL=False, BLOCK_P=256),
             dict(NORM_IN=False, ADD_RESIDUAL=True, BLOCK_P=1)]
    gemv_types = dict(pointers, w_ptr="*bf16", m="i32", n="i32", k="i32", stride_x="i32",
                      stride_w="i32", scale_stride="i32", scale_block_n="i32",
                      scale_block_k="i32", k_share="i32", **numbers)
    packed_types = dict(pointers, w_ptr="*i32", n="i32", k="i32", scale_stride="i32",
                        scale_block_n="i32", scale_block_k="i32", **numbers)
    for side in sides:
        for dot, block_m, block_n, block_k in [(False, 1, 8, 256), (True, 16, 32, 64)]:
            compile_for_sm90(_gemv_kernel, gemv_types, dict(
                HAS_SCALE=False, PER_K_SCALE=False, HAS_BIAS=False, USE_DOT=dot,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, **side))
        for per_k, block_n, block_k in [(False, 16, 512), (True, 8, 128)]:
            compile_for_sm90(_packed_row_kernel, packed_types, dict(
                PER_K_SCALE=per_k, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k,
                PDL=True, **side))


# --- decoder layers ------------------------------------------------------------------------

def norm_calls(model: torch.nn.Module) -> list[int]:
    """A counter of the RMSNorm modules' own calls (a seam's norm is none)."""
    calls = [0]

    def count(*_) -> None:
        calls[0] += 1
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.register_forward_hook(count)
    return calls


class Wrapper(torch.nn.Module):
    """A module in a projection's place after the model is built, as a LoRA wrapper."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(x, torch.Tensor), "a wrapper takes no norm seam"
        return self.base(x)


def decode_logits(arch: str, root: Path, device: str, dtype: torch.dtype, seams: bool,
                  monkeypatch, quantization: str | None = None, wrap: bool = False
                  ) -> tuple[torch.Tensor, list[int], int]:
    """A tiny model's logits for a 5-token prompt and then one decoded token, with the
    seams on or off; the RMSNorm calls of each step; its layer count. Every unquantized
    projection takes the GEMV at one row. wrap: layer 1's qkv_proj is wrapped."""
    monkeypatch.setattr(layer_seams, "ENABLED", seams)
    model_dir = make_tiny_model(root, arch)
    hf_config = load_hf_config(model_dir)
    config = EngineConfig(model=str(model_dir), dtype=str(dtype).split(".")[1],
                          quantization=quantization)
    model = load_model(config, hf_config, torch.device(device), dtype)
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(module.method, UnquantizedMethod):
            module.gemv_rows = range(1, GEMV_MAX_ROWS + 1)
    if wrap:
        attention = model.model.layers[1].self_attn
        attention.qkv_proj = Wrapper(attention.qkv_proj)
    calls = norm_calls(model)
    paged = Paged(model, hf_config, block_size=4)
    paged.kv_caches = [(k.to(device, dtype), v.to(device, dtype)) for k, v in paged.kv_caches]
    ids, blocks = token_ids(6, seed=3), paged.blocks(6)
    steps = []
    with torch.device(device):
        paged.step([(blocks, ids[:5], 0)])
        steps.append(calls[0])
        (logits,) = paged.step([(blocks, ids[5:], 5)])
    steps.append(calls[0] - steps[0])
    return logits, steps, hf_config.num_hidden_layers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2"])
def test_decoder_layers_take_their_norms_in_the_projections(arch, tmp_path, monkeypatch):
    """On the CPU, through the twins: a one-token step with the seams gives the same logits
    as without, bit for bit (the twins are the unfused ops), and calls only the first
    layer's input norm and the final norm as modules; a prompt's step calls them all.
    qwen2's qkv bias goes through the seam's consumer; gemma2's norms keep their kernels."""
    with_seams, steps, layers = decode_logits(arch, tmp_path / "a", "cpu", torch.float32,
                                              True, monkeypatch)
    without, plain_steps, _ = decode_logits(arch, tmp_path / "b", "cpu", torch.float32,
                                            False, monkeypatch)
    assert torch.equal(with_seams, without)
    if arch == "gemma2":  # its norm, add, norm seams are kernels of their own
        assert steps == plain_steps
    else:
        assert plain_steps == [2 * layers + 1] * 2 and steps == [2 * layers + 1, 2]


def test_a_wrapped_projection_takes_its_norm_plainly(tmp_path, monkeypatch):
    """A wrapper put in layer 1's qkv_proj's place after the model was built: layer 0's
    down_proj leaves it the norm as a module of its own, and the logits stay the same."""
    with_seams, steps, layers = decode_logits("llama", tmp_path / "a", "cpu", torch.float32,
                                              True, monkeypatch, wrap=True)
    without, _, _ = decode_logits("llama", tmp_path / "b", "cpu", torch.float32, False,
                                  monkeypatch, wrap=True)
    assert torch.equal(with_seams, without)
    assert steps == [2 * layers + 1, 3]


@needs_cuda
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_decoder_layers_take_their_norms_in_the_projections_cuda(quantization, tmp_path,
                                                                 monkeypatch):
    """A tiny Llama in bf16 on the GPU, its weights as they are or quantized to fp8 at
    load: a one-token step takes the seams (two norm modules called) and gives the logits
    and the greedy token of the step without them."""
    with_seams, steps, layers = decode_logits("llama", tmp_path / "a", "cuda",
                                              torch.bfloat16, True, monkeypatch, quantization)
    without, plain_steps, _ = decode_logits("llama", tmp_path / "b", "cuda", torch.bfloat16,
                                            False, monkeypatch, quantization)
    assert plain_steps == [2 * layers + 1] * 2 and steps == [2 * layers + 1, 2]
    assert torch.equal(with_seams.argmax(-1), without.argmax(-1))
    error = ((with_seams - without).norm() / without.norm()).item()
    assert error < 1e-2, f"logits with the seams: relative error {error:.3g}"


# --- CUDA: Llama-3.1-8B's and Qwen3-0.6B's seams -------------------------------------------

# hidden size; (o_proj's K, gate_up's N) and (down_proj's K, qkv's N)
SHAPES = {"llama-3.1-8b": (4096, [(4096, 28672), (14336, 6144)]),
          "qwen3-0.6b": (1024, [(2048, 6144), (3072, 4096)])}


@needs_cuda
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_seams_cuda(model: str) -> None:
    """Both seams of a layer (o_proj into gate_up, down_proj into the next qkv) with the
    default tiles: 16-bit in bf16 and fp16, fp8 per channel and in 128x128 blocks (its
    one-row kernel), and forced tiles on either side."""
    hidden, seams = SHAPES[model]
    for k_in, n_out in seams:
        for dtype in (torch.bfloat16, torch.float16):
            check_seam(lambda n, k, g: sixteen_bit(n, k, dtype, "cuda", g), hidden, k_in,
                       n_out, dtype, "cuda")
        for block in (None, (128, 128)):
            check_seam(lambda n, k, g: fp8(n, k, "cuda", g, block), hidden, k_in, n_out,
                       torch.bfloat16, "cuda")
    (o_in, gate_up), (down_in, qkv) = seams
    check_seam(lambda n, k, g: sixteen_bit(n, k, torch.bfloat16, "cuda", g), hidden, o_in,
               gate_up, torch.bfloat16, "cuda", GemvTiles(8, 256, split_k=4),
               GemvTiles(32, 64, dot=True, split_k=2))
    check_seam(lambda n, k, g: fp8(n, k, "cuda", g, None), hidden, down_in, qkv,
               torch.bfloat16, "cuda", PackedTiles(8, 1024, 8), PackedTiles(32, 256))


@needs_cuda
def test_seam_in_a_cuda_graph() -> None:
    """A captured seam replays what it computes eagerly."""
    g, _ = fresh_generator()
    produce, _ = fp8(4096, 4096, "cuda", g, None)
    consume, _ = sixteen_bit(6144, 4096, torch.bfloat16, "cuda", g)
    x = rand(g, 1, 4096, dtype=torch.bfloat16, device="cuda")
    residual = rand(g, 1, 4096, dtype=torch.bfloat16, device="cuda")
    weight = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    eager = consume(SeamNorm(produce(x, add_to=residual), weight, EPS))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = consume(SeamNorm(produce(x, add_to=residual), weight, EPS))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
