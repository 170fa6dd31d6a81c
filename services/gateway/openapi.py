"""The OpenAPI document served at /openapi.json, built from the request and response
models the gateway validates and sends, so it cannot drift from them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.gateway import request_bodies as req
from services.gateway import response_bodies as resp

REF = "#/components/schemas/{model}"
# path -> (method, summary, request body model, response model (None: plain text),
# streamed chunk model)
ROUTES: dict[str, tuple[str, str, type[BaseModel] | None, type[BaseModel] | None,
                        type[BaseModel] | None]] = {
    "/v1/completions": ("post", "Completions", req.CompletionRequest,
                        resp.CompletionResponse, resp.CompletionResponse),
    "/v1/chat/completions": ("post", "Chat completions", req.ChatCompletionRequest,
                             resp.ChatCompletionResponse, resp.ChatCompletionChunk),
    "/v1/embeddings": ("post", "Embeddings of prompts", req.EmbeddingRequest,
                       resp.EmbeddingResponse, None),
    "/v1/score": ("post", "Cosine similarity of text pairs' embeddings (vLLM's; also at "
                  "/score)", req.ScoreRequest, resp.ScoreResponse, None),
    "/v1/rerank": ("post", "Documents ordered by embedding similarity to a query (vLLM's, "
                   "Jina's, Cohere's; also at /rerank and /v2/rerank)", req.RerankRequest,
                   resp.RerankResponse, None),
    "/v1/responses": ("post", "Responses (OpenAI's Responses API; stream: Responses "
                      "events)", req.ResponsesRequest, resp.ResponseObject, None),
    "/v1/models": ("get", "The served models", None, resp.ModelList, None),
    "/tokenize": ("post", "Token ids of a prompt or a conversation", req.TokenizeRequest,
                  resp.TokenizeResponse, None),
    "/detokenize": ("post", "Text of token ids", req.DetokenizeRequest,
                    resp.DetokenizeResponse, None),
    "/v1/load_lora_adapter": ("post", "Serve a LoRA adapter under a model name "
                              "(--enable-lora)", req.LoadLoRAAdapterRequest, None, None),
    "/v1/unload_lora_adapter": ("post", "Stop serving a LoRA adapter (--enable-lora)",
                                req.UnloadLoRAAdapterRequest, None, None),
}
PLAIN_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def openapi_document(version: str) -> dict[str, Any]:
    models: list[type[BaseModel]] = [resp.ErrorResponse]
    for _, _, body, answer, chunk in ROUTES.values():
        models += [m for m in (body, answer, chunk) if m is not None]
    inputs = [(m, "validation" if m.__module__ == req.__name__ else "serialization")
              for m in dict.fromkeys(models)]
    refs, schemas = models_json_schema(inputs, ref_template=REF)
    paths = {path: {method: _operation(summary, body, answer, chunk, refs)}
             for path, (method, summary, body, answer, chunk) in ROUTES.items()}
    return {"openapi": "3.1.0", "info": {"title": "headrace", "version": version},
            "paths": paths, "components": {"schemas": schemas["$defs"]}}


def with_root_path(document: dict[str, Any], root_path: str | None) -> dict[str, Any]:
    """The document as served under --root-path: its `servers` name the prefix, as
    FastAPI's root_path (vLLM's) has it, so a client built from it calls through the proxy."""
    return {**document, "servers": [{"url": root_path}]} if root_path else document


def _operation(summary: str, body: type[BaseModel] | None, answer: type[BaseModel] | None,
               chunk: type[BaseModel] | None, refs: dict[Any, Any]) -> dict[str, Any]:
    def ref(model: type[BaseModel]) -> dict[str, Any]:
        mode = "validation" if model.__module__ == req.__name__ else "serialization"
        return refs[model, mode]

    content: dict[str, Any] = (PLAIN_TEXT if answer is None
                               else {"application/json": {"schema": ref(answer)}})
    if chunk is not None:  # with "stream": true, server-sent events of these
        content["text/event-stream"] = {"schema": ref(chunk)}
    error = {"description": "An OpenAI-style error",
             "content": {"application/json": {"schema": ref(resp.ErrorResponse)}}}
    operation: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": content}, "400": error, "default": error}}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": ref(body)}}}
    return operation
