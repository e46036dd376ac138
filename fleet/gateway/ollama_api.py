"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/embed (and the
older /api/embeddings) and /api/version, so that apps written for Ollama (Open WebUI, the
`ollama` clients) use the fleet. Chat and generate become the same text tasks as the OpenAI
routes (fleet.gateway.ollama_requests) and stream NDJSON (fleet.gateway.ollama_replies);
embeddings are the same task as /v1/embeddings (fleet.gateway.embeddings_api.embed), cut to
fit the context by default as Ollama does.

Every failure on these routes is in Ollama's shape, `{"error": "..."}`, with the HTTP status
Fleet gives its code (fleet.errors.STATUS_BY_CODE): the routes raise as the OpenAI routes do,
and fleet.gateway.ollama_errors reshapes every error answer under /api/.

A model is named by its card id; Ollama's default tag is accepted too (`tiny-llm:latest` is
`tiny-llm`). A session id comes only from the X-Session-Id header: Ollama's requests have no
field for one.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import InvalidParameter, ModelNotFound
from fleet.gateway.auth import tenant_of
from fleet.gateway.bodies import parse, read_json
from fleet.gateway.catalogue import ModelState, refuses_images
from fleet.gateway.embeddings_api import Embedded, embed
from fleet.gateway.errors import PROMPT_PARAM
from fleet.gateway.ollama_replies import (
    NDJSON,
    OllamaRenderer,
    OllamaReply,
    timestamp,
)
from fleet.gateway.ollama_requests import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    chat_images,
    chat_task,
    generate_images,
    generate_task,
)
from fleet.gateway.relay import EventStream
from fleet.gateway.service import TASK_ID_HEADER, Gateway, gateway_of, new_task_id, now_utc
from fleet.gateway.sessions import session_of
from fleet.gateway.vision import check_chat_images
from fleet.wire.cluster import ModelCard
from fleet.wire.tasks import TextGeneration

# The Ollama API version whose shapes these routes follow; some apps check for a minimum.
OLLAMA_VERSION = "0.12.0"
DEFAULT_TAG = ":latest"
# Fleet keeps a placed model until it is removed: it never expires the way Ollama's do.
NEVER = "9999-12-31T23:59:59Z"

def card_named(gateway: Gateway, model: str) -> ModelCard:
    """The card of an Ollama model name: the card id, or it with Ollama's default tag."""
    card = gateway.catalogue.card(model) or gateway.catalogue.card(model.removesuffix(DEFAULT_TAG))
    if card is None:
        raise ModelNotFound(f"model {model!r} not found")
    return card


def text_card(gateway: Gateway, model: str) -> ModelCard:
    return gateway.card_for(card_named(gateway, model).id, "text_generation")


async def _run(request: Request, task: TextGeneration, reply: OllamaReply, stream: bool,
               timeout_s: float) -> Response:
    gateway = gateway_of(request)
    api = "chat.completions" if task.messages is not None else "completions"
    response = await gateway.run(request, [task], OllamaRenderer(reply), stream=stream,
                                 resumable=False, timeout_s=timeout_s, api=api)
    if isinstance(response, EventStream):
        response.headers["content-type"] = NDJSON
    return response


async def _hashes(gateway: Gateway, request: Request, card: ModelCard,
                  urls: list[str]) -> dict[str, str]:
    if urls and (why := refuses_images(card)):
        raise InvalidParameter(why, "images")
    check_chat_images(urls, "images")  # before any image is stored
    return {url: await gateway.image_hash(url, tenant_of(request)) for url in urls}


async def chat(request: Request) -> Response:
    started = time.time()
    gateway = gateway_of(request)
    asked = parse(OllamaChatRequest, await read_json(request))
    card = text_card(gateway, asked.model)
    asked = asked.model_copy(update={"model": card.id})
    reply = OllamaReply(card.id, "chat", started)
    if not asked.messages:
        return JSONResponse(reply.loaded(time.time()))  # Ollama's way to load a model
    hashes = await _hashes(gateway, request, card, chat_images(asked))
    timeout_s = gateway.timeout_for(None)
    task = chat_task(asked, new_task_id("ollama"), hashes, now_utc(), timeout_s,
                     card.context_length, session_of(request.headers))
    return await _run(request, task, reply, asked.stream, timeout_s)


async def generate(request: Request) -> Response:
    started = time.time()
    gateway = gateway_of(request)
    asked = parse(OllamaGenerateRequest, await read_json(request))
    card = text_card(gateway, asked.model)
    asked = asked.model_copy(update={"model": card.id})
    reply = OllamaReply(card.id, "generate", started)
    if not asked.prompt and not asked.images:
        return JSONResponse(reply.loaded(time.time()))  # Ollama's way to load a model
    hashes = await _hashes(gateway, request, card, generate_images(asked))
    timeout_s = gateway.timeout_for(None)
    task = generate_task(asked, new_task_id("ollama"), hashes, now_utc(), timeout_s,
                         card.context_length, session_of(request.headers))
    return await _run(request, task, reply, asked.stream, timeout_s)


def details(card: ModelCard) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf" if "gguf" in card.family else "mlx",
        "family": card.family,
        "families": [card.family],
        "parameter_size": "",
        "quantization_level": card.quantization,
    }


def digest(card: ModelCard) -> str:
    """Names the card's contents, as Ollama's digest names a model's manifest."""
    return hashlib.sha256(card.model_dump_json().encode()).hexdigest()


def model_entry(card: ModelCard) -> dict[str, Any]:
    return {
        "name": card.id, "model": card.id, "modified_at": timestamp(0),
        "size": card.size_bytes, "digest": digest(card), "details": details(card),
    }


def capabilities(card: ModelCard) -> list[str]:
    found = ["completion"] if "text_generation" in card.tasks else []
    found += ["embedding"] if card.is_embedding else []
    return found + [c for c in ("tools", "vision") if c in card.capabilities]


def _ollama_cards(gateway: Gateway) -> list[ModelCard]:
    """The models Ollama's API can use: text and embedding models (not image makers)."""
    return [card for card in gateway.cards().values()
            if "text_generation" in card.tasks or card.is_embedding]


async def tags(request: Request) -> Response:
    """The models usable now (placed, or some node can serve them), as /v1/models lists."""
    gateway = gateway_of(request)
    states = await gateway.model_states()
    unavailable = gateway.availability()
    usable = []
    for card in _ollama_cards(gateway):
        state = states.get(card.id, ModelState()) if states is not None else None
        placed = bool(state and (state.placed or state.ready))
        if state is None or unavailable is None or unavailable(card, placed) is None:
            usable.append(model_entry(card))
    return JSONResponse({"models": usable})


async def ps(request: Request) -> Response:
    """The models with a runner ready to take tasks."""
    gateway = gateway_of(request)
    states = await gateway.model_states() or {}
    running = [
        {**model_entry(card), "expires_at": NEVER, "size_vram": 0,
         "context_length": card.context_length}
        for card in _ollama_cards(gateway) if states.get(card.id, ModelState()).ready
    ]
    return JSONResponse({"models": running})


async def show(request: Request) -> Response:
    asked = parse(OllamaShowRequest, await read_json(request))
    card = card_named(gateway_of(request), asked.model)
    info = {
        "general.architecture": card.family,
        f"{card.family}.context_length": card.context_length,
        "fleet.name": card.name,
        "fleet.tasks": list(card.tasks),
    }
    if card.n_layers:
        info[f"{card.family}.block_count"] = card.n_layers
    if card.hidden_size:
        info[f"{card.family}.embedding_length"] = card.hidden_size
    return JSONResponse({
        "modelfile": "", "parameters": "", "template": "", "license": "",
        "details": details(card), "model_info": info, "capabilities": capabilities(card),
        "modified_at": timestamp(0),
    })


async def _embedded(request: Request, model: str, inputs: str | list[str], truncate: bool,
                    dimensions: int | None) -> tuple[Embedded, dict[str, Any]]:
    """The vectors (embeddings_api.embed: the same task as /v1/embeddings) and the fields
    every Ollama embedding answer has."""
    started = time.time()
    gateway = gateway_of(request)
    PROMPT_PARAM.set("input")
    card = card_named(gateway, model)
    embedded = await embed(request, card.id, inputs, dimensions=dimensions, truncate=truncate)
    return embedded, {
        "model": card.id, "total_duration": round((time.time() - started) * 1e9),
        "load_duration": 0, "prompt_eval_count": embedded.prompt_tokens,
    }


async def embed_texts(request: Request) -> Response:
    """/api/embed: one vector per input."""
    asked = parse(OllamaEmbedRequest, await read_json(request))
    embedded, fields = await _embedded(request, asked.model, asked.input, asked.truncate,
                                       asked.dimensions)
    return JSONResponse({**fields, "embeddings": embedded.vectors},
                        headers={TASK_ID_HEADER: embedded.task_id})


async def embeddings(request: Request) -> Response:
    """/api/embeddings, Ollama's older route: one prompt, `embedding`."""
    asked = parse(OllamaEmbeddingsRequest, await read_json(request))
    embedded, _ = await _embedded(request, asked.model, asked.prompt, True, None)
    return JSONResponse({"embedding": embedded.vectors[0]},
                        headers={TASK_ID_HEADER: embedded.task_id})


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})

