"""A tokenizer that lets a vision-language shape directory take images through the chat API.

The shape directories (.devkit/models) carry a stand-in tokenizer (SmolLM2's, 49,152
tokens) without Qwen2-VL's vision tokens, and a chat template that takes only strings, so
an image_url part could neither be written into the prompt nor found there. This writes
the model's tokenizer with `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>` and
`<|video_pad|>` added (ids after its vocabulary, inside the model's 152,064 embeddings)
and a Qwen2-VL-style chat template that writes each image as
`<|vision_start|><|image_pad|><|vision_end|>`, and prints the --hf-overrides that point the
model's config at those ids. With dummy weights the ids' values change nothing measured:
each image still becomes its merged patches' placeholders, the vision encoder's input.

    python benchmarks/gpu/vl_tokenizer.py .devkit/models/qwen2.5-vl-7b-shape /tmp/vl-tok
    headrace serve .devkit/models/qwen2.5-vl-7b-shape --load-format dummy \\
        --tokenizer /tmp/vl-tok --hf-overrides "$(cat /tmp/vl-tok/hf_overrides.json)"

A model whose tokenizer has the tokens already (tests/tiny_models.py's) keeps their ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# config key of each token's id
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>",
                 "video_token_id": "<|video_pad|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OVERRIDES_FILE = "hf_overrides.json"


def write_vl_tokenizer(model_dir: Path, out: Path) -> dict[str, int]:
    """The model's tokenizer with the vision tokens and the template, saved to `out`;
    returns the config overrides (also written to out/hf_overrides.json)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    tokenizer.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    overrides = {key: tokenizer.convert_tokens_to_ids(token)
                 for key, token in VISION_TOKENS.items()}
    (out / OVERRIDES_FILE).write_text(json.dumps(overrides) + "\n")
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="the vision-language model directory")
    parser.add_argument("out", type=Path, help="where the tokenizer goes")
    args = parser.parse_args()
    print(json.dumps(write_vl_tokenizer(args.model_dir, args.out)))


if __name__ == "__main__":
    main()
