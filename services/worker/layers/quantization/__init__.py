"""Quantized linear layers: the QuantMethod each LinearBase delegates to, chosen for the
whole model from --quantization and config.json's quantization_config
(common/quantization.py reads them; this maps its QuantSpec to a method), and its
counterpart for a mixture of experts' stacked experts (experts.py).

A new format: a parser of its quantization_config in common/quantization.PARSERS (the
launcher's check and the worker then agree), a QuantMethod whose create_weights makes its
checkpoint's tensors with quant_parameter, and its spec mapped to it here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from common.quantization import quant_spec
from services.worker.layers.quantization.base import (QuantMethod, UnquantizedMethod,
                                                      quant_parameter)
from services.worker.layers.quantization.experts import (ExpertsMethod, Fp8Experts,
                                                         UnquantizedExperts)
from services.worker.layers.quantization.gguf import GGUFMethod
from services.worker.layers.quantization.int4 import INT4_METHODS
from services.worker.layers.quantization.w8a8 import W8A8Method

__all__ = ["ExpertsMethod", "GGUFMethod", "QuantMethod", "UnquantizedMethod", "W8A8Method",
           "building_with", "current_method", "experts_method_for", "quant_method_for",
           "quant_parameter"]

# the method layers built now take: set around a model's construction so that every
# model's code builds its projections unchanged, as torch.device sets their device
_BUILDING: ContextVar[QuantMethod] = ContextVar("quant_method", default=UnquantizedMethod())


def quant_method_for(hf_config: Any, engine_quantization: str | None) -> QuantMethod:
    """The method of the model's weights; ValueError (QuantizationError) for a format
    that is not built."""
    spec = quant_spec(hf_config, engine_quantization)
    if spec is None:
        return UnquantizedMethod()
    if spec.method == "gguf":
        return GGUFMethod()
    if spec.weight_type == "int4":
        return INT4_METHODS[spec.method](spec)
    return W8A8Method(spec)


def experts_method_for(method: QuantMethod) -> ExpertsMethod:
    """How a mixture of experts' routed experts are held under the model's method: fp8
    with the scales of the same format, or unquantized."""
    if isinstance(method, W8A8Method):
        return Fp8Experts(method.spec)
    return UnquantizedExperts()


def current_method() -> QuantMethod:
    return _BUILDING.get()


@contextlib.contextmanager
def building_with(method: QuantMethod) -> Iterator[None]:
    token = _BUILDING.set(method)
    try:
        yield
    finally:
        _BUILDING.reset(token)
