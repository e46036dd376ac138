"""The OpenAPI 3.1 document of the gateway, built from the same pydantic models that parse the
requests, so the document cannot drift from what the routes accept."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from fleet.gateway.batch_openapi import batch_paths
from fleet.gateway.embeddings_api import EmbeddingsRequest
from fleet.gateway.image_api import ImageEditRequest, ImageGenerationRequest
from fleet.gateway.messages_api import anthropic_operation
from fleet.gateway.messages_replies import AnthropicErrorBody
from fleet.gateway.messages_requests import CountTokensRequest, MessagesRequest
from fleet.gateway.ollama_docs import OLLAMA_MODELS, ollama_paths
from fleet.gateway.responses_api import ResponsesRequest
from fleet.gateway.text_requests import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key (when keys are configured)",
    "404": "Unknown model, image or route; a task with no stored events; another API key's "
    "task or image (the same answer, so nothing confirms it exists)",
    "408": "The request body did not arrive in time (FLEET_GATEWAY_BODY_TIMEOUT_S)",
    "413": "Request body too large, or a task larger than a NATS message may be",
    "429": "The model's queue is full, or too many requests are waiting (per key or in all); "
    "see Retry-After",
    "502": "A stored image does not hash to its name: refused, not served",
    "503": "NATS unreachable",
    "504": "No terminal event before the deadline",
}


# One server-sent event; `data` is JSON (or `[DONE]` at the end of a chat stream).
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "id": {"type": "string"},
        "data": {"type": "string"},
    },
    "required": ["data"],
}


_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


_JSON = {"application/json": {"schema": {"type": "object"}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _responses(ok: str, content: dict[str, Any], *errors: str) -> dict[str, Any]:
    error_content = {"application/json": {"schema": _ref(ErrorBody)}}
    responses: dict[str, Any] = {"200": {"description": ok, "content": content}}
    for status in ("400", "401", *errors):
        responses[status] = {"description": _ERRORS[status], "content": error_content}
    return responses


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(model)}}}


def _task_operation(summary: str, operation_id: str, model: type[BaseModel]) -> dict[str, Any]:
    content = {**_JSON, **_SSE}
    return {
        "post": {
            "summary": summary,
            "operationId": operation_id,
            "requestBody": _json_body(model),
            "responses": _responses(
                "The result, or an SSE stream when `stream` is true",
                content,
                "404",
                "408",
                "413",
                "429",
                "503",
                "504",
            ),
        }
    }


def _form_field(schema: dict[str, Any]) -> dict[str, Any]:
    """A form has no null: an optional field is left out, so drop the null alternative."""
    alternatives = [a for a in schema.get("anyOf", []) if a.get("type") != "null"]
    if len(alternatives) != 1:
        return schema
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    return {**rest, **alternatives[0]}


def _edit_form_schema(base: dict[str, Any]) -> dict[str, Any]:
    binary = {"type": "string", "format": "binary"}
    files = {"type": "array", "items": binary, "minItems": 1, "maxItems": 8}
    fields = {name: _form_field(field) for name, field in base["properties"].items()}
    return {
        **base,
        "properties": {"image": files, **fields},
        "required": ["image", *base.get("required", [])],
    }


def _get(
    summary: str,
    operation_id: str,
    ok: str,
    content: dict[str, Any],
    *errors: str,
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "operationId": operation_id,
        "responses": _responses(ok, content, *errors),
    }
    if parameters:
        operation["parameters"] = parameters
    return {"get": operation}


def _path_param(name: str, pattern: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": pattern},
    }


@cache
def openapi_document() -> dict[str, Any]:
    models = [
        ChatCompletionRequest,
        CompletionRequest,
        ResponsesRequest,
        ImageGenerationRequest,
        ImageEditRequest,
        EmbeddingsRequest,
        MessagesRequest,
        CountTokensRequest,
        ErrorBody,
        *OLLAMA_MODELS,
        AnthropicErrorBody,
    ]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = defs["$defs"]
    edit_form = _edit_form_schema(schemas["ImageEditRequest"])
    task_id = _path_param("task_id", "^[A-Za-z0-9_-]{1,128}$")
    after = {
        "name": "after",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0, "maximum": 999_999_999, "default": 0},
        "description": "How many of the task's events the client has already seen",
    }
    response_format = {
        "name": "format",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": ["openai", "native"], "default": "openai"},
        "description": "openai: the format of the request that made the task; native: "
        "Fleet's events",
    }
    image = {
        "content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}},
        "description": "The image",
    }
    paths: dict[str, Any] = {
        "/v1/chat/completions": _task_operation(
            "Chat completion", "createChatCompletion", ChatCompletionRequest
        ),
        "/v1/completions": _task_operation(
            "Text completion", "createCompletion", CompletionRequest
        ),
        "/v1/responses": _task_operation(
            "Responses API (text): a `response` object, or its SSE events when `stream` is "
            "true", "createResponse", ResponsesRequest,
        ),
        "/v1/messages": anthropic_operation(_task_operation(
            "Anthropic Messages API: a `message`, or its SSE events when `stream` is true",
            "createMessage", MessagesRequest)),
        "/v1/messages/count_tokens": anthropic_operation(_task_operation(
            "Anthropic Messages API: the prompt's tokens (`input_tokens`), as the model's "
            "runner counts them", "countMessageTokens", CountTokensRequest)),
        "/v1/embeddings": {
            "post": {
                "summary": "Embeddings: one vector per input text or token array (floats or "
                "base64 float32); requests that arrive together share a forward pass",
                "operationId": "createEmbedding",
                "requestBody": _json_body(EmbeddingsRequest),
                "responses": _responses(
                    "A list of embeddings", _JSON, "404", "408", "413", "429", "503", "504"
                ),
            }
        },
        "/v1/images/generations": _task_operation(
            "Generate images", "createImage", ImageGenerationRequest
        ),
        "/v1/images/edits": {
            "post": {
                "summary": "Edit images (multipart upload)",
                "operationId": "imageEdit",
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": edit_form}},
                },
                "responses": _responses(
                    "The edited images, or an SSE stream",
                    {**_JSON, **_SSE},
                    "404",
                    "408",
                "413",
                    "429",
                    "503",
                    "504",
                ),
            }
        },
        "/v1/images/{sha256}": _get(
            "A stored image by the sha256 of its bytes (one this key's tasks made or it sent)",
            "getImage",
            "The image bytes",
            image["content"],
            "404",
            "502",
            "503",
            parameters=[_path_param("sha256", "^[0-9a-f]{64}$")],
        ),
        "/v1/models": _get(
            "The models usable now (placed, or some node can serve them), with placement and "
            "readiness", "listModels", "A list of models", _JSON,
            parameters=[{
                "name": "all",
                "in": "query",
                "required": False,
                "schema": {"type": "boolean", "default": False},
                "description": "true: every model card, each with `available` and "
                "`unavailable_reason`",
            }],
        ),
        "/v1/models/{model}": _get(
            "One model",
            "getModel",
            "The model",
            _JSON,
            "404",
            parameters=[_path_param("model", "^.+$")],
        ),
        "/v1/tasks/{task_id}/cancel": {
            "post": {
                "summary": "Cancel a task (of this API key's tenant), or every choice of an "
                "n > 1 request by the request's id; an unknown id is 404",
                "operationId": "cancelTask",
                "parameters": [task_id],
                "responses": _responses(
                    "The cancel was recorded and announced", _JSON, "404", "503"
                ),
            }
        },
        "/v1/tasks/{task_id}/events": _get(
            "A task's events as SSE, resumable after N events (this API key's tasks only), in "
            "the format of the request that made it (chat.completion.chunk, text_completion, "
            "Responses or image events), or Fleet's own events with format=native (always for "
            "a task published on NATS); a stream with no event for FLEET_GATEWAY_EVENTS_IDLE_S"
            " ends with an `idle` error",
            "taskEvents",
            "SSE; `id:` is the event's index",
            _SSE,
            "404",
            "429",
            "503",
            parameters=[task_id, after, response_format],
        ),
        "/healthz": _get(
            "Up or not: {\"status\": \"ok\"}; with an API key (or without keys configured)"
            " also NATS, streams, models and permission errors",
            "health", "Healthy", _JSON, "503",
        ),
        "/health": _get(
            "The same as /healthz, under the name many probes expect", "healthAlias",
            "Healthy", _JSON, "503",
        ),
        "/docs": _get(
            "This document in Swagger UI (served by the gateway: no CDN)", "docs",
            "An HTML page", {"text/html": {"schema": {"type": "string"}}},
        ),
        "/metrics": _get(
            "Prometheus metrics",
            "metrics",
            "Prometheus text",
            {"text/plain": {"schema": {"type": "string"}}},
        ),
        **ollama_paths(),
        **batch_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Fleet gateway",
            "version": "1",
            "description": "An OpenAI-compatible API over Fleet's NATS task subjects.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"x_api_key": []}, {}],
    }
