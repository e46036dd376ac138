"""POST /v1/embeddings with the official `openai` client against real processes: nats-server,
`fleet worker` running tiny-embed in an embedding runner, and `fleet gateway`. One stack for
the whole module. Micro-batching is counted from the runner's own `forward_pass` stamps."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import orjson
import pytest
from load_helpers import one_model_stack
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet.config import load_settings
from fleet.errors import FleetError
from fleet.gateway.app import build_app
from fleet.gateway.embeddings_api import embed
from tests.integration.harness import client

# the openai client is imported where used, not at the top: collection imports this module
# in every xdist worker (0.7 s of CPU; issue 28).
if TYPE_CHECKING:
    import openai

MODEL = "tiny-embed"
DIMENSIONS = 64  # its card's
BURST = 200


@dataclass(frozen=True)
class Stack:
    url: str
    nats_url: str
    openai: openai.OpenAI


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_embed_dir: Path) -> Iterator[Stack]:
    import openai
    with one_model_stack(tmp_path_factory.mktemp("embeddings"), MODEL, tiny_embed_dir,
                         slots=256) as (nats_url, url):
        yield Stack(url, nats_url,
                    openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60))


def test_float_and_base64_give_the_same_unit_vectors(stack: Stack) -> None:
    texts = ["The quick brown fox", "Hello! How can I help you today?"]
    floats = stack.openai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [item.index for item in floats.data] == [0, 1]
    vectors = np.array([item.embedding for item in floats.data])
    assert vectors.shape == (2, DIMENSIONS)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 2

    # The SDK asks for base64 by itself and decodes it to floats (with numpy present) ...
    decoded = stack.openai.embeddings.create(model=MODEL, input=texts)
    # (Each call is a pass of its own: equal up to the BLAS's rounding, not bit for bit.)
    assert np.allclose(np.array([item.embedding for item in decoded.data]), vectors,
                       atol=1e-6)
    # ... and hands base64 over as is when the caller asks for it.
    raw = stack.openai.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    as_base64 = np.array([np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
                          for item in raw.data])  # type: ignore[arg-type]
    assert np.allclose(as_base64, vectors, atol=1e-6)


def test_identical_texts_match_and_different_texts_differ(stack: Stack) -> None:
    same = "A fleet of workers pulls tasks from a queue"
    batch = stack.openai.embeddings.create(model=MODEL, input=[same, "Paris is lovely", same])
    first, other, again = (np.array(item.embedding) for item in batch.data)
    assert np.array_equal(first, again)
    assert not np.allclose(first, other, atol=1e-3)
    alone = np.array(stack.openai.embeddings.create(model=MODEL, input=same).data[0].embedding)
    assert np.allclose(alone, first, atol=1e-5)  # another pass, other padding: the same vector


def test_token_arrays_and_dimensions(stack: Stack) -> None:
    tokens = stack.openai.embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]])
    assert len(tokens.data) == 2 and len(tokens.data[0].embedding) == DIMENSIONS
    assert tokens.usage.prompt_tokens == 5
    short = stack.openai.embeddings.create(model=MODEL, input="Hello", dimensions=16)
    vector = np.array(short.data[0].embedding)
    assert vector.shape == (16,) and np.isclose(np.linalg.norm(vector), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": MODEL, "input": ""}, 400, "empty"),
        ({"model": MODEL, "input": []}, 400, "at least one"),
        ({"model": MODEL, "input": ["fine", ""]}, 400, "input[1] is empty"),
        ({"model": MODEL, "input": [[1] * 3000]}, 400, "over the model's maximum"),
        ({"model": MODEL, "input": "hi", "dimensions": 65}, 400, "more than the model's"),
        ({"model": "no-such-model", "input": "hi"}, 404, "does not exist"),
        ({"model": "tiny-llm", "input": "hi"}, 400, "does not do embeddings"),
    ],
)
def test_bad_requests_are_clear_errors(stack: Stack, body: dict, status: int, words: str) -> None:
    response = httpx.post(f"{stack.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_a_context_overflow_is_openais_code_through_the_sdk(stack: Stack) -> None:
    import openai
    with pytest.raises(openai.BadRequestError) as refused:
        stack.openai.embeddings.create(model=MODEL, input=[[1] * 3000])
    assert refused.value.code == "context_length_exceeded"


async def _burst(stack: Stack) -> tuple[list[int], dict[str, set[int]]]:
    """BURST concurrent one-text requests; their statuses, and the forward passes that
    computed each task's vectors (from its `embedding` events, heard on fleet.out.>)."""
    nc = await client(stack.nats_url)
    passes: dict[str, set[int]] = {}
    finished: set[str] = set()
    all_heard = asyncio.Event()
    wanted: set[str] = set()

    async def heard(msg: object) -> None:
        event = orjson.loads(msg.data)  # type: ignore[attr-defined]
        if event.get("type") == "embedding":
            passes.setdefault(event["task_id"], set()).add(event["forward_pass"])
        elif event.get("type") == "task_finished":
            finished.add(event["task_id"])
        if wanted and wanted <= finished and wanted <= set(passes):
            all_heard.set()

    subscription = await nc.subscribe("fleet.out.>", cb=heard)
    await nc.flush()
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=stack.url, limits=limits, timeout=120) as http:
        responses = await asyncio.gather(*(
            http.post("/v1/embeddings", json={"model": MODEL, "input": f"text number {i}"})
            for i in range(BURST)
        ))
    wanted.update(r.headers["x-fleet-task-id"] for r in responses)
    if not (wanted <= finished and wanted <= set(passes)):
        await asyncio.wait_for(all_heard.wait(), timeout=30)
    await subscription.unsubscribe()
    await nc.close()
    return [r.status_code for r in responses], {t: passes[t] for t in wanted}


def test_concurrent_requests_share_forward_passes(stack: Stack) -> None:
    statuses, passes = asyncio.run(_burst(stack))
    assert statuses == [200] * BURST
    engine_calls = set().union(*passes.values())
    assert all(len(calls) == 1 for calls in passes.values())  # one text: one pass each
    assert len(engine_calls) <= BURST // 4, f"{len(engine_calls)} passes for {BURST} requests"


async def _through_embed(stack: Stack, data_dir: Path, calls: list[dict]) -> list[dict]:
    """embed() as another route of a gateway calls it (Ollama's /api/embed does): an
    in-process gateway on the module's NATS with one extra route that calls it with the
    posted arguments, once per entry of `calls`."""
    app = build_app(load_settings({"nats_url": stack.nats_url, "data_dir": data_dir}, env={}))

    async def call_embed(request: Request) -> JSONResponse:
        arguments = await request.json()
        try:
            got = await embed(request, MODEL, **arguments)
        except FleetError as exc:
            return JSONResponse({"status": exc.http_status, "code": exc.code,
                                 "message": exc.message})
        return JSONResponse({"vectors": got.vectors, "tokens": got.prompt_tokens,
                             "model": got.model})

    app.router.routes.append(Route("/embed", call_embed, methods=["POST"]))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return [(await http.post("/embed", json=call, timeout=60)).json() for call in calls]


def test_embed_for_other_routes_gives_the_same_vectors_and_typed_errors(
    stack: Stack, tmp_path: Path
) -> None:
    texts = ["Hello! How can I help you today?", "Thank you very much."]
    long_text = "The quick brown fox jumps over the lazy dog. " * 300  # over 2048 tokens
    got, refused, cut = asyncio.run(_through_embed(stack, tmp_path, [
        {"inputs": texts}, {"inputs": [long_text]}, {"inputs": [long_text], "truncate": True},
    ]))
    assert got["model"] == MODEL and got["tokens"] > 2
    same = stack.openai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert np.allclose(got["vectors"], [item.embedding for item in same.data], atol=1e-5)
    assert (refused["status"], refused["code"]) == (400, "context_length")
    assert cut["tokens"] == 2048 and len(cut["vectors"][0]) == DIMENSIONS


async def _asked(stack: Stack, body: dict) -> dict:
    nc = await client(stack.nats_url)
    try:
        reply = await nc.request(f"fleet.ask.{MODEL}", orjson.dumps(body), timeout=60)
    finally:
        await nc.close()
    return orjson.loads(reply.data)


def test_request_reply_on_nats_answers_the_vectors(stack: Stack) -> None:
    answer = asyncio.run(_asked(stack, {"type": "embeddings", "input": ["hello", "world"]}))
    assert (answer["type"], answer["status"]) == ("ask_answer", "completed")
    vectors = np.array(answer["embeddings"])
    assert vectors.shape == (2, DIMENSIONS)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
