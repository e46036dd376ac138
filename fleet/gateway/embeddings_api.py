"""The embeddings API: POST /v1/embeddings in OpenAI's shape, and `embed()`, the same request
for other routes of this gateway (Ollama's /api/embed).

One request is one `embeddings` task (all its inputs); the embedding runner batches the tasks
that reach it together into one forward pass. Vectors travel on NATS in the format the client
asked for (JSON numbers, or base64 of little-endian float32, which is OpenAI's base64), so the
gateway only puts them in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from fleet.errors import FleetError, InvalidParameter
from fleet.gateway.bodies import OpenAIRequest, Timeout, deadline_after, parse, read_json
from fleet.gateway.errors import PROMPT_PARAM
from fleet.gateway.service import Gateway, gateway_of, new_task_id, now_utc
from fleet.wire.cluster import ModelCard
from fleet.wire.events import EmbeddingChunk, OutputEvent, TaskFinished
from fleet.wire.tasks import MAX_TOKEN_ID, Embeddings

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs

TokenArray = list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]
# A vector's length, bounded as a token id is: the OpenAPI fuzz sent 9e35, schema-valid, and
# the task refused it with a 400.
MAX_DIMENSIONS = 2**31 - 1
Encoding = Literal["float", "base64"]


class EmbeddingsRequest(OpenAIRequest):
    model: str
    input: str | list[str] | TokenArray | list[TokenArray] = Field(
        description="A text, a list of texts, a token array or a list of token arrays"
    )
    encoding_format: Encoding = "float"
    dimensions: int | None = Field(
        default=None, ge=1, le=MAX_DIMENSIONS,
        description="Shorter vectors; only for models whose card allows it"
    )
    user: str | None = None
    timeout: Timeout | None = None


def inputs_of(raw: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """The request's inputs as a list (one string or one token array is a list of one);
    400 for nothing to embed."""
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(item, int) for item in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise InvalidParameter("input: give at least one text or token array", "input")
    if len(items) > MAX_INPUTS:
        raise InvalidParameter(f"input: at most {MAX_INPUTS} inputs in one request", "input")
    for index, item in enumerate(items):
        if len(item) == 0:
            raise InvalidParameter(f"input[{index}] is empty: nothing to embed", "input")
    return items


def embeddings_task(
    card: ModelCard, inputs: list[str] | list[list[int]], *, encoding: Encoding,
    dimensions: int | None, timeout_s: float, truncate: bool = False,
) -> Embeddings:
    """The task for a request; 400 when the model cannot give `dimensions`."""
    if why := card.embedding_spec.refuses_dimensions(dimensions):
        raise InvalidParameter(why, "dimensions")
    return Embeddings(
        task_id=new_task_id("emb"), model=card.id, input=inputs, dimensions=dimensions,
        encoding_format=encoding, truncate=truncate, created_at=now_utc(),
        deadline=deadline_after(now_utc(), timeout_s),
    )


@dataclass(frozen=True)
class Embedded:
    """What `embed()` gives: one vector per input, in order."""

    model: str
    vectors: list[list[float]]
    prompt_tokens: int
    task_id: str


def vectors_in(events: Sequence[OutputEvent], count: int) -> list[Any]:
    """Each input's vector from the task's `embedding` events, by index (a restarted task may
    repeat some); a missing one is an internal error, never a short answer."""
    found: dict[int, Any] = {}
    for event in events:
        if isinstance(event, EmbeddingChunk):
            for offset, vector in enumerate(event.embeddings):
                found[event.index + offset] = vector
    if len(found) != count or set(found) != set(range(count)):
        raise FleetError(f"the task returned {len(found)} vectors for {count} inputs")
    return [found[index] for index in range(count)]


def tokens_in(events: Sequence[OutputEvent]) -> int:
    finished = next((e for e in events if isinstance(e, TaskFinished)), None)
    return finished.usage.prompt_tokens if finished and finished.usage else 0


class EmbeddingsRenderer:
    """OpenAI's `list` of `embedding` objects; embeddings are never streamed."""

    def __init__(self, model: str, count: int) -> None:
        self.model = model
        self.count = count
        self.answer: dict[str, Any] | None = None

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        vectors = vectors_in(events, self.count)
        tokens = tokens_in(events)
        self.answer = {
            "object": "list",
            "data": [{"object": "embedding", "index": index, "embedding": vector}
                     for index, vector in enumerate(vectors)],
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return self.answer

    def opening(self) -> list[bytes]:
        return []

    async def lines(self, item: Any) -> list[bytes]:
        return []

    def closing(self) -> list[bytes]:
        return []

    def failed(self, exc: FleetError) -> list[bytes]:
        return []


async def embeddings(request: Request) -> Response:
    asked = parse(EmbeddingsRequest, await read_json(request))
    PROMPT_PARAM.set("input")  # what a context overflow names
    gateway = gateway_of(request)
    card = gateway.card_for(asked.model, "embeddings")
    inputs = inputs_of(asked.input)
    timeout_s = gateway.timeout_for(asked.timeout)
    task = embeddings_task(card, inputs, encoding=asked.encoding_format,
                           dimensions=asked.dimensions, timeout_s=timeout_s)
    renderer = EmbeddingsRenderer(asked.model, len(inputs))
    return await gateway.run(request, [task], renderer, stream=False, resumable=False,
                             timeout_s=timeout_s, api="embeddings")


class EmbedFailed(FleetError):
    """The request was answered with an error after its task was published (the task
    failed, or its time ran out): the code and words of that answer."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status

    @property
    def http_status(self) -> int:
        return self.status



async def embed(
    request: Request, model: str, inputs: str | Sequence[str], *,
    dimensions: int | None = None, truncate: bool = False, timeout_s: float | None = None,
) -> Embedded:
    """Embed `inputs` with `model` for another API's route (the request's tenant and hang-up
    apply). Raises a FleetError (its `http_status` and `message` say what to answer):
    ModelNotFound (404), InvalidRequest/InvalidParameter (400: empty input, a model that does
    not make embeddings, dimensions it cannot give), ModelUnavailable (503), EmbedFailed
    (the task's failure: 400 for an input over the context without `truncate`, 504, ...)."""
    gateway: Gateway = gateway_of(request)
    card = gateway.card_for(model, "embeddings")
    texts = inputs_of(inputs if isinstance(inputs, str) else list(inputs))
    timeout = gateway.timeout_for(timeout_s)
    task = embeddings_task(card, texts, encoding="float", dimensions=dimensions,
                           timeout_s=timeout, truncate=truncate)
    renderer = EmbeddingsRenderer(model, len(texts))
    response = await gateway.run(request, [task], renderer, stream=False, resumable=False,
                                 timeout_s=timeout, api="embeddings")
    if renderer.answer is None:
        raise _failure_of(response)
    return Embedded(
        model=card.id, vectors=[item["embedding"] for item in renderer.answer["data"]],
        prompt_tokens=renderer.answer["usage"]["prompt_tokens"], task_id=task.task_id,
    )


def _failure_of(response: Response) -> EmbedFailed:
    try:
        error = orjson.loads(bytes(response.body))["error"]
        code = error.get("fleet_code") or error.get("code") or "internal"
        message = error.get("message") or "the embeddings task failed"
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        code, message = "internal", "the embeddings task ended without an answer"
    return EmbedFailed(str(code), str(message), response.status_code)
