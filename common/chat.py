"""The chat rules both the gateway and the tokenizer apply: what a message is, and how a
conversation becomes a prompt through the model's chat template."""

from __future__ import annotations

import json
from typing import Any

import jinja2

from common.errors import ApiError


def plain_conversation(messages: Any) -> list[dict[str, Any]]:
    """Messages whose content is one string, as templates written for strings expect;
    OpenAI-style lists of text parts are joined with newlines."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", "messages")
    return [plain_message(m, i) for i, m in enumerate(messages)]


def plain_message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a string role.", "messages")
    # Templates read message['content'] of every message, also of an assistant turn that
    # only calls tools (content null or left out), and fail without the key. transformers
    # drops None-valued keys before rendering, so such a turn gets "", as vLLM renders a
    # null content for templates that take strings.
    if message.get("content") is None:
        message = {**message, "content": ""}
    if message.get("tool_calls"):
        calls = [_call_for_template(c) for c in message["tool_calls"]]
        message = {**message, "tool_calls": calls}
    content = message["content"]
    if isinstance(content, str):
        return message
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return {**message, "content": "\n".join(p["text"] for p in content)}
    if isinstance(content, list) and all(_is_part(p) for p in content):
        # with images or videos: the parts as Qwen-style templates read them,
        # {"type": "image"} and {"type": "video"}
        return {**message, "content": [p if p["type"] == "text" else
                                       {"type": p["type"].removesuffix("_url")}
                                       for p in content]}
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text, "
                        "video_url and image_url parts.", "messages")


IMAGE_DETAILS = ("auto", "low", "high")


def _is_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    if part.get("type") == "text":
        return isinstance(part.get("text"), str)
    if part.get("type") == "video_url":
        return video_url_of(part) is not None
    return part.get("type") == "image_url" and image_url_of(part) is not None


def image_url_of(part: dict[str, Any]) -> str | None:
    """An image_url part's URL: OpenAI's {"url": ..., "detail": ...} object, or the URL
    string itself (vLLM takes both); None if it is neither."""
    value = part.get("image_url")
    if isinstance(value, str):
        return value
    if (isinstance(value, dict) and isinstance(value.get("url"), str)
            and value.get("detail", "auto") in IMAGE_DETAILS):
        return value["url"]
    return None


def video_url_of(part: dict[str, Any]) -> str | None:
    """A video_url part's URL: vLLM's {"url": ...} object, or the URL string itself."""
    value = part.get("video_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def chat_image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URLs of the conversation's image_url parts, in order."""
    return _part_urls(messages, "image_url", image_url_of)


def chat_video_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URLs of the conversation's video_url parts, in order."""
    return _part_urls(messages, "video_url", video_url_of)


def _part_urls(messages: list[dict[str, Any]], kind: str, url_of: Any) -> list[str]:
    return [url_of(part) or "" for message in messages
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == kind]


def _call_for_template(call: Any) -> Any:
    """OpenAI sends a call's arguments as JSON text; templates (Qwen's, Llama's) write
    them with `tojson`, so they get the object, or the text would be quoted twice."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call  # the template gets what the client sent
    return {**call, "function": {**function, "arguments": parsed}}


def render_chat(tokenizer: Any, messages: Any, add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation through the chat template, as the prompt text. `template_kwargs`
    are the client's chat_template_kwargs: variables the template reads (enable_thinking);
    `tools` OpenAI's tool definitions, which templates that know tools write out."""
    conversation = plain_conversation(messages)
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=False, **(template_kwargs or {}))
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        raise ApiError(400, f"The chat template failed on these messages: {e}",
                       "messages") from None
