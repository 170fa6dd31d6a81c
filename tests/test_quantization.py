"""Quantized checkpoints (W8A8) against independent references, on CPU (kernels/quant.py's
torch twins; the Triton kernels are tests/test_kernels_triton.py's).

- compressed-tensors FP8 (per-tensor weights, static per-tensor input scales), FP8_DYNAMIC
  (per-channel weights, dynamic per-token activations) and INT8 W8A8 checkpoints, written
  in compressed-tensors' documented on-disk format, against transformers loading them
  (compressed-tensors decompresses the weights and quantizes each Linear's input as the
  scheme says): the logits agree to float32 rounding; INT8's within 1e-1, as
  compressed-tensors quantizes activations by amax / 127.5 where vLLM (and headrace)
  divide by 127, and to float32 rounding against transformers on the dequantized
  weights with the test's own per-token int8 activations. (A random tiny model amplifies any
  one fp8 rounding that differs into logits some 10% apart, so the bound is that tight or
  useless; the per-part scales a fused layer folds are checked on their own.)
- Hugging Face fp8 checkpoints with 128x128 weight blocks, written by hand, against
  transformers on the dequantized weights with each Linear's input quantized per 1x128
  group by the test (the same arithmetic, written here), aligned (every fused part whole
  blocks) and not (a tiny model's 64-row parts).
- --quantization fp8 on an unquantized checkpoint against transformers on the weights
  quantized per channel the same way, and within 0.25 of the unquantized model.
- Mixtures of experts' fp8 experts (FP8_DYNAMIC, 128x128 blocks, online fp8) against
  transformers on the dequantized weights with every projection's input quantized the
  same way, the experts' included (through F.linear, which transformers' eager experts
  call); per-tensor scales and static input scales on one layer by hand.
- Rank 1 of 2 holds exactly its shard of every quantized tensor (the experts' too); two
  gloo ranks run the model near one rank's logits; refusals in one line.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import EngineConfig
from common.model_files import load_hf_config
from common.model_support import REFUSED_EXIT, UnsupportedModel, check_model_support
from kernels.quant import dequantize, quantize_per_token_ref, scaled_mm_ref
from services.worker.layers.linear import LinearBase, RowParallelLinear
from services.worker.loader import load_model
from tests.conftest import run_command
from tests.e2e_fixtures import tiny_serve_args
from tests.test_models import Paged, rel_err, token_ids
from tests.test_tensor_parallel import as_rank, run_ranks
from tests.tiny_models import make_tiny_model, tiny_config

CPU = torch.device("cpu")
FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
EXACT = 1e-5  # the same arithmetic in float32, summed in another order
INT8_BOUND = 1e-1  # against compressed-tensors' own int8 activations (amax / 127.5)
# online fp8 against the unquantized model: e4m3's few-percent rounding of every weight and
# activation, which the tiny random models (weights of std 0.2) amplify to some 13%
ONLINE_BOUND = 0.25
# a mixture of experts' further: a token whose top-2 experts were nearly tied may route
# to another expert (its logits then differ by far more than the rounding)
MOE_ONLINE_BOUND = 0.4
TP_BOUND = 0.1  # two gloo ranks against one (see the test)
PROMPT = token_ids(24, seed=5)

SCHEMES = {  # compressed-tensors preset name: (weights, input activations)
    "FP8": ({"type": "float", "strategy": "tensor"},
            {"type": "float", "strategy": "tensor", "dynamic": False}),
    "FP8_DYNAMIC": ({"type": "float", "strategy": "channel"},
                    {"type": "float", "strategy": "token", "dynamic": True}),
    "W8A8": ({"type": "int", "strategy": "channel"},
             {"type": "int", "strategy": "token", "dynamic": True}),
}


# --- writing checkpoints ----------------------------------------------------------------

def quantize_weight(w: torch.Tensor, kind: str, per_channel: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit quantization as llm-compressor does it: scale = amax / max."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    if kind == "int":
        scale = amax / 127.0
        return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale
    scale = amax / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def is_quantized_linear(name: str) -> bool:
    """A decoder projection's weight, an expert's included (Mixtral's `experts.{e}.w1`);
    not a router's (`mlp.gate`) nor Qwen2-MoE's shared expert gate."""
    return ".layers." in name and (name.endswith("_proj.weight")
                                   or ".experts." in name and name.endswith(".weight"))


def input_amaxes(model_dir: Path) -> dict[str, float]:
    """Calibration: each quantized Linear's largest input magnitude over the prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    amax: dict[str, float] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantized_linear(name + ".weight"):
            module.register_forward_pre_hook(
                lambda m, args, name=name: amax.__setitem__(name, args[0].abs().max().item()))
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    return amax


def write_compressed_tensors(src: Path, scheme: str, ignore: list[str] | None = None
                             ) -> Path:
    """src's tiny model as a compressed-tensors checkpoint of `scheme`, in place; ignore:
    the config's list of unquantized modules (default: the LM head)."""
    weights_args, input_args = SCHEMES[scheme]
    kind, per_channel = weights_args["type"], weights_args["strategy"] == "channel"
    static = not input_args["dynamic"]
    amax = input_amaxes(src) if static else {}
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not is_quantized_linear(name):
            tensors[name] = tensor
            continue
        prefix = name[:-len("weight")]
        tensors[name], tensors[prefix + "weight_scale"] = quantize_weight(tensor, kind,
                                                                          per_channel)
        if static:  # q, k and v share their input, so their scales are equal
            tensors[prefix + "input_scale"] = torch.tensor([amax[prefix[:-1]] / FP8_MAX])
    save_file(tensors, src / "model.safetensors")
    edit_config(src, quantization_config=compressed_tensors_config(scheme, ignore))
    return src


def compressed_tensors_config(scheme: str, ignore: list[str] | None = None
                              ) -> dict[str, object]:
    weights_args, input_args = SCHEMES[scheme]
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "symmetric": True, "dynamic": False, **weights_args},
             "input_activations": {"num_bits": 8, "symmetric": True, **input_args}}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": f"{weights_args['type']}-quantized",
            "config_groups": {"group_0": group}, "ignore": ignore or ["lm_head"]}


def dequantize_checkpoint(model_dir: Path) -> None:
    """A compressed-tensors checkpoint of per-channel weights as the float weights it
    holds, unquantized."""
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        weight = name.replace("weight_scale", "weight")
        tensors[weight] = tensors[weight].float() * tensors.pop(name)
    save_file(tensors, model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))


def fp8_per_channel_in_place(model_dir: Path) -> None:
    """The checkpoint's projections as fp8 per output channel (online fp8) would hold
    them, dequantized: the oracle's weights."""
    tensors = load_file(model_dir / "model.safetensors")
    for name, w in tensors.items():
        if is_quantized_linear(name):
            q, scale = quantize_weight(w, "float", per_channel=True)
            tensors[name] = q.float() * scale
    save_file(tensors, model_dir / "model.safetensors")


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def write_fp8_blocks(src: Path, out: Path, block: int = 128) -> Path:
    """src's model as a Hugging Face fp8 checkpoint with block x block weight scales
    (weight_scale_inv [ceil(out / block), ceil(in / block)]); src keeps the dequantized
    weights, for transformers."""
    import shutil

    shutil.copytree(src, out)
    quantized, dequantized = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not is_quantized_linear(name):
            quantized[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        blocks_r, blocks_c = math.ceil(rows / block), math.ceil(cols / block)
        q = torch.empty(rows, cols, dtype=FP8)
        scale = torch.empty(blocks_r, blocks_c)
        deq = torch.empty_like(w)
        for i in range(blocks_r):
            for j in range(blocks_c):
                part = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
                scale[i, j] = w[part].abs().max() / FP8_MAX
                q[part] = (w[part] / scale[i, j]).to(FP8)
                deq[part] = q[part].float() * scale[i, j]
        quantized[name], dequantized[name] = q, deq
        quantized[name[:-len("weight")] + "weight_scale_inv"] = scale
    save_file(quantized, out / "model.safetensors")
    save_file(dequantized, src / "model.safetensors")
    edit_config(out, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [block, block]})
    return out


# --- running them -----------------------------------------------------------------------

def load(model_dir: Path, **engine) -> torch.nn.Module:
    config = EngineConfig(model=str(model_dir), dtype="float32", **engine)
    return load_model(config, load_hf_config(model_dir), CPU, torch.float32)


def ours(model_dir: Path, **engine) -> tuple[torch.Tensor, torch.nn.Module]:
    """Our logits of PROMPT, and the model."""
    hf_config = load_hf_config(model_dir)
    model = load(model_dir, **engine)
    paged = Paged(model, hf_config, block_size=4)
    (logits,) = paged.step([(paged.blocks(len(PROMPT)), PROMPT, 0)])
    return logits, model


def fake_quant(x: torch.Tensor, group: int | None, kind: str = "float") -> torch.Tensor:
    """x quantized to e4m3 (or int8) per token (or per 1 x group slice of one) and
    back; int8 rounds half away from zero, as vLLM's kernel."""
    flat = x.reshape(-1, x.shape[-1]).float()
    rows, cols = flat.shape
    group = group or cols
    out = torch.empty(rows, cols)
    for start in range(0, cols, group):
        part = flat[:, start:start + group]
        top = FP8_MAX if kind == "float" else 127.0
        scale = (part.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-10)
        v = part / scale
        q = v.to(FP8).float() if kind == "float" else v.sign() * (v.abs() + 0.5).floor()
        out[:, start:start + group] = q * scale
    return out.view(x.shape)


def transformers_logits(model_dir: Path, activation_group: int | None | bool = False,
                        kind: str = "float") -> torch.Tensor:
    """transformers' logits of PROMPT; with activation_group (None: per token) every
    decoder Linear's input is quantized to fp8 (kind "int": int8) first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if activation_group is not False:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and is_quantized_linear(name + ".weight"):
                module.register_forward_pre_hook(
                    lambda m, args: (fake_quant(args[0], activation_group, kind),))
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


# --- compressed-tensors -------------------------------------------------------------------

@pytest.mark.parametrize("scheme,arch", [
    ("FP8", "llama"), ("FP8", "qwen3"), ("FP8_DYNAMIC", "qwen3"), ("FP8_DYNAMIC", "phi3"),
    ("W8A8", "qwen3"), ("W8A8", "llama")])
def test_compressed_tensors_matches_transformers(scheme, arch, tmp_path, caplog):
    model_dir = make_tiny_model(tmp_path, arch)
    unquantized, _ = ours(model_dir)
    write_compressed_tensors(model_dir, scheme)
    with caplog.at_level(logging.INFO, logger="headrace.worker.loader"):
        logits, model = ours(model_dir)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == (torch.int8 if scheme == "W8A8" else FP8)
    assert rel_err(logits, unquantized) > 1e-4  # the quantization is really there
    if scheme != "W8A8":
        assert rel_err(logits, transformers_logits(model_dir)) < EXACT
    else:  # compressed-tensors' int8 activations take amax / 127.5, vLLM's amax / 127
        assert rel_err(logits, transformers_logits(model_dir)) < INT8_BOUND
        dequantize_checkpoint(model_dir)
        assert rel_err(logits, transformers_logits(model_dir, None, "int")) < EXACT
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert f"compressed-tensors ({'int8' if scheme == 'W8A8' else 'fp8'} weights" in caplog.text
    assert f"{weight_bytes / 2 ** 30:.3f} GiB" in caplog.text


def test_fp8_per_tensor_checkpoint_is_read_as_compressed_tensors_fp8(tmp_path):
    """vLLM's own fp8 format (per-tensor weight_scale, static input_scale) holds the same
    tensors as compressed-tensors' FP8 under another quantization_config."""
    model_dir = write_compressed_tensors(make_tiny_model(tmp_path, "qwen3"), "FP8")
    compressed_tensors, _ = ours(model_dir)
    edit_config(model_dir, quantization_config={"quant_method": "fp8",
                                                "activation_scheme": "static"})
    fp8, model = ours(model_dir)
    assert model.model.layers[0].mlp.gate_up_proj.input_scale.numel() == 1
    assert torch.equal(fp8, compressed_tensors)


def test_llm_prompt_logprobs_match_transformers(tmp_path):
    """Through LLM(...), in prefill chunks of 8 tokens: per-token activation scales do not
    depend on the batch, so the chunks give transformers' whole-prompt logprobs."""
    from common.sampling_params import SamplingParams
    from services.offline.llm import LLM

    model_dir = write_compressed_tensors(make_tiny_model(tmp_path, "qwen3"), "FP8_DYNAMIC")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4,
              num_gpu_blocks_override=64, max_num_batched_tokens=8, max_num_seqs=4)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(transformers_logits(model_dir), dim=-1)
    for pos in range(1, len(PROMPT)):
        token = PROMPT[pos]
        assert out.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref[pos - 1, token].item(), abs=1e-4)


# --- Hugging Face fp8 blocks ----------------------------------------------------------------

@pytest.mark.parametrize("arch,overrides", [
    # q 256, k/v 128 rows, MLP 384: whole blocks, two or three along K
    ("qwen3", dict(hidden_size=256, intermediate_size=384, head_dim=64)),
    ("llama", {})])  # parts of 64 and 32 rows: blocks straddle nothing, scales go per row
def test_fp8_block_checkpoint_matches_dequantized_transformers(arch, overrides, tmp_path):
    src = make_tiny_model(tmp_path, arch, **overrides)
    quantized = write_fp8_blocks(src, tmp_path / "fp8")
    logits, model = ours(quantized)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8
    assert qkv.block_n == (128 if overrides else 1)
    assert rel_err(logits, transformers_logits(src, activation_group=128)) < EXACT


# --- online fp8 -------------------------------------------------------------------------------

def test_online_fp8_quantizes_an_unquantized_checkpoint(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3")
    unquantized, _ = ours(model_dir)
    logits, model = ours(model_dir, quantization="fp8")
    assert model.model.layers[1].mlp.down_proj.weight.dtype == FP8
    assert ONLINE_BOUND > rel_err(logits, unquantized) > 1e-4
    # the same weights quantized per channel by the test, activations per token
    fp8_per_channel_in_place(model_dir)
    assert rel_err(logits, transformers_logits(model_dir, activation_group=None)) < EXACT


def test_a_fused_layer_folds_its_parts_scales():
    """q, k and v's per-tensor weight scales each stay on their part's rows; one input
    tensor takes the largest of their input scales (nothing of it clips)."""
    from common.quantization import QuantSpec
    from services.worker.layers.linear import QKVParallelLinear
    from services.worker.layers.quantization import W8A8Method, building_with

    with building_with(W8A8Method(QuantSpec("compressed-tensors", "fp8", "tensor", "static"))):
        layer = QKVParallelLinear(32, 8, 4, 2)
    g = torch.Generator().manual_seed(2)
    parts = {"q": 32, "k": 16, "v": 16}
    weights = {p: torch.randn(n, 32, generator=g) for p, n in parts.items()}
    for i, (part, w) in enumerate(weights.items()):
        q, scale = quantize_weight(w, "float", per_channel=False)
        layer.weight_loader(layer.weight, q, part)
        layer.weight_loader(layer.weight_scale, scale, part)
        layer.weight_loader(layer.input_scale, torch.tensor(0.01 * (i + 1)), part)
    layer.method.process_after_loading(layer)
    assert layer.input_scale.item() == pytest.approx(0.03)
    x = torch.randn(5, 32, generator=g)
    xq = (x / 0.03).to(FP8).float() * 0.03
    expected = xq @ torch.cat([quantize_weight(w, "float", False)[0].float()
                               * quantize_weight(w, "float", False)[1]
                               for w in weights.values()]).T
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_decode_rows_take_the_weight_only_gemv_cuda(strategy):
    """On CUDA a step of at most 16 rows multiplies the fp8 weights by the bf16 rows
    themselves (kernels/fp8_gemv.py), the weight's scales as the layer holds them; 17 rows
    keep the per-token quantize and the W8A8 GEMM. (On CPU every step keeps the W8A8 twin:
    test_a_fused_layer_folds_its_parts_scales runs 5 rows through it.)"""
    from common.quantization import QuantSpec
    from kernels.fp8_gemv import fp8_gemv
    from kernels.quant import quantize_per_token, scaled_mm
    from services.worker.layers.linear import QKVParallelLinear
    from services.worker.layers.quantization import W8A8Method, building_with

    activations = {"tensor": "static", "channel": "token", "block": "group"}[strategy]
    spec = QuantSpec("fp8", "fp8", strategy, activations, online=strategy == "channel")
    with building_with(W8A8Method(spec)):
        layer = QKVParallelLinear(256, 128, 2, 1)
    g = torch.Generator().manual_seed(3)
    for name, param in layer.named_parameters():  # weights N(0, 1), scales 0.01 to 0.03
        values = torch.randn(param.shape, generator=g) if name == "weight" else (
            torch.rand(param.shape, generator=g) * 0.02 + 0.01)
        param.data.copy_(values.to(param.dtype))
    layer.method.process_after_loading(layer)
    layer.to("cuda")
    for rows in (1, 16, 17):
        x = torch.randn(rows, 256, generator=g).to("cuda", torch.bfloat16)
        if rows <= 16:
            expected = fp8_gemv(x, layer.weight, layer.weight_scale,
                                block=(layer.block_n, layer.group_k))
        elif strategy == "tensor":
            continue  # static input scales: the W8A8 path, as test_a_fused_layer_... checks
        else:
            group = layer.group_k if strategy == "block" else None
            q, scale = quantize_per_token(x, FP8, group)
            expected = scaled_mm(q, scale, layer.weight, layer.weight_scale, layer.block_n,
                                 layer.group_k, torch.bfloat16)
        assert torch.equal(layer(x), expected), f"{strategy}, {rows} rows"

@pytest.mark.parametrize("scheme", [None, "FP8", "W8A8"])
def test_dummy_weights_run_quantized(scheme, tmp_path):
    """--load-format dummy: online fp8 of the random weights, or random tensors in a
    checkpoint format's shapes (for benchmarks: the values mean nothing)."""
    model_dir = make_tiny_model(tmp_path, "llama")
    if scheme is not None:
        write_compressed_tensors(model_dir, scheme)
    logits, model = ours(model_dir, quantization="fp8" if scheme is None else None,
                         load_format="dummy")
    dtype = torch.int8 if scheme == "W8A8" else FP8
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == dtype
    assert torch.isfinite(logits).all()


# --- mixtures of experts: fp8 experts ---------------------------------------------------------

def transformers_moe_logits(model_dir: Path, activation_group: int | None) -> torch.Tensor:
    """transformers' logits of PROMPT with every decoder projection's input, the experts'
    included, quantized to fp8 per token (or per 1 x group) first. transformers holds the
    experts in stacked tensors and its eager experts multiply each expert's slice by
    F.linear, so the quantization goes into F.linear for every weight but the routers',
    the LM head's (and Qwen2-MoE's shared expert gate, unquantized here too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    unquantized = {id(model.lm_head.weight)} | {
        id(p) for name, p in model.named_parameters()
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                          "shared_expert_gate.weight"))}
    assert len(unquantized) > 1, "no router found"
    linear = torch.nn.functional.linear

    def quantized_linear(x, weight, bias=None):
        if id(weight) not in unquantized:
            x = fake_quant(x, activation_group)
        return linear(x, weight, bias)

    torch.nn.functional.linear = quantized_linear
    try:
        with torch.no_grad():
            return model(torch.tensor([PROMPT])).logits[0].float()
    finally:
        torch.nn.functional.linear = linear


def fused_moe_layers(model: torch.nn.Module) -> list:
    from services.worker.layers.moe import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_dynamic_experts_match_transformers(arch, tmp_path):
    """compressed-tensors FP8_DYNAMIC (per-channel expert scales, per-token activations,
    the router in the ignore list as llm-compressor writes it) against transformers on
    the dequantized weights with the same activation quantization."""
    model_dir = make_tiny_model(tmp_path, arch)
    unquantized, _ = ours(model_dir)
    write_compressed_tensors(model_dir, "FP8_DYNAMIC", ignore=[
        "lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"])
    logits, model = ours(model_dir)
    moe = fused_moe_layers(model)
    assert moe and all(m.w13.dtype == m.w2.dtype == FP8 for m in moe)
    assert moe[0].w13_scale.shape == (8, 64, 1) and moe[0].w2_scale.shape == (8, 64, 1)
    assert rel_err(logits, unquantized) > 1e-4
    dequantize_checkpoint(model_dir)
    assert rel_err(logits, transformers_moe_logits(model_dir, None)) < EXACT


def test_fp8_moe_prompt_logprobs_match_transformers(tmp_path):
    """Through LLM(...) in prefill chunks of 8 tokens, as the dense test above: the prompt
    logprobs of a Qwen3-MoE FP8_DYNAMIC checkpoint within 1e-4 of transformers'."""
    from common.sampling_params import SamplingParams
    from services.offline.llm import LLM

    model_dir = write_compressed_tensors(make_tiny_model(tmp_path, "qwen3_moe"),
                                         "FP8_DYNAMIC")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4,
              num_gpu_blocks_override=64, max_num_batched_tokens=8, max_num_seqs=4)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    dequantize_checkpoint(model_dir)
    ref = torch.log_softmax(transformers_moe_logits(model_dir, None), dim=-1)
    for pos in range(1, len(PROMPT)):
        token = PROMPT[pos]
        assert out.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref[pos - 1, token].item(), abs=1e-4)


@pytest.mark.parametrize("overrides", [
    # experts' 128 rows of gate and of up, hidden 256: whole 128x128 blocks
    dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=128, head_dim=64),
    {}])  # 32 rows: each part's rows take their block's scale
def test_fp8_block_experts_match_dequantized_transformers(overrides, tmp_path):
    """Qwen3-30B-A3B-FP8's format: each expert's weight_scale_inv, the routers listed in
    modules_to_not_convert; activations per 1 x 128 group."""
    src = make_tiny_model(tmp_path, "qwen3_moe", **overrides)
    quantized = write_fp8_blocks(src, tmp_path / "fp8")
    edit_config(quantized, quantization_config={
        **json.loads((quantized / "config.json").read_text())["quantization_config"],
        "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.gate"]})
    logits, model = ours(quantized)
    moe = fused_moe_layers(model)[0]
    assert moe.w13.dtype == FP8 and moe.block_n == (128 if overrides else 1)
    assert rel_err(logits, transformers_moe_logits(src, 128)) < EXACT


def test_online_fp8_quantizes_the_experts(tmp_path):
    """--quantization fp8 on a bf16-style unquantized MoE checkpoint: experts per channel,
    near the unquantized model, and equal to transformers on the same quantized weights."""
    model_dir = make_tiny_model(tmp_path, "qwen2_moe")
    unquantized, _ = ours(model_dir)
    logits, model = ours(model_dir, quantization="fp8")
    moe = fused_moe_layers(model)[0]
    assert moe.w13.dtype == FP8 and moe.w13_scale.shape == (8, 64, 1)
    assert MOE_ONLINE_BOUND > rel_err(logits, unquantized) > 1e-4
    fp8_per_channel_in_place(model_dir)
    assert rel_err(logits, transformers_moe_logits(model_dir, None)) < EXACT


def test_expert_scales_route_to_their_stacked_parameters():
    """Each expert's scale tensors go to the stacked scale of their tensor's name, with
    the expert and part as shard id (Mixtral's w1/w2/w3 names too)."""
    from services.worker.loader import route
    from services.worker.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

    prefix = "model.layers.3.mlp.experts"
    assert route(f"{prefix}.5.up_proj.weight_scale_inv", Qwen3MoeForCausalLM) == (
        f"{prefix}.w13_weight_scale_inv", (5, "up"))
    assert route(f"{prefix}.0.down_proj.input_scale", Qwen3MoeForCausalLM) == (
        f"{prefix}.w2_input_scale", (0, "down"))
    assert route(f"{prefix}.2.gate_proj.weight", Qwen3MoeForCausalLM) == (
        f"{prefix}.w13", (2, "gate"))
    assert route("model.layers.0.block_sparse_moe.experts.7.w3.weight_scale",
                 MixtralForCausalLM) == ("model.layers.0.mlp.experts.w13_weight_scale",
                                         (7, "up"))


def test_per_tensor_expert_scales_stay_on_their_parts():
    """Per-tensor checkpoints (FP8 with static input scales): gate's and up's scales
    each stay on their own rows of w13; each GEMM's input takes the largest input scale
    of all experts (the one tensor they share clips nowhere)."""
    from common.quantization import QuantSpec
    from kernels.moe import fused_moe_ref
    from services.worker.layers.moe import FusedMoE
    from services.worker.layers.quantization import W8A8Method, building_with

    with building_with(W8A8Method(QuantSpec("compressed-tensors", "fp8", "tensor", "static"))):
        layer = FusedMoE(4, 2, 32, 16, renormalize=True, round_weights=False)
    g = torch.Generator().manual_seed(4)
    dequantized = {}
    for e in range(4):
        for which, shape in (("gate", (16, 32)), ("up", (16, 32)), ("down", (32, 16))):
            q, scale = quantize_weight(torch.randn(*shape, generator=g) * (e + 1), "float",
                                       per_channel=False)
            param = layer.w2 if which == "down" else layer.w13
            layer.weight_loader(param, q, (e, which))
            scale_param = layer.w2_weight_scale if which == "down" else layer.w13_weight_scale
            layer.weight_loader(scale_param, scale, (e, which))
            input_param = layer.w2_input_scale if which == "down" else layer.w13_input_scale
            layer.weight_loader(input_param, torch.tensor([0.01 * (e + 1)]), (e, which))
            dequantized[e, which] = q.float() * scale
    layer.method.process_after_loading(layer)
    assert layer.w13_input_scale.item() == layer.w2_input_scale.item() == pytest.approx(0.04)
    x = torch.randn(5, 32, generator=g)
    logits = torch.randn(5, 4, generator=g)
    weights, ids = logits.softmax(-1).topk(2)
    weights = weights / weights.sum(-1, keepdim=True)
    out = layer(x, logits)
    # the same by hand: fp8 inputs at the fixed scale 0.04, float32 dequantized weights
    w13 = torch.stack([torch.cat([dequantized[e, "gate"], dequantized[e, "up"]])
                       for e in range(4)])
    w2 = torch.stack([dequantized[e, "down"] for e in range(4)])
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = ids[t, j].item()
            gate, up = (fake_static(x[t]) @ w13[e].T).split(16)
            act = torch.nn.functional.silu(gate) * up
            expected[t] += weights[t, j] * (fake_static(act) @ w2[e].T)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-3)


def fake_static(x: torch.Tensor, scale: float = 0.04) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


@pytest.mark.parametrize("scheme", [None, "FP8", "blocks"])
def test_dummy_weights_run_fp8_experts(scheme, tmp_path):
    """--load-format dummy on a MoE model: online fp8, or random tensors in a checkpoint
    format's shapes (per-tensor with static input scales; 128x128 blocks)."""
    model_dir = make_tiny_model(tmp_path, "mixtral")
    if scheme == "FP8":  # the config alone: dummy weights read no tensor
        edit_config(model_dir, quantization_config=compressed_tensors_config(scheme))
    elif scheme == "blocks":
        edit_config(model_dir, quantization_config={
            "quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]})
    logits, model = ours(model_dir, quantization="fp8" if scheme is None else None,
                         load_format="dummy")
    moe = fused_moe_layers(model)[0]
    assert moe.w13.dtype == FP8 and torch.isfinite(logits).all()


def test_the_floor_counts_fp8_experts_bytes(tmp_path):
    """An fp8 expert is a byte a weight plus its float32 scales (per output channel)."""
    from benchmarks.bench.workloads import ModelShape

    model_dir = make_tiny_model(tmp_path, "qwen3_moe")
    _, model = ours(model_dir, quantization="fp8")
    hf_config = load_hf_config(model_dir)
    shape = ModelShape.of(model, hf_config, 1, 4)
    moe = fused_moe_layers(model)
    weights = 2 * 32 * 64 + 64 * 32  # w13 and w2 of one expert
    assert shape.expert_bytes == weights + 4 * (2 * 32 + 64)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert shape.weight_bytes == all_bytes - len(moe) * 8 * shape.expert_bytes


def test_a_rank_holds_its_shard_of_the_experts(tmp_path, monkeypatch):
    """Rank 1 of 2: its half of every expert's gate and up rows (and their per-channel
    scales) and of its down columns; the down scales whole."""
    model_dir = write_compressed_tensors(make_tiny_model(tmp_path, "qwen3_moe"),
                                         "FP8_DYNAMIC")
    whole = fused_moe_layers(load(model_dir))[0]
    as_rank(monkeypatch, 1, 2)
    shard = fused_moe_layers(load(model_dir))[0]
    rows = torch.cat([torch.arange(16, 32), torch.arange(48, 64)])  # gate's, up's
    assert torch.equal(shard.w13.float(), whole.w13.float()[:, rows])
    assert torch.equal(shard.w13_scale, whole.w13_scale[:, rows])
    assert torch.equal(shard.w2.float(), whole.w2.float()[:, :, 16:])
    assert torch.equal(shard.w2_scale, whole.w2_scale)


# --- tensor parallelism -------------------------------------------------------------------------

def dequantized(layer) -> torch.Tensor:
    return dequantize(layer.weight.data, layer.weight_scale.data, layer.block_n, layer.group_k)


def projections_at_rank_1(model_dir: Path, monkeypatch
                          ) -> list[tuple[LinearBase, LinearBase]]:
    """Each projection of the model loaded whole beside the same one at rank 1 of 2."""
    whole = load(model_dir)
    as_rank(monkeypatch, 1, 2)
    layers = dict(load(model_dir).named_modules())
    pairs = [(module, layers[name]) for name, module in whole.named_modules()
             if isinstance(module, LinearBase)]
    assert len(pairs) == 4 * whole.num_layers
    return pairs


def expected_shard(whole, shard, full: torch.Tensor | None = None) -> torch.Tensor:
    """The rows (column-parallel) or columns (row-parallel) of the one-rank layer's
    dequantized weight (`full`, by default the W8A8 one) that rank `shard.tp_rank` must
    hold."""
    full = dequantized(whole) if full is None else full
    if isinstance(shard, RowParallelLinear):
        return full.narrow(1, shard.tp_rank * shard.input_size, shard.input_size)
    starts = {shard_id: part.offset for shard_id, part in whole.output_shards().items()}
    return torch.cat([full.narrow(0, starts[shard_id] + part.index * part.size, part.size)
                      for shard_id, part in shard.output_shards().items()])


@pytest.mark.parametrize("scheme", ["FP8", "W8A8", "blocks"])
def test_a_rank_holds_its_shard_of_every_quantized_tensor(scheme, tmp_path, monkeypatch):
    """Rank 1 of 2: per-part scales (FP8), per-channel ones (W8A8) and 128x128 blocks,
    whose fused parts (q 256, k/v 128, gate/up 256 rows a rank) are whole blocks."""
    if scheme == "blocks":
        src = make_tiny_model(tmp_path, "qwen3", hidden_size=512, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=64)
        model_dir = write_fp8_blocks(src, tmp_path / "fp8")
    else:
        model_dir = write_compressed_tensors(make_tiny_model(tmp_path, "qwen3"), scheme)
    for module, rank_module in projections_at_rank_1(model_dir, monkeypatch):
        assert torch.equal(dequantized(rank_module), expected_shard(module, rank_module))
        if scheme == "FP8":
            assert torch.equal(rank_module.input_scale, module.input_scale)


def test_block_scales_that_a_rank_would_split_are_refused(tmp_path, monkeypatch):
    src = make_tiny_model(tmp_path, "qwen3", hidden_size=256, intermediate_size=384,
                          head_dim=64)
    model_dir = write_fp8_blocks(src, tmp_path / "fp8")
    as_rank(monkeypatch, 1, 2)
    with pytest.raises(ValueError, match="do not split into whole blocks of 128x128"):
        load(model_dir)


def test_quantized_checkpoints_run_over_two_gloo_ranks(tmp_path):
    """End to end over a process group: each rank's logits near one rank's. Not equal:
    a row-parallel rank quantizes its own slice of each token (as vLLM's), and the
    all-reduced sums, added in another order, round a few activations to the neighbouring
    fp8 value, which the tiny random model amplifies (exact sharding is the test above)."""
    dirs = [write_compressed_tensors(make_tiny_model(tmp_path / f"{arch}-{scheme}", arch),
                                     scheme)
            for arch, scheme in (("qwen3", "FP8"), ("qwen3", "W8A8"),
                                 ("qwen3_moe", "FP8_DYNAMIC"))]
    results = run_ranks(2, dirs, "auto", PROMPT, tmp_path)
    for model_dir in dirs:
        whole, _ = ours(model_dir)
        for rank in range(2):
            assert rel_err(results[(rank, str(model_dir))][1], whole) < TP_BOUND


# --- kernels' torch twins ---------------------------------------------------------------------

def test_per_token_quantization_twin():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=g) * torch.linspace(0.1, 10, 200)
    x[3] = 0.0  # a zero row keeps a positive scale
    q, scale = quantize_per_token_ref(x, FP8, 128)
    assert q.dtype == FP8 and scale.shape == (5, 2) and (scale > 0).all()
    assert torch.allclose(q.float()[:, :128] * scale[:, :1], fake_quant(x, 128)[:, :128])
    qi, si = quantize_per_token_ref(x, torch.int8)
    assert qi.abs().max() == 127 and si.shape == (5, 1)
    assert ((qi.float() * si - x).abs() <= si / 2 + 1e-6).all()


def test_scaled_mm_twin_against_a_plain_matmul():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(7, 300, generator=g), torch.randn(260, 300, generator=g)
    qa, sa = quantize_per_token_ref(a, FP8, 128)
    qb = b.to(FP8)
    sb = torch.rand(3, 3, generator=g) + 0.5  # 128 x 128 blocks
    full_sb = sb.repeat_interleave(128, 0)[:260].repeat_interleave(128, 1)[:, :300]
    expected = (qa.float() * sa.repeat_interleave(128, 1)[:, :300]) @ (qb.float() * full_sb).T
    bias = torch.randn(260, generator=g)
    out = scaled_mm_ref(qa, sa, qb, sb, 128, 128, torch.float32, bias)
    assert torch.allclose(out, expected + bias, rtol=1e-5, atol=1e-4)


# --- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("config,quantization,line", [
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}, None,
     "unsupported quantization 'bitsandbytes' (config.json quantization_config); supported: "
     "fp8"),
    ({}, "bitsandbytes", "unsupported --quantization 'bitsandbytes'; supported: fp8"),
    ({}, "compressed-tensors", "--quantization compressed-tensors needs a checkpoint"),
    ({"quantization_config": {"quant_method": "fp8"}}, "compressed-tensors",
     "--quantization compressed-tensors does not match the checkpoint's"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                 "strategy": "group", "group_size": 128},
              "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                    "dynamic": True}}}}},  # W4A8
     None, "unsupported compressed-tensors weights int4 group, activations int8 token "
     "dynamic"),
])
def test_unbuilt_quantizations_are_refused_in_one_line(config, quantization, line):
    with pytest.raises(UnsupportedModel) as refused:
        check_model_support(tiny_config("qwen3", **config), quantization)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_int8_experts_and_unknown_ignores_are_refused():
    check_model_support(tiny_config("mixtral"), "fp8")
    int8 = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                              "dynamic": True}}}}
    with pytest.raises(UnsupportedModel, match="not supported on mixture-of-experts models "
                       r"\(8 experts per layer\); supported there: fp8"):
        check_model_support(tiny_config("mixtral", quantization_config=int8))
    with pytest.raises(UnsupportedModel, match=r"lists \['model.layers.0.mlp.up_proj'\]"):
        check_model_support(tiny_config("qwen3_moe", quantization_config={
            "quant_method": "fp8", "modules_to_not_convert": [
                "lm_head", "model.layers.1.mlp.gate", "model.layers.0.mlp.up_proj"]}))


def test_llm_and_serve_refuse_an_unknown_quantization(tmp_path):
    from services.offline.llm import LLM

    model_dir = make_tiny_model(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="unsupported --quantization 'awq4'; supported"):
        LLM(model=str(model_dir), device="cpu", quantization="awq4")
    done = run_command(*tiny_serve_args(model_dir, tmp_path / "run"), "--quantization",
                       "awq4", timeout=30)
    assert done.returncode == REFUSED_EXIT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "headrace: unsupported --quantization 'awq4'; supported: fp8"), done.stderr
