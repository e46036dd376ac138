"""The gateway's route table: every route it serves, one row each (fleet.gateway.route_table),
from which fleet.gateway.app makes its Starlette routes and /openapi.json its document. The
OpenAI, Anthropic and operations rows are here; the Ollama, batch, landing-page and /docs rows
come from the modules that own them."""

from __future__ import annotations

from functools import cache
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.gateway import (
    docs,
    embeddings_api,
    image_api,
    landing,
    messages_api,
    ops_api,
    text_api,
)
from fleet.gateway.batch_routes import batch_rows
from fleet.gateway.embeddings_api import EmbeddingsRequest
from fleet.gateway.idempotency import idempotent
from fleet.gateway.image_api import ImageEditRequest, ImageGenerationRequest
from fleet.gateway.messages_replies import AnthropicErrorBody
from fleet.gateway.messages_requests import CountTokensRequest, MessagesRequest
from fleet.gateway.ollama_docs import ollama_rows
from fleet.gateway.openapi import OPENAI_ERRORS, document, edit_form_schema
from fleet.gateway.responses_api import ResponsesRequest
from fleet.gateway.route_table import ID_PATTERN, SSE, Body, Endpoint, Errors, Param, Row
from fleet.gateway.text_requests import ChatCompletionRequest, CompletionRequest

TASK = ("400", "401", "404", "408", "413", "429", "503", "504")  # a route that runs a task
STREAMED = "The result, or an SSE stream when `stream` is true"
OPENAI = ("OpenAI",)
OPERATIONS = ("Operations",)
ANTHROPIC_ERRORS = Errors(model=AnthropicErrorBody, described=OPENAI_ERRORS.described)
# Anthropic's clients send it; accepted, not checked.
ANTHROPIC_VERSION = Param("anthropic-version", "header", {"type": "string"},
                          "Accepted and not checked")
_IDS = {"task_id": ID_PATTERN, "model": "^.+$"}


def _row(method: str, path: str, handler: Endpoint, **fields: Any) -> Row:
    return Row(method, path, handler, patterns=_IDS, **fields)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_document())


V1_ROWS = (
    # Idempotency-Key: a retry attaches to the first request's task (fleet/gateway/idempotency.py)
    _row("POST", "/v1/chat/completions", text_api.chat_completions, wrappers=(idempotent,),
         summary="Chat completion", operation_id="createChatCompletion", tags=OPENAI,
         body=Body(ChatCompletionRequest), ok=STREAMED, stream=SSE, errors=TASK),
    _row("POST", "/v1/completions", text_api.completions, wrappers=(idempotent,),
         summary="Text completion", operation_id="createCompletion", tags=OPENAI,
         body=Body(CompletionRequest), ok=STREAMED, stream=SSE, errors=TASK),
    _row("POST", "/v1/responses", text_api.responses, wrappers=(idempotent,),
         summary="Responses API (text): a `response` object, or its SSE events when `stream` "
         "is true", operation_id="createResponse", tags=OPENAI,
         body=Body(ResponsesRequest), ok=STREAMED, stream=SSE, errors=TASK),
    _row("POST", "/v1/messages", messages_api.messages,
         summary="Anthropic Messages API: a `message`, or its SSE events when `stream` is true",
         operation_id="createMessage", tags=("Anthropic",), body=Body(MessagesRequest),
         params=(ANTHROPIC_VERSION,), ok=STREAMED, stream=SSE, errors=TASK,
         error_shape=ANTHROPIC_ERRORS),
    _row("POST", "/v1/messages/count_tokens", messages_api.count_tokens,
         summary="Anthropic Messages API: the prompt's tokens (`input_tokens`), as the model's "
         "runner counts them", operation_id="countMessageTokens", tags=("Anthropic",),
         body=Body(CountTokensRequest), params=(ANTHROPIC_VERSION,), ok="The token count",
         errors=TASK, error_shape=ANTHROPIC_ERRORS),
    _row("POST", "/v1/embeddings", embeddings_api.embeddings,
         summary="Embeddings: one vector per input text or token array (floats or base64 "
         "float32); requests that arrive together share a forward pass",
         operation_id="createEmbedding", tags=OPENAI, body=Body(EmbeddingsRequest),
         ok="A list of embeddings", errors=TASK),
    _row("POST", "/v1/images/generations", image_api.image_generations, wrappers=(idempotent,),
         summary="Generate images", operation_id="createImage", tags=OPENAI,
         body=Body(ImageGenerationRequest), ok=STREAMED, stream=SSE, errors=TASK),
    _row("POST", "/v1/images/edits", image_api.image_edits, wrappers=(idempotent,),
         summary="Edit images (multipart upload)", operation_id="imageEdit", tags=OPENAI,
         body=Body(ImageEditRequest, "multipart/form-data", form=edit_form_schema),
         ok="The edited images, or an SSE stream", stream=SSE, errors=TASK),
    _row("GET", "/v1/images/{sha256:sha256}", image_api.get_image,
         summary="A stored image by the sha256 of its bytes (one this key's tasks made or it "
         "sent)", operation_id="getImage", tags=OPENAI, ok="The image bytes",
         content={"image/png": {}, "image/jpeg": {}, "image/webp": {}},
         errors=("400", "401", "404", "502", "503")),
    _row("GET", "/v1/models", ops_api.list_models,
         summary="The models usable now (placed, or some node can serve them), with placement "
         "and readiness", operation_id="listModels", tags=OPENAI, ok="A list of models",
         params=(Param("all", "query", {"type": "boolean", "default": False},
                       "true: every model card, each with `available` and "
                       "`unavailable_reason`"),),
         errors=("400", "401")),
    _row("GET", "/v1/models/{model:path}", ops_api.get_model, summary="One model",
         operation_id="getModel", tags=OPENAI, ok="The model", errors=("400", "401", "404")),
    _row("POST", "/v1/tasks/{task_id}/cancel", ops_api.cancel_task,
         summary="Cancel a task (of this API key's tenant), or every choice of an n > 1 "
         "request by the request's id; an unknown id is 404", operation_id="cancelTask",
         tags=OPERATIONS, ok="The cancel was recorded and announced",
         errors=("400", "401", "404", "503")),
    _row("GET", "/v1/tasks/{task_id}/events", ops_api.task_events,
         summary="A task's events as SSE, resumable after N events (this API key's tasks "
         "only), in the format of the request that made it (chat.completion.chunk, "
         "text_completion, Responses or image events), or Fleet's own events with "
         "format=native (always for a task published on NATS); a stream with no event for "
         "FLEET_GATEWAY_EVENTS_IDLE_S ends with an `idle` error", operation_id="taskEvents",
         tags=OPERATIONS, ok="SSE; `id:` is the event's index", content={}, stream=SSE,
         params=(
             Param("after", "query", {"type": "integer", "minimum": 0,
                                      "maximum": 999_999_999, "default": 0},
                   "How many of the task's events the client has already seen"),
             Param("format", "query", {"type": "string", "enum": ["openai", "native"],
                                       "default": "openai"},
                   "openai: the format of the request that made the task; native: Fleet's "
                   "events"),
         ),
         errors=("400", "401", "404", "429", "503")),
    _row("GET", "/healthz", ops_api.healthz,
         summary="Up or not: {\"status\": \"ok\"}; with an API key (or without keys "
         "configured) also NATS, streams, models and permission errors",
         operation_id="health", tags=OPERATIONS, ok="Healthy", errors=("400", "401", "503")),
    _row("GET", "/health", ops_api.healthz,
         summary="The same as /healthz, under the name many probes expect",
         operation_id="healthAlias", tags=OPERATIONS, ok="Healthy",
         errors=("400", "401", "503")),
    _row("GET", "/metrics", ops_api.metrics, summary="Prometheus metrics",
         operation_id="metrics", tags=OPERATIONS, ok="Prometheus text",
         content={"text/plain": {"type": "string"}}, errors=("400", "401")),
    # The document does not list itself.
    _row("GET", "/openapi.json", openapi, public=False),
)


@cache
def gateway_rows() -> tuple[Row, ...]:
    """Every route of the gateway, in routing order (/ui is added by the dashboard's mount)."""
    return (*V1_ROWS, *batch_rows(), *ollama_rows(), *landing.rows(), *docs.rows())


@cache
def openapi_document() -> dict[str, Any]:
    return document(gateway_rows())
