"""The five services of the pipeline, the launcher, the CLI and the offline API.

`from services import LLM, BeamSearchParams, LoRARequest, SamplingParams` works without
importing torch until `LLM` is touched, so light commands stay light.
"""

from typing import Any

from common.beam_search import BeamSearchParams
from common.messages import LoRARequest
from common.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from services.offline.llm import LLM
        return LLM
    raise AttributeError(name)
