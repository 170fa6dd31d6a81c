"""INT4 weight-only (W4A16): the Triton kernels against their torch twin, each checkpoint
format's converter against an independent reading of its documented layout, and the
quantization methods end to end on a small layer.

The kernels run in Triton's interpreter in a fresh subprocess, as tests/test_kernels_triton.py
explains; fp16 activations there (the interpreter multiplies bf16 matrices as raw bits).

The AWQ and GPTQ packings are written here nibble by nibble, straight from the formats'
descriptions (AutoAWQ's GEMM pack order 0,2,4,6,1,3,5,7 along output features; GPTQ's
sequential nibbles along input features for qweight and along output features for qzeros,
v1 storing zero - 1); compressed-tensors' tensors come from the installed library's own
pack_to_int32 and are read back by its own decompressor.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import EngineConfig
from common.model_files import load_hf_config
from common.model_support import UnsupportedModel, check_model_support
from kernels.int4 import (SYMMETRIC_ZERO, Int4Tiles, dequantize_int4_ref, pack_int4,
                          unpack_int4, w4a16_gemm_ref, w4a16_gemm_triton)
from kernels.norm import rms_norm
from services.worker.layers.linear import MergedColumnParallelLinear
from services.worker.layers.quantization import building_with, quant_method_for
from services.worker.layers.quantization.int4 import (Int4Method, Int4Weight, awq_to_int4,
                                                      compressed_tensors_to_int4,
                                                      gptq_to_int4)
from services.worker.loader import default_dtype, load_model
from tests.test_models import Paged, rel_err, token_ids
from tests.test_quantization import expected_shard, projections_at_rank_1
from tests.test_tensor_parallel import as_rank, run_ranks
from tests.tiny_models import make_tiny_model, tiny_config

CPU = torch.device("cpu")

REPO = Path(__file__).resolve().parent.parent
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP_SIZES = (32, 64, 128)


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2 ** 31)
    return torch.Generator().manual_seed(seed), seed


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# --- an independent reference quantizer and the documented packings -----------------------

@dataclass
class Quantized:
    """W [N, K] as unsigned 4-bit q [N, K], zeros [N, groups] (integers, possibly 16 for
    GPTQ v1) and scales [N, groups]; `group_of` [K] each input feature's group."""
    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_of: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """W[n, k] = (q - z) * s of k's group, rounded once to the scales' dtype."""
        z = self.zeros[:, self.group_of].long()
        s = self.scales[:, self.group_of].float()
        return ((self.q.long() - z).float() * s).to(self.scales.dtype)


def quantize(w: torch.Tensor, group_of: torch.Tensor, symmetric: bool,
             dtype: torch.dtype) -> Quantized:
    """Min-max quantization of each (output feature, group); symmetric: zero 8."""
    n, groups = w.shape[0], int(group_of.max()) + 1
    scales = torch.empty(n, groups, dtype=dtype)
    zeros = torch.empty(n, groups, dtype=torch.long)
    q = torch.empty(w.shape, dtype=torch.long)
    for grp in range(groups):
        cols = (group_of == grp).nonzero().squeeze(1)
        part = w[:, cols].float()
        if symmetric:
            scale = (part.abs().amax(dim=1) / 7).to(dtype).float()
            zero = torch.full((n,), 8)
        else:
            lo, hi = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / 15).to(dtype).float()
            zero = (-lo / scale).round().clamp(0, 15).long()
        q[:, cols] = ((part / scale[:, None]).round() + zero[:, None]).clamp(0, 15).long()
        scales[:, grp], zeros[:, grp] = scale.to(dtype), zero
    return Quantized(q, zeros, scales, group_of)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_along_columns(v: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, 8C] -> int32 [R, C]: nibble i of word c holds column 8c + order[i]."""
    words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.long)
    for c in range(words.shape[1]):
        for i in range(8):
            words[:, c] |= (v[:, 8 * c + order[i]].long() & 0xF) << (4 * i)
    return as_int32(words)


def pack_along_rows(v: torch.Tensor) -> torch.Tensor:
    """[8R, C] -> int32 [R, C]: nibble j of word r holds row 8r + j."""
    return pack_along_columns(v.T, tuple(range(8))).T.contiguous()


def nibble(words: torch.Tensor, i: int) -> torch.Tensor:
    return (words.long() >> (4 * i)) & 0xF


def read_columns(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The inverse of pack_along_columns, one nibble at a time."""
    out = torch.empty(words.shape[0], 8 * words.shape[1], dtype=torch.long)
    for c in range(words.shape[1]):
        for i in range(8):
            out[:, 8 * c + order[i]] = nibble(words[:, c], i)
    return out


def read_rows(words: torch.Tensor) -> torch.Tensor:
    return read_columns(words.T, tuple(range(8))).T


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_columns(qz.q.T, AWQ_ORDER),
            "qzeros": pack_along_columns(qz.zeros.T, AWQ_ORDER),
            "scales": qz.scales.T.contiguous()}


def gptq_tensors(qz: Quantized, v1: bool) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_rows(qz.q.T),
            "qzeros": pack_along_columns(qz.zeros.T - int(v1), tuple(range(8))),
            "scales": qz.scales.T.contiguous(), "g_idx": qz.group_of.to(torch.int32)}


def ct_tensors(qz: Quantized, symmetric: bool,
               group_order: bool = False) -> dict[str, torch.Tensor]:
    """compressed-tensors stores signed values: q - 8 and zero - 8; group_order: actorder
    "group", each input feature's group in weight_g_idx."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32
    tensors = {"weight_packed": pack_to_int32((qz.q - 8).to(torch.int8), 4),
               "weight_scale": qz.scales.clone(),
               "weight_shape": torch.tensor(qz.q.shape)}
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32((qz.zeros - 8).to(torch.int8), 4,
                                                     packed_dim=0)
    if group_order:
        tensors["weight_g_idx"] = qz.group_of.to(torch.int32)
    return tensors


def sequential_groups(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k) // group_size


def act_order_groups(k: int, group_size: int, g: torch.Generator) -> torch.Tensor:
    """GPTQ's desc_act: features quantized in a random order, group = position // g."""
    order = torch.randperm(k, generator=g)
    group_of = torch.empty(k, dtype=torch.long)
    group_of[order] = torch.arange(k) // group_size
    return group_of


def dense(weight: Int4Weight, group_size: int) -> torch.Tensor:
    """The canonical layout back to W [N, K] in the checkpoint's input order."""
    w = dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, group_size)
    if weight.perm is None:
        return w
    original = torch.empty_like(w)
    original[:, weight.perm.long()] = w
    return original


# --- kernels: interpreter checks, each in a subprocess -------------------------------------

CHECKS: dict[str, Callable[[], None]] = {}


def interpreter_check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def random_int4(k: int, n: int, group_size: int, g: torch.Generator,
                act_order: bool, symmetric: bool = False) -> Int4Weight:
    """Random canonical weights: any nibble, zeros 0..16 (symmetric: None, all 8), small
    positive scales."""
    q = torch.randint(0, 16, (n, k), generator=g)
    groups = k // group_size
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 0.01).half()
    zeros = None if symmetric else torch.randint(0, 17, (n, groups), generator=g).to(
        torch.uint8)
    perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
    return Int4Weight(pack_int4(q), scales, zeros, perm)


def check_w4a16(m: int, k: int, n: int, group_size: int, act_order: bool,
                tiles: Int4Tiles | None, with_bias: bool, dtype: torch.dtype = torch.float16,
                device: str = "cpu", x_scale: float = 1.0, symmetric: bool = False) -> None:
    """x_scale: the activations' size (the packed GEMV scales them into fp16's range).
    symmetric: no zeros (every one 8)."""
    g, seed = fresh_generator()
    w = random_int4(k, n, group_size, g, act_order, symmetric)
    w = Int4Weight(*(t if t is None else t.to(device) for t in
                     (w.qweight, w.scales.to(dtype), w.zeros, w.perm)))
    x = (torch.randn(m, k, generator=g) * x_scale).to(device, dtype)
    bias = (torch.randn(n, generator=g) * x_scale).to(device, dtype) if with_bias else None
    ref = w4a16_gemm_ref(x, w.qweight, w.scales, w.zeros, group_size, w.perm, bias)
    out = w4a16_gemm_triton(x, w.qweight, w.scales, w.zeros, group_size, w.perm, bias,
                            tiles=tiles)
    error = relative_error(out, ref)
    assert error <= 1e-2, (f"m {m} k {k} n {n} g {group_size} act-order {act_order} "
                           f"bias {with_bias} symmetric {symmetric} {tiles} {dtype}: error "
                           f"{error:.3g} (seed {seed})")


@interpreter_check
def gemv_path() -> None:
    """One row (the default there) and four forced onto the GEMV; N off the block size; K
    over several tiles, split over programs (forced and by the SM count) with the bias
    added after the split's sum; K tiles over several groups (narrowed where K is not a
    multiple), inside one group, and over all of K (per channel); groups 32, 64, 128,
    with and without act-order; without zeros (symmetric) at one and four rows."""
    for group_size in GROUP_SIZES:
        for act_order in (False, True):
            check_w4a16(1, 384, 96, group_size, act_order, Int4Tiles(1, 64, 256), act_order)
    check_w4a16(1, 384, 96, 64, False, Int4Tiles(1, 64, 256), True, symmetric=True)
    check_w4a16(4, 1024, 40, 128, True, Int4Tiles(1, 8, 512, split_k=2), False,
                symmetric=True)
    check_w4a16(1, 384, 96, 384, False, Int4Tiles(1, 64, 256, split_k=3), True)
    check_w4a16(3, 256, 40, 32, True, Int4Tiles(1, 32, 64), True)
    check_w4a16(2, 3072, 24, 64, True, Int4Tiles(1, 8, 2048, split_k=2), False)
    check_w4a16(1, 512, 72, 64, False, None, True)


def check_unsummed(m: int, k: int, n: int, tiles: Int4Tiles | None, device: str = "cpu",
                   dtype: torch.dtype = torch.float16) -> None:
    """summed=False: a split K's float32 partial sums [m, splits, n], whose sum rounded
    once is the summed product exactly; where K is not split, or with a bias, the product
    itself. On the model's path the next norm adds them (kernels/norm.py): its outputs are
    those of the norm of the summed product."""
    g, seed = fresh_generator()
    w = random_int4(k, n, 128, g, False)
    w = Int4Weight(w.qweight.to(device), w.scales.to(device, dtype), w.zeros.to(device), None)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    args = (x, w.qweight, w.scales, w.zeros, 128)
    summed = w4a16_gemm_triton(*args, tiles=tiles)
    parts = w4a16_gemm_triton(*args, tiles=tiles, summed=False)
    assert parts.shape == (m, 2, n) and parts.dtype == torch.float32, f"seed {seed}"
    assert torch.equal(parts.sum(1).to(dtype), summed), f"seed {seed}"
    bias = torch.randn(n, generator=g).to(device, dtype)
    assert torch.equal(w4a16_gemm_triton(*args, None, bias, tiles=tiles, summed=False),
                       w4a16_gemm_triton(*args, None, bias, tiles=tiles)), f"seed {seed}"
    residual, weight = (torch.randn(m, n, generator=g).to(device, dtype) for _ in range(2))
    for got, want in zip(rms_norm(parts, weight, 1e-6, residual),
                         rms_norm(summed, weight, 1e-6, residual)):
        assert torch.equal(got, want), f"the norm of the parts (seed {seed})"


@interpreter_check
def unsummed_parts() -> None:
    """A split GEMV's parts at one and three rows; the tiled GEMM's; no split."""
    check_unsummed(1, 1024, 48, Int4Tiles(1, 16, 512, split_k=2))
    check_unsummed(3, 1024, 40, Int4Tiles(1, 8, 256, split_k=2))
    check_unsummed(5, 512, 64, Int4Tiles(16, 32, 128, split_k=2))
    g, _ = fresh_generator()
    w = random_int4(256, 32, 128, g, False)
    x = torch.randn(1, 256, generator=g).half()
    whole = w4a16_gemm_triton(x, w.qweight, w.scales, w.zeros, 128,
                              tiles=Int4Tiles(1, 16, 256, split_k=1), summed=False)
    assert whole.shape == (1, 32) and whole.dtype == torch.float16


@interpreter_check
def gemm_path() -> None:
    """Rows past one, M and N off the tiles, K tiles narrower and wider than a group (a
    wider one is narrowed to the group), K split over programs; groups 32, 64, 128 with
    and without act-order; the default tiles at 16 and 17 rows; without zeros."""
    for group_size in GROUP_SIZES:
        for act_order in (False, True):
            check_w4a16(21, 256, 48, group_size, act_order, Int4Tiles(16, 32, 64),
                        not act_order)
    check_w4a16(5, 256, 80, 128, True, Int4Tiles(16, 64, 256, split_k=2), True)
    check_w4a16(16, 128, 72, 64, False, None, True)
    check_w4a16(17, 128, 136, 64, False, None, False)
    check_w4a16(21, 256, 48, 32, True, Int4Tiles(16, 32, 64), True, symmetric=True)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_under_triton_interpreter(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.test_quant_int4", check],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_kernels_cuda(dtype: torch.dtype) -> None:
    """Llama-3.1-8B's qkv and down projections at group 128 (act-order on down): decode
    rows on the GEMV path, a batch just past it and a prefill on the GEMM path; with and
    without zeros."""
    for m in (1, 16, 17, 2048):
        for symmetric in (False, True):
            check_w4a16(m, 4096, 6144, 128, False, None, m % 2 == 1, dtype, "cuda",
                        symmetric=symmetric)
            check_w4a16(m, 14336, 4096, 128, True, None, False, dtype, "cuda",
                        symmetric=symmetric)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unsummed_parts_cuda() -> None:
    """Llama-3.1-8B's o and down projections at one row (their tuned GEMVs split K in two),
    left unsummed to the norm after them."""
    check_unsummed(1, 4096, 4096, None, "cuda", torch.bfloat16)
    check_unsummed(1, 14336, 4096, None, "cuda", torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("x_scale", [1e-5, 3e3, 3e4])
def test_packed_gemv_cuda_keeps_large_and_small_activations(x_scale: float) -> None:
    """The GEMV's fp16 products, in bf16 activations: a word's eight products of 3e3
    would overflow fp16 unscaled, 3e4 is past fp16's largest value itself, and 1e-5 lies
    below its normal range; at every tuned projection and the default tiles."""
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (256, 96)):
        for symmetric in (False, True):
            check_w4a16(1, k, n, 128, False, None, True, torch.bfloat16, "cuda", x_scale,
                        symmetric)


def test_canonical_packing_round_trips() -> None:
    g, _ = fresh_generator()
    q = torch.randint(0, 16, (24, 64), generator=g)
    packed = pack_int4(q)
    assert torch.equal(packed, pack_along_columns(q, tuple(range(8))))
    assert torch.equal(unpack_int4(packed).long(), q)


# --- converters against independent unpacking of random words ------------------------------

def random_words(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-2 ** 31, 2 ** 31, shape, generator=g, dtype=torch.int64).to(
        torch.int32)


def random_scales(*shape: int, g: torch.Generator) -> torch.Tensor:
    return (torch.rand(*shape, generator=g) * 0.05 + 0.01).half()


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_awq_converter_reads_interleaved_nibbles(group_size: int) -> None:
    g, seed = fresh_generator()
    k, n = 256, 48
    qweight, qzeros = random_words(k, n // 8, g=g), random_words(k // group_size, n // 8, g=g)
    scales = random_scales(k // group_size, n, g=g)
    q, z = read_columns(qweight, AWQ_ORDER), read_columns(qzeros, AWQ_ORDER)
    expected = Quantized(q.T, z.T, scales.T, sequential_groups(k, group_size)).dequantized()
    weight = awq_to_int4(qweight, qzeros, scales, group_size)
    assert weight.perm is None
    assert torch.equal(dense(weight, group_size), expected), f"seed {seed}"


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_converter_reads_sequential_nibbles(v1: bool, act_order: bool) -> None:
    """Any stored zero nibble, 15 included (a v1 zero of 16); act-order g_idx."""
    g, seed = fresh_generator()
    k, n, group_size = 256, 40, 64
    qweight, qzeros = random_words(k // 8, n, g=g), random_words(k // group_size, n // 8, g=g)
    scales = random_scales(k // group_size, n, g=g)
    group_of = act_order_groups(k, group_size, g) if act_order else \
        sequential_groups(k, group_size)
    q, z = read_rows(qweight), read_columns(qzeros, tuple(range(8))) + int(v1)
    expected = Quantized(q.T, z.T, scales.T, group_of).dequantized()
    weight = gptq_to_int4(qweight, qzeros, scales, group_of.to(torch.int32), group_size, v1)
    assert (weight.perm is not None) == act_order
    assert torch.equal(dense(weight, group_size), expected), f"seed {seed}"


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_converter_matches_the_library(symmetric: bool) -> None:
    """Random packed words read back by compressed-tensors' own unpacker and dequantizer."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    g, seed = fresh_generator()
    k, n, group_size = 256, 48, 32
    state = {"weight_packed": random_words(n, k // 8, g=g),
             "weight_scale": random_scales(n, k // group_size, g=g),
             "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        state["weight_zero_point"] = random_words(n // 8, k // group_size, g=g)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size))
    expected = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"]
    weight = compressed_tensors_to_int4(state["weight_packed"], state["weight_scale"],
                                        state.get("weight_zero_point"), None, group_size)
    assert torch.equal(dense(weight, group_size), expected), f"seed {seed}"


# --- round trip: quantize, pack as the format does, convert, dequantize --------------------

@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_round_trip_through_every_format(group_size: int) -> None:
    g, seed = fresh_generator()
    k, n = 256, 32
    w = torch.randn(n, k, generator=g)
    sequential = sequential_groups(k, group_size)
    for label, qz, convert in [
            ("awq", quantize(w, sequential, False, torch.float16),
             lambda qz: awq_to_int4(**awq_tensors(qz), group_size=group_size)),
            ("gptq v1 sym", quantize(w, sequential, True, torch.float16),
             lambda qz: gptq_to_int4(**gptq_tensors(qz, True), group_size=group_size,
                                     v1_zeros=True)),
            ("gptq v2 act-order", quantize(w, act_order_groups(k, group_size, g), False,
                                           torch.bfloat16),
             lambda qz: gptq_to_int4(**gptq_tensors(qz, False), group_size=group_size,
                                     v1_zeros=False)),
            ("ct sym", quantize(w, sequential, True, torch.bfloat16),
             lambda qz: ct_from(ct_tensors(qz, True), group_size)),
            ("ct asym", quantize(w, sequential, False, torch.float16),
             lambda qz: ct_from(ct_tensors(qz, False), group_size))]:
        expected = qz.dequantized()
        assert relative_error(expected, w) < 0.2, f"{label}: the quantizer is off"
        assert torch.equal(dense(convert(qz), group_size), expected), f"{label} (seed {seed})"


def ct_from(tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weight:
    return compressed_tensors_to_int4(tensors["weight_packed"], tensors["weight_scale"],
                                      tensors.get("weight_zero_point"), None, group_size)


# --- the methods end to end on a real fused layer ------------------------------------------

def method_of(quantization_config: dict) -> Int4Method:
    """The method a model with this quantization_config builds (the launcher's parser)."""
    config = SimpleNamespace(quantization_config=quantization_config)
    return quant_method_for(config, None)


def ct_config(weights: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int",
                                                      "dynamic": False, **weights}}}}


def build_layer(method: Int4Method, input_size: int, output_sizes: list[int],
                dtype: torch.dtype) -> MergedColumnParallelLinear:
    with default_dtype(dtype), building_with(method):
        return MergedColumnParallelLinear(input_size, output_sizes, bias=True)


METHODS = {  # name: (quantization_config, symmetric, act-order, the format's tensors)
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
             "version": "gemm"}, False, False, awq_tensors),
    "gptq-v1-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 64,
                           "desc_act": True, "sym": True}, True, True,
                          lambda qz: gptq_tensors(qz, True)),
    "gptq-v2": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                 "checkpoint_format": "gptq_v2"}, False, False,
                lambda qz: gptq_tensors(qz, False)),
    "gptq-per-channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True},
                         True, False, lambda qz: gptq_tensors(qz, True)),
    "compressed-tensors-asym": (ct_config({"symmetric": False, "strategy": "group",
                                           "group_size": 64}), False, False,
                                lambda qz: ct_tensors(qz, False)),
    "compressed-tensors-sym": (ct_config({"symmetric": True, "strategy": "group",
                                          "group_size": 32}), True, False,
                               lambda qz: ct_tensors(qz, True)),
    "compressed-tensors-actorder-group": (
        ct_config({"symmetric": False, "strategy": "group", "group_size": 64,
                   "actorder": "group"}), False, True,
        lambda qz: ct_tensors(qz, False, group_order=True)),
    "compressed-tensors-channel": (ct_config({"symmetric": True, "strategy": "channel"}),
                                   True, False, lambda qz: ct_tensors(qz, True)),
}


@pytest.mark.parametrize("method_name", sorted(METHODS))
def test_method_end_to_end(method_name: str, tmp_path: Path) -> None:
    """A gate/up layer (two fused parts) -> a safetensors file written in the format -> the
    layer's own weight_loader, part by part -> process_after_loading -> forward equals
    x @ W^T + b with W dequantized by the reference. Act-order: one g_idx shared by the
    parts, as the parts of a fused layer share their input."""
    config, symmetric, act_order, pack = METHODS[method_name]
    method = method_of(config)
    g, seed = fresh_generator()
    k, sizes = 256, [32, 48]
    group_size = method.group(k)  # -1, per channel: one group of all k
    group_of = act_order_groups(k, group_size, g) if act_order else \
        sequential_groups(k, group_size)
    parts = [quantize(torch.randn(size, k, generator=g), group_of, symmetric, torch.float16)
             for size in sizes]
    bias = torch.randn(sum(sizes), generator=g).half()
    save_file({f"{i}.{name}": tensor for i, qz in enumerate(parts)
               for name, tensor in pack(qz).items()}, tmp_path / "model.safetensors")
    layer = build_layer(method, k, sizes, torch.float16)
    for key, tensor in load_file(tmp_path / "model.safetensors").items():
        part, name = key.split(".", 1)
        layer.weight_loader(getattr(layer, name), tensor, int(part))
    for part, b in enumerate(bias.split(sizes)):
        layer.weight_loader(layer.bias, b, part)
    method.process_after_loading(layer)
    assert (layer.zeros is None) == symmetric, "symmetric zeros are dropped, others kept"
    x = torch.randn(5, k, generator=g).half()
    w = torch.cat([qz.dequantized() for qz in parts])
    expected = (x.float() @ w.float().T + bias.float()).half()
    assert relative_error(layer(x), expected) < 1e-3, f"{method_name} (seed {seed})"


def test_bad_shapes_say_what_is_wrong() -> None:
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    with pytest.raises(ValueError, match="do not split into groups of 128"):
        build_layer(method_of(gptq), 192, [64], torch.float16)
    with pytest.raises(ValueError, match="multiples of 8"):
        build_layer(method_of({"quant_method": "awq", "group_size": 32}), 64, [60],
                    torch.float16)
    layer = build_layer(method_of(gptq | {"group_size": 32, "desc_act": True}), 64, [8, 8],
                        torch.float16)
    layer.g_idx.weight_loader(layer.g_idx, torch.arange(64, dtype=torch.int32) // 32, 0)
    with pytest.raises(ValueError, match=r"\[1\]: its g_idx differs from the other fused"):
        layer.g_idx.weight_loader(layer.g_idx, torch.arange(64).flip(0).int() // 32, 1)
    g_idx = torch.arange(64, dtype=torch.int32) // 16  # a rank holding part of 2 groups of 32
    with pytest.raises(ValueError, match="act-order with the input features split"):
        gptq_to_int4(torch.zeros(8, 8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                     torch.ones(2, 8).half(), g_idx.flip(0), 32, True)


# --- tiny models in each format against transformers -----------------------------------------

PROMPT = token_ids(24, seed=5)
# the same float32 weights and arithmetic on both sides, summed in another order
EXACT = 1e-5
LOGPROB_EXACT = 1e-4
ATTENTION_INPUT, MLP_INPUT = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")

FORMATS = {  # name: (quantization_config, symmetric, act-order, the format's tensors)
    "awq": METHODS["awq"],
    "gptq-v1-sym": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
                     "sym": True, "checkpoint_format": "gptq"}, True, False,
                    lambda qz: gptq_tensors(qz, True)),
    "gptq-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                        "desc_act": True, "sym": True}, True, True,
                       lambda qz: gptq_tensors(qz, True)),
    "ct-sym-64": (ct_config({"symmetric": True, "strategy": "group", "group_size": 64}),
                  True, False, lambda qz: ct_tensors(qz, True)),
    "ct-asym-32": (ct_config({"symmetric": False, "strategy": "group", "group_size": 32}),
                   False, False, lambda qz: ct_tensors(qz, False)),
}


def quantized_linears(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight")


def write_int4(src: Path, out: Path, fmt: str, seed: int = 0) -> Path:
    """src's tiny model quantized into `fmt` at out (scales float16, compressed-tensors'
    in the model's float32); src keeps the weights it holds, dequantized exactly in
    float32, for transformers. Under act-order the projections that share an input share
    one random grouping of it, as GPTQ's Hessian order makes them."""
    import shutil

    config, symmetric, act_order, pack = FORMATS[fmt]
    shutil.copytree(src, out)
    group_size = config.get("group_size") or next(
        iter(config.get("config_groups", {}).values()), {}).get("weights", {})["group_size"]
    g = torch.Generator().manual_seed(seed)
    groupings: dict[str, torch.Tensor] = {}
    quantized, dequantized = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not quantized_linears(name):
            quantized[name] = dequantized[name] = w
            continue
        prefix, module = name[:-len(".weight")].rsplit(".", 1)
        shared = prefix + ("attention" if module in ATTENTION_INPUT else
                           "mlp" if module in MLP_INPUT else module)
        if shared not in groupings:
            k = w.shape[1]
            groupings[shared] = act_order_groups(k, group_size, g) if act_order else \
                sequential_groups(k, group_size)
        scale_dtype = torch.float32 if fmt.startswith("ct") else torch.float16
        qz = quantize(w, groupings[shared], symmetric, scale_dtype)
        for suffix, tensor in pack(qz).items():
            quantized[f"{prefix}.{module}.{suffix}"] = tensor
        exact = Quantized(qz.q, qz.zeros, qz.scales.float(), qz.group_of)
        dequantized[name] = exact.dequantized()
        assert relative_error(dequantized[name], w) < 0.2  # the quantizer works
    save_file(quantized, out / "model.safetensors")
    save_file(dequantized, src / "model.safetensors")
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "quantization_config": config}))
    return out


def transformers_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def load(model_dir: Path, **engine) -> torch.nn.Module:
    config = EngineConfig(model=str(model_dir), dtype="float32", **engine)
    return load_model(config, load_hf_config(model_dir), CPU, torch.float32)


def our_logits(model_dir: Path) -> torch.Tensor:
    hf_config = load_hf_config(model_dir)
    paged = Paged(load(model_dir), hf_config, block_size=4)
    (logits,) = paged.step([(paged.blocks(len(PROMPT)), PROMPT, 0)])
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_int4_checkpoint_prompt_logprobs_match_transformers(fmt, arch, tmp_path):
    """Through LLM(...), in prefill chunks of 8 tokens: headrace's prompt logprobs are
    transformers' on the dequantized weights."""
    from common.sampling_params import SamplingParams
    from services.offline.llm import LLM

    src = make_tiny_model(tmp_path, arch)
    unquantized = transformers_logits(src)
    model_dir = write_int4(src, tmp_path / fmt, fmt)
    dequantized = transformers_logits(src)
    assert rel_err(dequantized, unquantized) > 1e-2  # 4 bits are far from float32
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4,
              num_gpu_blocks_override=64, max_num_batched_tokens=8, max_num_seqs=4,
              quantization=FORMATS[fmt][0]["quant_method"])
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(dequantized, dim=-1)
    for pos in range(1, len(PROMPT)):
        token = PROMPT[pos]
        assert out.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref[pos - 1, token].item(), abs=LOGPROB_EXACT)


@pytest.mark.parametrize("fmt,arch", [("ct-sym-64", "llama"), ("ct-sym-64", "qwen3")])
def test_compressed_tensors_int4_matches_transformers_reading_the_files(fmt, arch, tmp_path):
    """transformers with compressed-tensors decompresses the pack-quantized files itself.
    Symmetric only: transformers 5.24 builds an asymmetric model's weight_zero_point at
    the unpacked [N, groups] shape and refuses the packed [N / 8, groups] that
    compressed-tensors' own compressor writes (and vLLM reads), so the asymmetric files
    are checked against the test's unpacker above."""
    model_dir = write_int4(make_tiny_model(tmp_path, arch), tmp_path / fmt, fmt)
    assert rel_err(our_logits(model_dir), transformers_logits(model_dir)) < EXACT


def test_dummy_weights_run_int4(tmp_path):
    """--load-format dummy: random tensors in the checkpoint's shapes, act-order's g_idx
    kept in order (drawn indices would group nothing)."""
    for fmt in ("gptq-act-order", "awq"):
        model_dir = write_int4(make_tiny_model(tmp_path / fmt, "llama"), tmp_path / fmt / "q",
                               fmt)
        model = load(model_dir, load_format="dummy")
        assert model.model.layers[0].mlp.down_proj.qweight.dtype == torch.int32
        hf_config = load_hf_config(model_dir)
        paged = Paged(model, hf_config, block_size=4)
        (logits,) = paged.step([(paged.blocks(len(PROMPT)), PROMPT, 0)])
        assert torch.isfinite(logits).all()


def test_the_benchmarks_count_the_values_of_packed_weights(tmp_path):
    """ModelShape.num_params (the products per token) counts an int4 weight's values,
    eight a word: the unquantized model's count plus the scales, zeros and act-order's
    permutation."""
    from benchmarks.bench.workloads import ModelShape

    src = make_tiny_model(tmp_path, "llama")
    unquantized = ModelShape.of(load(src), load_hf_config(src), 1, 4).num_params
    model_dir = write_int4(src, tmp_path / "q", "gptq-act-order")
    model = load(model_dir)
    extra = sum(p.numel() for name, p in model.named_parameters()
                if name.endswith((".scales", ".zeros", ".perm")))
    shape = ModelShape.of(model, load_hf_config(model_dir), 1, 4)
    assert shape.num_params == unquantized + extra


# --- tensor parallelism -------------------------------------------------------------------------

def dense_of(layer) -> torch.Tensor:
    """A loaded layer's W [N, K] in the checkpoint's input order."""
    zeros = torch.full(layer.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8) \
        if layer.zeros is None else layer.zeros.data
    weight = Int4Weight(layer.qweight.data, layer.scales.data, zeros,
                        None if layer.perm is None else layer.perm.data)
    return dense(weight, layer.qweight.shape[1] * 8 // layer.scales.shape[1])


@pytest.mark.parametrize("fmt", ["awq", "gptq-v1-sym", "ct-asym-32"])
def test_a_rank_holds_its_shard_of_every_int4_tensor(fmt, tmp_path, monkeypatch):
    """Rank 1 of 2: output dims packed eight to a word (AWQ's qweight and qzeros, GPTQ's
    qzeros, compressed-tensors' weight_zero_point) take 1/8 of the rows, grouped input
    dims their groups, g_idx the rank's features."""
    model_dir = write_int4(make_tiny_model(tmp_path, "qwen3"), tmp_path / fmt, fmt)
    for module, rank_module in projections_at_rank_1(model_dir, monkeypatch):
        assert torch.equal(dense_of(rank_module),
                           expected_shard(module, rank_module, dense_of(module)))


def test_int4_checkpoints_run_over_two_gloo_ranks(tmp_path):
    """Each rank's logits are one rank's: W4A16 quantizes no activations, so only the
    all-reduce's order of summation differs."""
    dirs = [write_int4(make_tiny_model(tmp_path / fmt, "qwen3"), tmp_path / fmt / "q", fmt)
            for fmt in ("awq", "gptq-v1-sym")]
    results = run_ranks(2, dirs, "auto", PROMPT, tmp_path)
    for model_dir in dirs:
        whole = our_logits(model_dir)
        for rank in range(2):
            assert rel_err(results[(rank, str(model_dir))][1], whole) < EXACT


# --- refusals -----------------------------------------------------------------------------------

def test_act_order_with_input_features_split_over_ranks_is_refused(tmp_path, monkeypatch):
    model_dir = write_int4(make_tiny_model(tmp_path, "llama"), tmp_path / "q",
                           "gptq-act-order")
    as_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError) as refused:
        load(model_dir)
    assert str(refused.value) == (
        "gptq: act-order checkpoints (g_idx) with the input features of RowParallelLinear "
        "split over tensor-parallel ranks are not supported; use --tensor-parallel-size 1")


@pytest.mark.parametrize("config,quantization,line", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, None,
     "gptq: unsupported 8-bit weights; supported: 4-bit"),
    ({"quant_method": "awq", "w_bit": 3, "q_group_size": 128}, "awq",
     "awq: unsupported 3-bit weights; supported: 4-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None,
     "awq: unsupported version 'gemv'; supported: gemm"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     None, "gptq: unsupported checkpoint format 'marlin'; supported: gptq, gptq_v2"),
    (ct_config({"num_bits": 8, "strategy": "channel"}), None,
     "unsupported compressed-tensors weights int8 channel, activations unquantized;"),
    ({**ct_config({"strategy": "group", "group_size": 128}), "format": "marlin-24"}, None,
     "unsupported compressed-tensors weights int4 group, activations unquantized (format "
     "'marlin-24'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq",
     "--quantization gptq does not match the checkpoint's quantization_config ('awq')"),
])
def test_unsupported_int4_configs_are_refused_in_one_line(config, quantization, line):
    with pytest.raises(UnsupportedModel) as refused:
        check_model_support(tiny_config("qwen3", quantization_config=config), quantization)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_int4_formats_are_accepted_by_the_launchers_check():
    for fmt, (config, *_) in FORMATS.items():
        check_model_support(tiny_config("qwen3", quantization_config=config),
                            config["quant_method"])


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
