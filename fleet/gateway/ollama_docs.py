"""The Ollama routes in the gateway's OpenAPI document (fleet.gateway.openapi adds them): their
request models, NDJSON or JSON answers, and Ollama's error shape."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from fleet.gateway.ollama_requests import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)

OLLAMA_MODELS: list[type[BaseModel]] = [
    OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest, OllamaEmbedRequest,
    OllamaEmbeddingsRequest,
]

_ERROR = {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"],
}}}
_JSON = {"application/json": {"schema": {"type": "object"}}}
_NDJSON = {"application/x-ndjson": {"schema": {"type": "string"}}}
_STATUSES = {
    "400": "Invalid request", "401": "Missing or wrong API key (when keys are configured)",
    "404": "Unknown model", "408": "The request body did not arrive in time",
    "413": "Request body too large", "429": "Too many requests wait; see Retry-After",
    "503": "NATS unreachable, or no node can serve the model",
    "504": "No answer before the deadline",
}


def _operation(summary: str, operation_id: str, content: dict[str, Any],
               model: type[BaseModel] | None, *errors: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "The answer", "content": content}}
    for status in ("401", *errors):
        responses[status] = {"description": _STATUSES[status], "content": _ERROR}
    operation: dict[str, Any] = {"summary": summary, "operationId": operation_id,
                                 "tags": ["Ollama"], "responses": responses}
    if model is None:
        return {"get": operation}
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    return {"post": operation}


def ollama_paths() -> dict[str, Any]:
    tasks = ("400", "404", "408", "413", "429", "503", "504")
    return {
        "/api/chat": _operation(
            "Ollama: a chat turn, as NDJSON lines (stream, the default) or one object",
            "ollamaChat", {**_JSON, **_NDJSON}, OllamaChatRequest, *tasks),
        "/api/generate": _operation(
            "Ollama: a completion of `prompt` (the chat template applied unless `raw`)",
            "ollamaGenerate", {**_JSON, **_NDJSON}, OllamaGenerateRequest, *tasks),
        "/api/show": _operation("Ollama: one model's details and capabilities", "ollamaShow",
                                _JSON, OllamaShowRequest, "400", "404", "408", "413"),
        "/api/tags": _operation("Ollama: the text and embedding models usable now",
                                "ollamaTags", _JSON, None, "503"),
        "/api/ps": _operation("Ollama: the models with a runner ready", "ollamaPs", _JSON,
                              None, "503"),
        "/api/embed": _operation(
            "Ollama: one vector per input (`embeddings`), cut to fit unless `truncate` is false",
            "ollamaEmbed", _JSON, OllamaEmbedRequest, *tasks),
        "/api/embeddings": _operation(
            "Ollama's older embeddings route: one prompt, one `embedding`",
            "ollamaEmbeddings", _JSON, OllamaEmbeddingsRequest, *tasks),
        "/api/version": _operation("Ollama: the Ollama API version these routes follow",
                                   "ollamaVersion", _JSON, None),
    }
