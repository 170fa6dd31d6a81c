"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's flags (norm weighting, four
norms a layer, scaled embeddings; Gemma 3 adds q/k norms) and its config's soft caps,
attention scale, per-layer sliding windows and, for Gemma 3, per-layer-type rotary."""

from __future__ import annotations

import torch

from services.worker.models.llama import DecoderFlags, LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        self.final_soft_cap = getattr(hf_config, "final_logit_softcapping", None)

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, gemma_norm=True,
                            sandwich_norms=True, scale_embedding=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final soft cap, c * tanh(logits / c), on the float32 logits."""
        logits = super().compute_logits(hidden)
        if self.final_soft_cap is None:
            return logits
        return torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (model_type gemma3_text): Gemma 2 with q/k norms, and in practice
    no soft caps (the config's are None)."""

    def __init__(self, hf_config) -> None:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) "
                             "is not supported: only causal attention")
        super().__init__(hf_config)

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True,
                            gemma_norm=True, sandwich_norms=True, scale_embedding=True)
