"""The Ollama routes as rows of the gateway's route table (fleet.gateway.api_table): their
handlers (fleet.gateway.ollama_api), request models, NDJSON or JSON answers, and Ollama's
error shape."""

from __future__ import annotations

from fleet.gateway import ollama_api
from fleet.gateway.ollama_requests import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from fleet.gateway.route_table import NDJSON, Body, Endpoint, Errors, Row, Stream

OLLAMA_ERRORS = Errors(
    schema={"type": "object", "properties": {"error": {"type": "string"}},
            "required": ["error"]},
    described={
        "400": "Invalid request", "401": "Missing or wrong API key (when keys are configured)",
        "404": "Unknown model", "408": "The request body did not arrive in time",
        "413": "Request body too large", "429": "Too many requests wait; see Retry-After",
        "503": "NATS unreachable, or no node can serve the model",
        "504": "No answer before the deadline",
    })
_TASKS = ("401", "400", "404", "408", "413", "429", "503", "504")


def _row(method: str, path: str, handler: Endpoint, summary: str, operation_id: str,
         *errors: str, body: Body | None = None, stream: Stream | None = None) -> Row:
    return Row(method, path, handler, summary=summary, operation_id=operation_id,
               tags=("Ollama",), ok="The answer", errors=errors, error_shape=OLLAMA_ERRORS,
               body=body, stream=stream)


def ollama_rows() -> tuple[Row, ...]:
    return (
        _row("POST", "/api/chat", ollama_api.chat,
             "Ollama: a chat turn, as NDJSON lines (stream, the default) or one object",
             "ollamaChat", *_TASKS, body=Body(OllamaChatRequest), stream=NDJSON),
        _row("POST", "/api/generate", ollama_api.generate,
             "Ollama: a completion of `prompt` (the chat template applied unless `raw`)",
             "ollamaGenerate", *_TASKS, body=Body(OllamaGenerateRequest), stream=NDJSON),
        _row("GET", "/api/tags", ollama_api.tags,
             "Ollama: the text and embedding models usable now", "ollamaTags", "401", "503"),
        _row("POST", "/api/show", ollama_api.show,
             "Ollama: one model's details and capabilities", "ollamaShow",
             "401", "400", "404", "408", "413", body=Body(OllamaShowRequest)),
        _row("GET", "/api/ps", ollama_api.ps, "Ollama: the models with a runner ready",
             "ollamaPs", "401", "503"),
        _row("POST", "/api/embed", ollama_api.embed_texts,
             "Ollama: one vector per input (`embeddings`), cut to fit unless `truncate` is "
             "false", "ollamaEmbed", *_TASKS, body=Body(OllamaEmbedRequest)),
        _row("POST", "/api/embeddings", ollama_api.embeddings,
             "Ollama's older embeddings route: one prompt, one `embedding`",
             "ollamaEmbeddings", *_TASKS, body=Body(OllamaEmbeddingsRequest)),
        _row("GET", "/api/version", ollama_api.version,
             "Ollama: the Ollama API version these routes follow", "ollamaVersion", "401"),
    )
