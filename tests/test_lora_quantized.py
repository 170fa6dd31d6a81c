"""LoRA adapters on a quantized base (compressed-tensors FP8_DYNAMIC and INT8 W8A8): the
base layers keep their format and the adapters run beside them in the model's dtype.

The oracle is transformers on the weights the checkpoint holds, dequantized, with the PEFT
adapter applied unmerged and each base Linear's input quantized per token as the scheme
does (the adapters' own matmuls see the unquantized input, as in vLLM)."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.messages import LoRARequest
from common.sampling_params import SamplingParams
from tests.test_lora import make_adapter
from tests.test_quantization import (PROMPT, dequantize_checkpoint, fake_quant,
                                     is_quantized_linear, write_compressed_tensors)
from tests.tiny_models import make_tiny_model

BOUND = 1e-4  # float32 in another order, as the quantized models' own checks


def reference_logprobs(model_dir, adapter: str, kind: str) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    hooked = 0
    for name, module in model.named_modules():
        stem = name.removesuffix(".base_layer")
        if (isinstance(module, torch.nn.Linear) and "lora_" not in name
                and is_quantized_linear(stem.split("base_model.model.")[-1] + ".weight")
                and not hasattr(module, "base_layer")):
            module.register_forward_pre_hook(
                lambda m, args: (fake_quant(args[0], None, kind),))
            hooked += 1
    assert hooked == 7 * base.config.num_hidden_layers
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("scheme,kind", [("FP8_DYNAMIC", "float"), ("W8A8", "int")])
def test_an_adapter_on_a_quantized_base_matches_peft(scheme, kind, tmp_path):
    from services.offline.llm import LLM

    src = make_tiny_model(tmp_path / "src", "qwen3")
    adapter = make_adapter(src, tmp_path / "adapter", seed=3, rank=8, alpha=16,
                           modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                           rslora=False)
    quantized = write_compressed_tensors(src, scheme)
    plain = tmp_path / "dequantized"
    shutil.copytree(quantized, plain)
    dequantize_checkpoint(plain)
    ref = reference_logprobs(plain, adapter, kind)

    llm = LLM(str(quantized), dtype="float32", device="cpu", block_size=4,
              num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8, max_loras=2)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with_adapter, without = llm.generate(
        [PROMPT, PROMPT], params, use_tqdm=False,
        lora_request=[LoRARequest("a", 1, adapter), None])
    for pos in range(1, len(PROMPT)):
        token = PROMPT[pos]
        assert with_adapter.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref[pos - 1, token].item(), abs=BOUND)
    # the base rows of the same batch are the adapter-free model's
    assert any(abs(with_adapter.prompt_logprobs[pos][PROMPT[pos]].logprob
                   - without.prompt_logprobs[pos][PROMPT[pos]].logprob) > 1e-2
               for pos in range(1, len(PROMPT)))
