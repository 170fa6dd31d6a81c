"""Qwen2/Qwen2.5 and Qwen3: the Llama decoder with their own projection flags."""

from __future__ import annotations

from services.worker.models.llama import DecoderFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """q/k/v carry biases, o_proj does not. The optional sliding window (use_sliding_window)
    covers the layers from max_window_layers on, as the config's layer_types say."""

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Per-head RMSNorm on q and k before rotary; head_dim comes from the config."""

    @staticmethod
    def decoder_flags(hf_config) -> DecoderFlags:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
