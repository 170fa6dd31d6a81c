"""GGUF weights kept quantized (kernels/gguf.py, services/worker/layers/quantization/gguf.py).

The torch twin is checked against the `gguf` package's numpy dequantizers (the oracle) on
random blocks; the Triton kernels against the twin in Triton's interpreter, each check in
a fresh `python -m tests.test_gguf_quant <check>` with TRITON_INTERPRET=1 (see
tests/test_kernels_triton.py's docstring for why); the reader on GGUF files written here
with gguf.GGUFWriter and on the demo model's file; the quant method on today's linear
layers, against x @ W^T with W dequantized by the oracle.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kernels.gguf import (GEMV_MAX_ROWS, LAYOUTS, GGUFType, dequantize_ref, dequantize_triton,
                          gguf_gemv_triton, gguf_linear_ref, gguf_linear_triton, layout)
from common.model_files import load_hf_config
from services.demo import demo_model_path
from services.worker.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from services.worker.layers.quantization import building_with
from services.worker.layers.quantization.gguf import (ARCHITECTURES, BLOCK_NAMES, GLOBAL_NAMES,
                                                      GGUFMethod, QuantizedCheckpoint, hf_name,
                                                      iter_gguf)

REPO = Path(__file__).resolve().parent.parent
# bytes of each type's fp16 scale fields (d, dmin): random bytes there would make infinities
FP16_FIELDS = {GGUFType.Q4_0: (0,), GGUFType.Q4_1: (0, 2), GGUFType.Q8_0: (0,),
               GGUFType.Q4_K: (0, 2), GGUFType.Q5_K: (0, 2), GGUFType.Q6_K: (208,)}


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = random.SystemRandom().randrange(2 ** 31)
    return np.random.default_rng(seed), seed


def random_raw(qtype: GGUFType, rows: int, cols: int, rng: np.random.Generator,
               scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks whose fp16 scales are small and finite,
    of standard deviation `scale` (every quant and 6-bit scale bit pattern still occurs)."""
    block = layout(qtype)
    raw = rng.integers(0, 256, (rows, cols // block.values, block.nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal(raw.shape[:2]) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def oracle(raw: np.ndarray, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, T(int(qtype)))


# --- the torch twin against gguf.quants -------------------------------------------------

def test_block_layouts_are_ggml_sizes():
    for qtype, block in LAYOUTS.items():
        assert gguf.GGML_QUANT_SIZES[T(int(qtype))] == (block.values, block.nbytes)


@pytest.mark.parametrize("qtype", list(GGUFType), ids=lambda t: t.name)
def test_twin_equals_gguf_dequantize_on_random_blocks(qtype):
    rng, seed = fresh_rng()
    raw = random_raw(qtype, 7, 512, rng)
    twin = dequantize_ref(torch.from_numpy(raw), qtype, 512)
    assert np.array_equal(twin.numpy(), oracle(raw, qtype)), f"seed {seed}"


@pytest.mark.parametrize("qtype", [GGUFType.Q4_0, GGUFType.Q4_1, GGUFType.Q8_0],
                         ids=lambda t: t.name)
def test_twin_equals_gguf_dequantize_on_quantized_blocks(qtype):
    """Blocks gguf.quants itself quantizes (it quantizes none of the K types)."""
    rng, seed = fresh_rng()
    raw = gguf.quants.quantize(rng.standard_normal((5, 96)).astype(np.float32), T(int(qtype)))
    twin = dequantize_ref(torch.from_numpy(raw), qtype, 96)
    assert np.array_equal(twin.numpy(), oracle(raw, qtype)), f"seed {seed}"


def test_bad_types_and_shapes_are_clear_errors():
    raw = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="type 6 is not kept quantized; supported: Q4_0, "
                                         "Q4_1, Q8_0"):
        dequantize_ref(raw, 6, 256)  # Q5_0
    with pytest.raises(ValueError, match=r"must be uint8 \[rows, 210\]"):
        dequantize_ref(raw, GGUFType.Q6_K, 256)
    with pytest.raises(ValueError, match="whole blocks of 256 values; 200 columns"):
        dequantize_ref(raw, GGUFType.Q4_K, 200)


# --- Triton kernels against the twin, in the interpreter ---------------------------------

CHECKS: dict[str, Callable[[], None]] = {}


def interpreter_check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, seed: int,
                 tolerance: float) -> None:
    error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert error <= tolerance, f"{what}: relative error {error:.3g} (seed {seed})"


# (type, rows, cols): rows not a multiple of the GEMV's 16-row tiles; Q4_1's and Q8_0's 96
# columns end in a partial 64-column step
SHAPES = [(GGUFType.Q4_0, 9, 64), (GGUFType.Q4_1, 18, 96), (GGUFType.Q8_0, 19, 96),
          (GGUFType.Q4_K, 5, 512), (GGUFType.Q5_K, 3, 256), (GGUFType.Q6_K, 17, 512)]
# (rows of x, dtype, tolerance) for the GEMV
GEMV_RUNS = [(1, torch.float16, 1e-2), (3, torch.float32, 1e-5),
             (GEMV_MAX_ROWS, torch.float32, 1e-5)]


@interpreter_check
def dequantize_kernel() -> None:
    """Every value, into NaN-poisoned outputs: exact in float32 (same float32 operations
    as the twin), rounded once in fp16. bf16 within one bf16 step: the interpreter's
    float32 -> bf16 cast truncates (triton 3.9) where the GPU and torch round to nearest."""
    rng, seed = fresh_rng()
    for qtype, rows, cols in SHAPES:
        raw = torch.from_numpy(random_raw(qtype, rows, cols, rng))
        ref = dequantize_ref(raw, qtype, cols)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            out = torch.full((rows, cols), float("nan"), dtype=dtype)
            dequantize_triton(raw, qtype, cols, dtype, out=out)
            what = f"{qtype.name} {dtype} (seed {seed})"
            if dtype == torch.bfloat16:
                assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -7).all(), what
            else:
                assert torch.equal(out, ref.to(dtype)), what


@interpreter_check
def gemv_kernel() -> None:
    rng, seed = fresh_rng()
    g = torch.Generator().manual_seed(seed)
    for (qtype, rows, cols), (m, dtype, tolerance) in itertools.product(SHAPES, GEMV_RUNS):
        raw = torch.from_numpy(random_raw(qtype, rows, cols, rng))
        x = torch.randn(m, cols, generator=g).to(dtype)
        out = gguf_gemv_triton(x, raw, qtype, cols)
        ref = gguf_linear_ref(x.float(), raw, qtype, cols)
        assert_close(out, ref, f"GEMV {qtype.name} m={m} {dtype}", seed, tolerance)


@interpreter_check
def linear_dispatch() -> None:
    """gguf_linear_triton: a [2, 3, cols] batch (6 rows: the GEMV) and a [13, cols] one
    (dequantize, then matmul), with a bias."""
    rng, seed = fresh_rng()
    g = torch.Generator().manual_seed(seed)
    for qtype, rows, cols in SHAPES:
        raw = torch.from_numpy(random_raw(qtype, rows, cols, rng))
        bias = torch.randn(rows, generator=g)
        for shape in ((2, 3, cols), (13, cols)):
            x = torch.randn(*shape, generator=g)
            out = gguf_linear_triton(x, raw, qtype, cols, bias)
            assert out.shape == (*shape[:-1], rows)
            assert_close(out, gguf_linear_ref(x, raw, qtype, cols, bias),
                         f"linear {qtype.name} {shape}", seed, 1e-5)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_under_triton_interpreter(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.test_gguf_quant", check],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# --- reading GGUF files -------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_names_agree_with_gguf_tensor_name_map(arch):
    """Our GGUF -> Hugging Face names against gguf-py's Hugging Face -> GGUF map."""
    key = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(key, 4)
    pairs = [(g, h) for g, h in GLOBAL_NAMES.items()]
    pairs += [(f"blk.3.{g}", f"model.layers.3.{h}") for g, h in BLOCK_NAMES.items()]
    for gguf_module, hf_module in pairs:
        if arch != "qwen3" and gguf_module.endswith(("_q_norm", "_k_norm")):
            continue  # only Qwen3 has per-head q/k norms
        assert name_map.get_name(hf_module) == gguf_module
        assert hf_name(f"{gguf_module}.weight") == f"{hf_module}.weight"
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' has no Hugging Face name"):
        hf_name("blk.0.attn_qkv.weight")


def write_gguf(path: Path, arch: str, heads: int, kv_heads: int,
               tensors: dict[str, tuple[np.ndarray, T | None]]) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_tensors(rng: np.random.Generator, hidden: int, heads: int, kv_heads: int,
                  head_dim: int) -> dict[str, tuple[np.ndarray, T | None]]:
    """One Llama block: q in Q8_0 (quantized by gguf), k in Q4_K, v in Q6_K, down in
    Q5_K, random blocks; an F32 norm; a Q8_0 embedding (read dequantized)."""
    q8 = gguf.quants.quantize(rng.standard_normal((heads * head_dim, hidden))
                              .astype(np.float32), T.Q8_0)
    return {
        "token_embd.weight": (gguf.quants.quantize(
            rng.standard_normal((11, hidden)).astype(np.float32), T.Q8_0), T.Q8_0),
        "blk.0.attn_norm.weight": (rng.standard_normal(hidden).astype(np.float32), None),
        "blk.0.attn_q.weight": (q8, T.Q8_0),
        "blk.0.attn_k.weight": (random_raw(GGUFType.Q4_K, kv_heads * head_dim, hidden, rng),
                                T.Q4_K),
        "blk.0.attn_v.weight": (random_raw(GGUFType.Q6_K, kv_heads * head_dim, hidden, rng),
                                T.Q6_K),
        "blk.0.ffn_down.weight": (random_raw(GGUFType.Q5_K, hidden, 2 * hidden, rng), T.Q5_K),
    }


def test_reader_keeps_linear_weights_quantized_and_unpermutes_q_k(tmp_path):
    rng, seed = fresh_rng()
    hidden, heads, kv_heads, head_dim = 256, 4, 2, 8
    written = llama_tensors(rng, hidden, heads, kv_heads, head_dim)
    write_gguf(tmp_path / "m.gguf", "llama", heads, kv_heads, written)
    read = dict(iter_gguf(tmp_path / "m.gguf"))
    assert sorted(read) == sorted(hf_name(name) for name in written)
    # transformers' own reverse permutation of the dequantized q/k is the reference
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    processor = LlamaTensorProcessor(config={"num_attention_heads": heads,
                                             "num_key_value_heads": kv_heads})
    for gguf_name, (data, qtype) in written.items():
        tensor = read[hf_name(gguf_name)]
        values = data if qtype is None else oracle(data, qtype)
        expected = processor.process(values, gguf_name).weights
        if gguf_name == "token_embd.weight" or qtype is None:  # read dequantized
            assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
            assert np.array_equal(tensor.numpy(), expected), f"{gguf_name} (seed {seed})"
            continue
        assert isinstance(tensor, QuantizedCheckpoint) and tensor.qtype == qtype
        assert tensor.shape == data.shape and tensor.cols == values.shape[1]
        whole = tensor.read()
        assert np.array_equal(dequantize_ref(whole, qtype, tensor.cols).numpy(), expected), \
            f"{gguf_name} (seed {seed})"
        # a loader's narrowing: rows 3.. of the unpermuted weight, and whole blocks of bytes
        assert torch.equal(tensor.narrow(0, 3, 5), whole[3:8])
        step = layout(qtype).nbytes
        assert torch.equal(tensor.narrow(1, step, step), whole[:, step:2 * step])
    # q and k did move: the reading is not the file's order
    q_raw = written["blk.0.attn_q.weight"][0]
    assert not np.array_equal(read["model.layers.0.self_attn.q_proj.weight"].read().numpy(),
                              q_raw)


def test_reader_refuses_unsupported_architectures_and_tensors(tmp_path):
    rng, _ = fresh_rng()
    write_gguf(tmp_path / "gpt2.gguf", "gpt2", 4, 4,
               {"token_embd.weight": (rng.standard_normal((3, 32)).astype(np.float32), None)})
    with pytest.raises(ValueError, match="architecture 'gpt2' is not read quantized"):
        list(iter_gguf(tmp_path / "gpt2.gguf"))
    write_gguf(tmp_path / "odd.gguf", "qwen2", 4, 4,
               {"blk.0.attn_qkv.weight": (rng.standard_normal((3, 32)).astype(np.float32),
                                          None)})
    with pytest.raises(ValueError, match="has no Hugging Face name"):
        list(iter_gguf(tmp_path / "odd.gguf"))


@pytest.fixture(scope="module")
def demo_gguf() -> str:
    return demo_model_path()  # raises FileNotFoundError naming the package when absent


def test_demo_model_tensor_read_quantized_equals_gguf(demo_gguf):
    """SmolLM2's embedding, its one Q8_0 tensor (its projections are Q4_1): rows of it
    kept quantized, read as a rank would (narrowed), dequantized by the twin, equal gguf's
    dequantization of those rows."""
    reader = gguf.GGUFReader(demo_gguf)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embedding.tensor_type == T.Q8_0
    checkpoint = QuantizedCheckpoint(embedding.data, embedding.tensor_type,
                                     int(embedding.shape[0]))
    rows = checkpoint.narrow(0, 1000, 64)
    assert np.array_equal(dequantize_ref(rows, GGUFType.Q8_0, checkpoint.cols).numpy(),
                          oracle(np.asarray(embedding.data[1000:1064]), T.Q8_0))
    # every tensor of the file has its Hugging Face name
    names = {hf_name(t.name) for t in reader.tensors}
    assert len(names) == len(reader.tensors) == 272
    assert "model.layers.29.mlp.down_proj.weight" in names


@pytest.mark.slow
def test_demo_model_quantized_equals_its_float32_conversion_and_answers(demo_gguf):
    """The demo with --quantization gguf: its Q4_1 projections kept in their blocks (the
    twin on CPU), its logits those of the float32 conversion (the same gguf
    dequantization, then the same float32 matmuls), and it knows the capital of France:
    over the chat prompt and the answer, each answer token is the one it picks greedily
    (one prefill: a decode step dequantizes the whole model on CPU)."""
    from common.config import EngineConfig
    from common.model_files import load_tokenizer, resolve_model
    from services.worker.loader import load_model
    from tests.test_models import TOLERANCE, Paged, rel_err

    quantized, model_dir = load_gguf(Path(demo_gguf), quantization="gguf")
    assert quantized.model.layers[0].self_attn.qkv_proj.gguf_parts[0].qtype == GGUFType.Q4_1
    float_dir = resolve_model(demo_gguf)
    hf_config = load_hf_config(float_dir)
    converted = load_model(EngineConfig(model=str(float_dir)), hf_config,
                           torch.device("cpu"), torch.float32, float_dir)
    tokenizer = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    answer = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    ids = prompt + answer
    logits = {}
    for name, model in (("gguf", quantized), ("float32", converted)):
        paged = Paged(model, hf_config, block_size=16)
        (logits[name],) = paged.step([(paged.blocks(len(ids)), ids, 0)])
    assert rel_err(logits["gguf"], logits["float32"]) < TOLERANCE
    greedy = logits["gguf"][len(prompt) - 1:-1].argmax(dim=-1).tolist()
    assert tokenizer.decode(greedy) == "The capital of France is Paris."


# --- the quant method on today's linear layers -------------------------------------------

def gguf_layer(cls: type, *args, **kwargs) -> torch.nn.Module:
    """A linear layer built as a model's are under the gguf method."""
    with building_with(GGUFMethod()):
        return cls(*args, **kwargs)


def checkpoint(raw: np.ndarray, qtype: GGUFType) -> QuantizedCheckpoint:
    return QuantizedCheckpoint(raw, qtype, raw.shape[1] // layout(qtype).nbytes
                               * layout(qtype).values)


def test_method_on_qkv_of_mixed_types_equals_dequantized_matmul():
    """q and k in Q4_K (stacked into one weight), v in Q6_K, and a bias."""
    rng, seed = fresh_rng()
    hidden, head_dim, heads, kv_heads = 256, 8, 4, 2
    layer = gguf_layer(QKVParallelLinear, hidden, head_dim, heads, kv_heads, bias=True)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    method = layer.method
    parts = {"q": (random_raw(GGUFType.Q4_K, sizes[0], hidden, rng), GGUFType.Q4_K),
             "k": (random_raw(GGUFType.Q4_K, sizes[1], hidden, rng), GGUFType.Q4_K),
             "v": (random_raw(GGUFType.Q6_K, sizes[2], hidden, rng), GGUFType.Q6_K)}
    for shard_id, (raw, qtype) in parts.items():
        layer.weight.weight_loader(layer.weight, checkpoint(raw, qtype), shard_id)
    method.process_after_loading(layer)
    assert [part.qtype for part in layer.gguf_parts] == [GGUFType.Q4_K, GGUFType.Q6_K]
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (48, 144)
    assert layer.weight_part1.shape == (16, 210)
    weight = torch.from_numpy(np.concatenate([oracle(raw, qtype)
                                              for raw, qtype in parts.values()]))
    bias = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed))
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(method.apply(layer, x, bias), x @ weight.T + bias,
                               msg=f"seed {seed}")


def test_method_on_gate_up_and_a_float_part():
    """gate in Q5_K; up as a float tensor (a file's F32 or not-kept type): kept apart."""
    rng, seed = fresh_rng()
    hidden, inter = 256, 24
    layer = gguf_layer(MergedColumnParallelLinear, hidden, [inter, inter])
    method = layer.method
    gate = random_raw(GGUFType.Q5_K, inter, hidden, rng)
    up = torch.from_numpy(rng.standard_normal((inter, hidden)).astype(np.float32))
    layer.weight.weight_loader(layer.weight, checkpoint(gate, GGUFType.Q5_K), 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    method.process_after_loading(layer)
    weight = torch.cat([torch.from_numpy(oracle(gate, T.Q5_K)), up])
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(method.apply(layer, x, None), x @ weight.T, msg=f"seed {seed}")


@pytest.mark.parametrize("qtype", [GGUFType.Q8_0, GGUFType.Q4_K], ids=lambda t: t.name)
def test_method_row_parallel_rank_takes_whole_blocks_of_input(qtype):
    """Rank 1 of 2 of a row-parallel layer over 512 inputs takes columns 256..511 (its
    bytes of each row), and its partial product is x[:, 256:] W[:, 256:]^T."""
    rng, seed = fresh_rng()
    layer = gguf_layer(RowParallelLinear, 256, 6)
    layer.tp_rank, layer.tp_size = 1, 2
    method = layer.method
    raw = random_raw(qtype, 6, 512, rng)
    layer.weight.weight_loader(layer.weight, checkpoint(raw, qtype))
    method.process_after_loading(layer)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(seed))
    weight = torch.from_numpy(oracle(raw, qtype))[:, 256:]
    torch.testing.assert_close(method.apply(layer, x, None), x @ weight.T, msg=f"seed {seed}")


def test_method_refuses_a_split_inside_a_block_and_missing_parts():
    rng, _ = fresh_rng()
    layer = gguf_layer(RowParallelLinear, 384, 4)
    layer.tp_rank, layer.tp_size = 0, 2
    with pytest.raises(ValueError, match="only at its 256-value block boundaries, not into "
                                         "384 per rank"):
        layer.weight.weight_loader(layer.weight,
                                   checkpoint(random_raw(GGUFType.Q6_K, 4, 768, rng),
                                              GGUFType.Q6_K))
    layer = gguf_layer(MergedColumnParallelLinear, 256, [8, 8])
    method = layer.method
    layer.weight.weight_loader(layer.weight, checkpoint(random_raw(GGUFType.Q8_0, 8, 256, rng),
                                                        GGUFType.Q8_0), 0)
    with pytest.raises(ValueError, match=r"parts \[1\] of its weight were never loaded"):
        method.process_after_loading(layer)


# --- a GGUF model served quantized -------------------------------------------------------

# the tiny Llama's sizes: K-quant rows hold whole 256-value blocks, also on each of two
# ranks of a row-parallel layer (o_proj 512 inputs, down_proj 512)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 256, 8, 2, 64, 512, 2
# each projection's type in layer 0: parts of one layer in different ones; layer 1 takes
# Q4_0 and Q4_1 where layer 0 has Q8_0 (every kept type, once each at least)
PROJECTIONS = {"attn_q": (T.Q8_0, HEADS * HEAD_DIM, HIDDEN),
               "attn_k": (T.Q4_K, KV_HEADS * HEAD_DIM, HIDDEN),
               "attn_v": (T.Q6_K, KV_HEADS * HEAD_DIM, HIDDEN),
               "attn_output": (T.Q5_K, HIDDEN, HEADS * HEAD_DIM),
               "ffn_gate": (T.Q4_K, INTER, HIDDEN), "ffn_up": (T.Q8_0, INTER, HIDDEN),
               "ffn_down": (T.Q6_K, HIDDEN, INTER)}
LAYER_1 = {"attn_q": T.Q4_0, "ffn_up": T.Q4_1}
# fp16 scale fields of the random K-quant blocks: weights of some 0.05
K_SCALE = {T.Q4_K: 2e-4, T.Q5_K: 1e-4, T.Q6_K: 5e-5}
QUANTIZERS = (T.Q4_0, T.Q4_1, T.Q8_0)  # the types gguf.quants quantizes
# against transformers on the blocks it dequantizes (with the same gguf code the twin
# equals): the same float32 arithmetic in another order
LOGPROB_BOUND = 1e-4


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A GPT-2 style vocabulary: <|endoftext|>, the 256 byte symbols, a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he", "a n"]
    return ["<|endoftext|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "an"], merges


def write_tiny_llama(path: Path, rng: np.random.Generator) -> Path:
    """A two-layer Llama GGUF as llama.cpp lays one out: metadata, a byte-level BPE
    tokenizer, float norms and output, a Q8_0 embedding, projections of every kept type."""
    tokens, merges = byte_level_vocab()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)

    def normal(*shape: int, std: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    writer.add_tensor("token_embd.weight", gguf.quants.quantize(normal(len(tokens), HIDDEN),
                                                                T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", 1 + normal(HIDDEN, std=0.1))
    writer.add_tensor("output.weight", normal(len(tokens), HIDDEN, std=0.2))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + normal(HIDDEN, std=0.1))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + normal(HIDDEN, std=0.1))
        for name, (qtype, rows, cols) in PROJECTIONS.items():
            qtype = LAYER_1.get(name, qtype) if i == 1 else qtype
            data = (gguf.quants.quantize(normal(rows, cols, std=0.05), qtype)
                    if qtype in QUANTIZERS else
                    random_raw(GGUFType(int(qtype)), rows, cols, rng, K_SCALE[qtype]))
            writer.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HEADRACE_CACHE_DIR", str(tmp_path / "cache"))
    rng, seed = fresh_rng()
    print(f"tiny GGUF seed {seed}")
    return write_tiny_llama(tmp_path / "tiny.gguf", rng)


def transformers_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' own GGUF loading: it dequantizes every tensor (and unpermutes q/k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


PROMPT_IDS = [17, 260, 90, 3, 258, 101, 44, 200, 7, 259, 120, 66, 31, 250, 5, 99, 142, 12]


def test_llm_serves_a_gguf_quantized_equal_to_transformers(tiny_gguf):
    """LLM(..., quantization="gguf") on the tiny Llama's blocks, in prefill chunks of 8
    tokens (the GEMV's few rows and the dequantize-then-matmul path alike on the twin):
    prompt logprobs of transformers' dequantized model."""
    from common.sampling_params import SamplingParams
    from services.offline.llm import LLM

    llm = LLM(str(tiny_gguf), quantization="gguf", dtype="float32", device="cpu",
              block_size=4, num_gpu_blocks_override=32, max_num_batched_tokens=8,
              max_num_seqs=4)
    model = llm.engine.executor.runner.model
    layers = model.model.layers
    assert [part.qtype for part in layers[0].self_attn.qkv_proj.gguf_parts] == [
        GGUFType.Q8_0, GGUFType.Q4_K, GGUFType.Q6_K]
    assert [part.qtype for part in layers[1].mlp.gate_up_proj.gguf_parts] == [
        GGUFType.Q4_K, GGUFType.Q4_1]
    assert layers[1].self_attn.qkv_proj.weight.dtype == torch.uint8
    out = llm.generate([PROMPT_IDS], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    ref = transformers_logprobs(tiny_gguf, PROMPT_IDS)
    for pos in range(1, len(PROMPT_IDS)):
        token = PROMPT_IDS[pos]
        assert out.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref[pos - 1, token].item(), abs=LOGPROB_BOUND), pos


def load_gguf(path: Path, **engine) -> tuple[torch.nn.Module, Path]:
    from common.config import EngineConfig
    from common.model_info import resolve_engine
    from services.worker.loader import load_model

    resolved = resolve_engine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                           **engine))
    model = load_model(resolved.config, resolved.hf_config, torch.device("cpu"),
                       torch.float32, resolved.model_dir)
    return model, resolved.model_dir


def test_cpu_default_is_the_float32_conversion_written_on_first_use(tiny_gguf):
    """Without --quantization a CPU worker runs the float32 conversion, which the
    launcher's resolution does not write (a CUDA worker or a tokenizer never reads it)."""
    from common.config import EngineConfig
    from common.model_info import resolve_engine

    model_dir = resolve_engine(EngineConfig(model=str(tiny_gguf))).model_dir
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    assert not list(model_dir.glob("*.safetensors"))
    model, _ = load_gguf(tiny_gguf)
    assert (model_dir / "model.safetensors").is_file()
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and qkv.weight.shape == (768, HIDDEN)
    quantized, _ = load_gguf(tiny_gguf, quantization="gguf")
    ids = torch.tensor(PROMPT_IDS)
    g = torch.Generator().manual_seed(0)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                 "mlp.down_proj"):
        ours = quantized.model.layers[1].get_submodule(name)
        float_layer = model.model.layers[1].get_submodule(name)
        x = torch.randn(3, ours.input_size, generator=g)
        torch.testing.assert_close(ours(x), float_layer(x), msg=name)
    assert torch.equal(quantized.model.embed_tokens(ids), model.model.embed_tokens(ids))


def test_gguf_default_reads_blocks_on_cuda_where_it_can():
    from common.quantization import gguf_default

    llama = SimpleNamespace(model_type="llama", gguf_file="/m.gguf")
    assert gguf_default(llama, None, True, "auto") == "gguf"
    assert gguf_default(llama, None, False, "auto") is None  # CPU: float32
    assert gguf_default(llama, "gguf", False, "auto") == "gguf"
    assert gguf_default(llama, None, True, "dummy") is None
    gemma = SimpleNamespace(model_type="gemma2", gguf_file="/m.gguf")
    assert gguf_default(gemma, None, True, "auto") is None
    assert gguf_default(SimpleNamespace(model_type="llama"), None, True, "auto") is None



def test_gguf_refusals_are_one_line(tiny_gguf, tmp_path):
    from common.config import ConfigError, EngineConfig
    from common.model_info import resolve_engine
    from common.model_support import UnsupportedModel
    from common.quantization import QuantizationError, quant_spec
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "llama")
    with pytest.raises(UnsupportedModel, match="^--quantization gguf needs a .gguf model "
                                               "file; this model is not one$"):
        resolve_engine(EngineConfig(model=str(model_dir), quantization="gguf"))
    with pytest.raises(UnsupportedModel, match="^--quantization fp8 does not apply to a "
                                               "GGUF file; use gguf, or leave it out$"):
        resolve_engine(EngineConfig(model=str(tiny_gguf), quantization="fp8"))
    with pytest.raises(ConfigError, match="--load-format dummy cannot fill GGUF blocks"):
        resolve_engine(EngineConfig(model=str(tiny_gguf), quantization="gguf",
                                    load_format="dummy"))
    gemma = SimpleNamespace(model_type="gemma2", gguf_file="/m.gguf")
    with pytest.raises(QuantizationError, match="a 'gemma2' GGUF file is not read quantized"):
        quant_spec(gemma, "gguf")


def test_a_rank_holds_its_rows_and_whole_blocks_of_a_gguf_model(tiny_gguf, monkeypatch):
    """Rank 1 of 2: each column-parallel part's rows, each row-parallel layer's second half
    of every row's blocks (256 of the 256 per rank the K types' blocks allow), dequantized
    equal to the one-rank layer's."""
    from tests.test_tensor_parallel import as_rank

    whole, _ = load_gguf(tiny_gguf, quantization="gguf")
    as_rank(monkeypatch, 1, 2)
    shard, _ = load_gguf(tiny_gguf, quantization="gguf")
    for name, module in whole.named_modules():
        if not hasattr(module, "gguf_parts"):
            continue
        ours = shard.get_submodule(name)
        full, mine = dequantized_parts(module), dequantized_parts(ours)
        if module.input_split:
            expected = [w[:, w.shape[1] // 2:] for w in full]
        else:
            expected = [w[w.shape[0] // 2:] if len(full) == 1 else w.chunk(2)[1]
                        for w in full]
        assert all(torch.equal(a, b) for a, b in zip(mine, expected)), name


def test_an_adapter_on_gguf_blocks_matches_peft(tiny_gguf, tmp_path):
    """LoRA beside the blocks (the base's own matmul, then the adapter's shrink): prompt
    logprobs of PEFT's merged adapter on the file's float32 conversion."""
    from common.messages import LoRARequest
    from common.model_files import gguf_to_hf_dir
    from common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    from tests.test_lora import make_adapter, merged_model

    float_dir = gguf_to_hf_dir(tiny_gguf)
    adapter = make_adapter(float_dir, tmp_path / "adapter", seed=3, rank=8, alpha=16,
                           modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                           rslora=False)
    with torch.no_grad():
        ref = torch.log_softmax(merged_model(float_dir, adapter)(
            torch.tensor([PROMPT_IDS])).logits[0], dim=-1)
    llm = LLM(str(tiny_gguf), quantization="gguf", dtype="float32", device="cpu",
              block_size=4, num_gpu_blocks_override=32, enable_lora=True, max_lora_rank=8,
              max_loras=1, max_num_seqs=4)
    out = llm.generate([PROMPT_IDS], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False, lora_request=[LoRARequest("a", 1, adapter)])[0]
    for pos in range(1, len(PROMPT_IDS)):
        token = PROMPT_IDS[pos]
        assert out.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref[pos - 1, token].item(), abs=LOGPROB_BOUND), pos


def rank_gguf_logits(rank: int, world: int, init_file: str, path: str, ids: list[int],
                     results) -> None:
    """One gloo rank of the tiny GGUF model, kept quantized: its prefill logits."""
    import torch.distributed as dist

    from services.worker.layers.parallel import building_for
    from tests.test_models import Paged
    from tests.test_tensor_parallel import world_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        with building_for(world_group(world)):
            model, model_dir = load_gguf(Path(path), quantization="gguf",
                                         tensor_parallel_size=world)
        paged = Paged(model, load_hf_config(model_dir), block_size=4, tp_size=world)
        (logits,) = paged.step([(paged.blocks(len(ids)), ids, 0)])
        results.put((rank, logits.numpy()))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)  # as tests/test_tensor_parallel.rank_logits: skip the interpreter's teardown


def test_a_gguf_model_kept_quantized_runs_over_two_gloo_ranks(tiny_gguf, tmp_path):
    """Each rank's logits are one rank's (no activation is quantized: the all-reduced
    partial sums differ only in their order)."""
    import multiprocessing

    from tests.test_models import TOLERANCE, Paged, rel_err
    from tests.test_tensor_parallel import collect

    model, model_dir = load_gguf(tiny_gguf, quantization="gguf")  # converts the config
    paged = Paged(model, load_hf_config(model_dir), block_size=4)
    (whole,) = paged.step([(paged.blocks(len(PROMPT_IDS)), PROMPT_IDS, 0)])
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_gguf_logits, args=(rank, 2, str(tmp_path / "init"),
                                                        str(tiny_gguf), PROMPT_IDS, results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    for rank, logits in collect(results, procs, 2):
        assert rel_err(torch.from_numpy(logits), whole) < TOLERANCE, rank


def dequantized_parts(layer: torch.nn.Module) -> list[torch.Tensor]:
    """Each fused part's float weight, however the parts were stacked."""
    weights = [part.weight.float() if part.qtype is None
               else dequantize_ref(part.weight, part.qtype, layer.gguf_input_size)
               for part in layer.gguf_parts]
    return list(torch.cat(weights).split(layer.gguf_output_sizes))


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
