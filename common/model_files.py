"""Finding a model's files: a local directory, a GGUF file (converted once into a cached
Hugging Face directory), or a hub id (downloaded with huggingface_hub when online); and
reading its config, tokenizer and generation config.

The tokenizer and gateway processes use this module, so torch and transformers are only
imported inside the functions that need them, and those processes can have transformers run
without torch (transformers_without_torch).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("headrace.model_files")

CACHE_DIR_ENV = "HEADRACE_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/headrace"
TOKENIZER_PATTERNS = ["tokenizer*", "*.jinja", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "*.model", "*.tiktoken"]
CONFIG_PATTERNS = ["config.json", "generation_config.json"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length")


class ModelNotFound(FileNotFoundError):
    """The model names no local directory or .gguf file and the hub cannot provide it."""


def resolve_model(model: str, load_format: str = "auto", gguf_weights: bool = True
                  ) -> Path:
    """The local Hugging Face directory holding `model`'s files. gguf_weights=False: of a
    GGUF file, only its config and tokenizer (a worker that reads the file's own blocks,
    or a process that only tokenizes, needs no float32 conversion of its weights)."""
    return _resolve(model, load_format, weights=load_format != "dummy",
                    gguf_weights=gguf_weights)


def _resolve(model: str, load_format: str, weights: bool, gguf_weights: bool = True
             ) -> Path:
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {model!r} does not exist")
        return gguf_to_hf_dir(path, weights=weights and gguf_weights)
    if load_format == "gguf":
        raise ModelNotFound(f"--load-format gguf needs a .gguf file, got {model!r}")
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFound(f"model {model!r} is a file but not a .gguf file: pass a Hugging "
                            "Face model directory, a .gguf file or a hub id")
    return download_from_hub(model, weights)


def is_gguf(model: str) -> bool:
    return Path(model).suffix.lower() == ".gguf"


# --- GGUF ------------------------------------------------------------------------------

def cache_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def gguf_to_hf_dir(path: Path, weights: bool = True) -> Path:
    """The cached Hugging Face directory converted from the GGUF file at `path`: its
    config, tokenizer and generation config, and with `weights` its weights dequantized
    to float32. The first caller converts each, under a file lock, into a temporary
    directory moved into place; later callers (and ones that waited on the lock) find it
    ready."""
    from filelock import FileLock

    stat = path.stat()
    root = cache_root() / "gguf"
    target = root / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if target.is_dir() and (not weights or has_weights(target)):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not target.is_dir():
            convert_gguf(path, target, write_hf_files)
        if weights and not has_weights(target):
            convert_gguf(path, target, write_float_weights)
    return target


def has_weights(directory: Path) -> bool:
    """The float32 weights are complete: their index (or single file), moved in last."""
    return any((directory / name).is_file() for name in SAFETENSORS_DONE)


SAFETENSORS_DONE = ("model.safetensors", "model.safetensors.index.json")


def convert_gguf(path: Path, target: Path, write: Callable[[Path, Path], None]) -> None:
    """write(path, tmp) into a temporary directory beside target, then moved in: the
    directory itself if target is new, else its files (the one SAFETENSORS_DONE names
    last, so a crash leaves no complete-looking weights)."""
    what = "weights" if target.is_dir() else "config and tokenizer"
    log.info("converting %s's %s into a Hugging Face directory at %s (once; later starts "
             "reuse it)", path, what, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(path, tmp)
        if not target.is_dir():
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the cache from other users
            os.rename(tmp, target)
            return
        for file in sorted(tmp.iterdir(), key=lambda f: f.name in SAFETENSORS_DONE):
            os.replace(file, target / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_hf_files(path: Path, out: Path) -> None:
    """config.json, a fast tokenizer with the chat template, and generation_config.json,
    all taken from the GGUF file (transformers reads its metadata)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # what saving the model would record: the class transformers loads the file as
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    GenerationConfig.from_model_config(config).save_pretrained(out)
    config.save_pretrained(out)


def write_float_weights(path: Path, out: Path) -> None:
    """The weights dequantized to float32 by transformers, as model*.safetensors."""
    allow_torch()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    # the weights are already dequantized to float32; without the GGUF quantizer's marks
    # transformers saves them as a plain checkpoint (it refuses to save "quantized" ones)
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    for name in ("config.json", "generation_config.json"):  # write_hf_files' own
        (out / name).unlink(missing_ok=True)


# --- transformers without torch ----------------------------------------------------------

def transformers_without_torch(model_dir: Path, trust_remote_code: bool = False) -> bool:
    """Have transformers run in this process as where torch is not installed (a set-up it
    supports: tokenizers, configs and file utilities work), unless the model's image
    processor needs torch (a vision-language model's) or the model's own code may (with
    trust_remote_code). For the processes that only read the config and tokenize:
    transformers' configuration_utils, which AutoConfig and AutoTokenizer load, imports
    torch whenever it is installed, 5-7 s of CPU per process that never uses it. Python's
    own switch: an import finds sys.modules["torch"] None absent. Only before transformers
    is imported (a GGUF converted here already did, with torch); returns whether torch is
    kept out. allow_torch() lets it back in."""
    if trust_remote_code or "transformers" in sys.modules or "torch" in sys.modules:
        return False
    config = model_dir / "config.json"
    if config.is_file() and "vision_config" in json.loads(config.read_text()):
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # its import-time notice would tell the stage's log that torch is not installed
    logging.getLogger("transformers").addFilter(
        lambda record: "PyTorch was not found" not in record.getMessage())
    return True


def allow_torch() -> None:
    """Undo transformers_without_torch: a later `import torch` (xgrammar's, a device
    count's) loads it."""
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]


# --- the hub ---------------------------------------------------------------------------

def download_from_hub(model: str, weights: bool = True) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HFValidationError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    prefix = f"model {model!r} is not a local directory or .gguf file, and"
    patterns = CONFIG_PATTERNS + TOKENIZER_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    try:
        path = Path(snapshot_download(model, allow_patterns=patterns))
    except HFValidationError:
        raise ModelNotFound(f"{prefix} is not a valid Hugging Face hub id") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFound(f"{prefix} the Hugging Face hub has no such repository (or it "
                            "is gated or private: log in with `hf auth login`)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise ModelNotFound(f"{prefix} the Hugging Face hub could not be reached (offline): "
                            "pass a local path") from None
    except HfHubHTTPError as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFound(f"{prefix} the Hugging Face hub answered: {first_line}") from None
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"hub repository {model!r} has no config.json (a GGUF-only "
                            "repository? download its .gguf file and pass that path)")
    return path


# --- reading the files -----------------------------------------------------------------

def load_hf_config(path: str | os.PathLike):
    """The transformers config (PretrainedConfig) of a model directory."""
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model directory")
    return language_view(AutoConfig.from_pretrained(path))


# what a vision-language model's decoder config takes over from the whole config
VISION_LANGUAGE_KEYS = ("architectures", "vision_config", "image_token_id", "video_token_id",
                        "vision_start_token_id", "vision_end_token_id",
                        "tie_word_embeddings", "quantization_config",
                        # LLaVA's
                        "projector_hidden_act", "multimodal_projector_bias",
                        "vision_feature_layer", "vision_feature_select_strategy",
                        # Gemma 3's
                        "mm_tokens_per_image", "boi_token_id", "eoi_token_id")


def language_view(config):
    """A vision-language model's config as its decoder's (text_config), carrying the
    architecture, the vision config and the image token ids: every stage reads the
    decoder's sizes where it reads a text model's, and only the worker's model and the
    tokenizer's image processing look at the rest. Other configs are returned as they are."""
    text = getattr(config, "text_config", None)
    if text is None or getattr(config, "vision_config", None) is None:
        return config
    for key in VISION_LANGUAGE_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            setattr(text, key, value)
    return text


def load_tokenizer(path: str | os.PathLike, tokenizer: str | None = None,
                   trust_remote_code: bool = False):
    """The model's tokenizer, or the one `tokenizer` names (a directory, .gguf or hub id)."""
    from transformers import AutoTokenizer

    source = resolve_tokenizer(tokenizer) if tokenizer else Path(path)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def resolve_tokenizer(tokenizer: str) -> Path:
    """--tokenizer's directory: a .gguf converted (with torch: resolve_engine runs this
    before transformers goes without it), a hub id fetched without weights."""
    return _resolve(tokenizer, "auto", weights=False)


def read_chat_template(template: str) -> str:
    """--chat-template: a file's text, or the template itself (vLLM takes both)."""
    file = Path(template)
    if "{" not in template and not file.is_file():
        raise ValueError(f"--chat-template {template!r} is neither a file nor a template")
    return file.read_text() if "{" not in template else template


def load_generation_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The raw generation_config.json, or None when the model has none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return config


def sliding_windows(hf_config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention). With `layer_types`
    (Gemma 2/3; Qwen2's config derives them from use_sliding_window and
    max_window_layers), "sliding_attention" layers have `sliding_window` and the others
    none; without (Mistral v0.1, Phi-3), every layer has `sliding_window`, if set.

    A window saves attention work, not KV memory: the scheduler keeps every block of a
    sequence allocated, those that have slid out of every window included."""
    window = getattr(hf_config, "sliding_window", None) or None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [window] * hf_config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def max_model_len_of(hf_config) -> int:
    """The longest sequence the model was built for: its max_position_embeddings (or
    another name for it), stretched by a YaRN or dynamic-NTK RoPE's factor, as vLLM reads
    it (Qwen3's YaRN config: 32768 original positions x 4 = 131072)."""
    for key in MAX_LEN_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return max([value, *(rope_stretched(value, s) for s in rope_schemes(hf_config))])
    raise ValueError(f"the model config has none of {list(MAX_LEN_KEYS)}; pass "
                     "--max-model-len")


def rope_stretched(length: int, scheme: dict[str, Any]) -> int:
    """How far a RoPE scheme carries a model of `length` positions. Only YaRN and dynamic
    NTK: a linear or LongRoPE config's max_position_embeddings already counts its factor,
    and Llama 3's does too."""
    kind, factor = rope_type_of_scheme(scheme), scheme.get("factor")
    if kind not in ("yarn", "dynamic") or not factor:
        return length
    original = scheme.get("original_max_position_embeddings", length) if kind == "yarn" \
        else length
    return int(original * factor)


def rope_schemes(hf_config) -> list[dict[str, Any]]:
    """Every set of RoPE parameters in the config: rope_scaling and rope_parameters
    (transformers 5 keeps them in the latter, and reads an old config's rope_scaling into
    it), one set or one per layer type ({"sliding_attention": {...}, ...})."""
    schemes = []
    for name in ("rope_scaling", "rope_parameters"):
        parameters = getattr(hf_config, name, None)
        if isinstance(parameters, dict):
            nested = [p for p in parameters.values() if isinstance(p, dict)]
            schemes += nested or [parameters]
    return schemes


def rope_type_of_scheme(scheme: dict[str, Any]) -> str:
    """The rotary kernel's reading: rope_type, else the older `type`."""
    return str(scheme.get("rope_type", scheme.get("type", "default")))
