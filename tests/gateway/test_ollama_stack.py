"""The official `ollama` client against real processes: nats-server, `fleet worker` running
tiny-llm (mlx-lm), tiny-embed and two one-slot runners of the fault engine, and `fleet
gateway`. One
stack for the module. On the same stack: a session's turns stay on its runner, and a context
overflow has OpenAI's code through the `openai` SDK."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import orjson
import pytest
from gateway_helpers import sse_blocks

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from fleet.placement import place
from fleet.placement_replicas import place_replicas
from fleet.wire import subjects
from fleet.wire.cluster import ModelCard, RunnerRecord
from fleet.wire.codec import decode_model
from tests.gateway_process import GatewayProcess
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    client,
    seed_models,
    wait_node,
)

# the ollama and openai clients are imported where used, not at the top: collection imports
# this module in every xdist worker (openai costs 0.7 s of CPU; issue 28).
if TYPE_CHECKING:
    import ollama
    import openai

MODEL = "tiny-llm"
EMBED = "tiny-embed"
FAULT = "fault-llm"
GREEDY = {"temperature": 0.0, "num_predict": 6}


@dataclass(frozen=True)
class Stack:
    url: str
    ollama: ollama.Client
    openai: openai.OpenAI


async def _place(url: str, card: ModelCard, node_dir: Path) -> None:
    """Place tiny-llm, tiny-embed and two one-slot runners of `card` at once; return once
    all four are ready (they load side by side)."""
    nc = await client(url)
    node = await wait_node(nc, node_dir)
    js = nc.jetstream()
    watcher = await (await js.key_value(subjects.RUNNERS_BUCKET)).watchall()
    await place(js, get_card(MODEL), node_id=node)
    await place(js, get_card(EMBED), node_id=node)
    await place_replicas(js, card, 2, node_id=node, slots=1)
    ready: set[str] = set()
    deadline = time.monotonic() + 120
    try:
        while len(ready) < 4:
            entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            if entry is not None and entry.value:
                record = decode_model(RunnerRecord, entry.value)
                if record.status.state == "ready":
                    ready.add(record.runner_id)
    finally:
        await watcher.stop()
        await nc.close()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_llm_dir: Path, tiny_embed_dir: Path,
) -> Iterator[Stack]:
    import ollama
    import openai
    root = tmp_path_factory.mktemp("ollama")
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as nats_server:
        worker_dir, gateway_dir = root / "worker", root / "gateway"
        seed_models(worker_dir, {MODEL: tiny_llm_dir, EMBED: tiny_embed_dir})
        card = add_fault_card(worker_dir, FAULT)
        add_fault_card(gateway_dir, FAULT)
        worker = WorkerProcess(nats_server.url, worker_dir, OPENBLAS_NUM_THREADS="1").start()
        gateway = GatewayProcess(nats_server.url, gateway_dir)
        try:
            asyncio.run(_place(nats_server.url, card, worker_dir))
            url = gateway.wait_listening()
            yield Stack(url, ollama.Client(host=url, timeout=120),
                        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120))
        finally:
            gateway.stop()
            worker.stop()


HELLO = [{"role": "user", "content": "hello there"}]


def test_chat_streams_ndjson_and_ends_with_counts(stack: Stack) -> None:
    parts = list(stack.ollama.chat(MODEL, messages=HELLO, stream=True, options=GREEDY))
    *tokens, last = parts
    assert tokens and not any(part.done for part in tokens) and last.done
    assert last.done_reason == "length" and last.eval_count == 6
    assert last.prompt_eval_count and last.prompt_eval_count > 0
    assert last.total_duration and last.total_duration >= (last.eval_duration or 0) > 0
    streamed = "".join(part.message.content or "" for part in parts)
    whole = stack.ollama.chat(MODEL, messages=HELLO, stream=False, options=GREEDY)
    assert whole.done and whole.message.role == "assistant"
    assert whole.message.content == streamed  # greedy: the same tokens either way
    loaded = stack.ollama.chat(MODEL, messages=[])  # Ollama's way of loading a model
    assert loaded.done and loaded.done_reason == "load"


def test_generate_templated_and_raw(stack: Stack) -> None:
    templated = stack.ollama.generate(MODEL, "hello there", options=GREEDY)
    assert templated.done and templated.eval_count == 6 and templated.response
    raw = stack.ollama.generate(MODEL, "hello there", raw=True, options=GREEDY)
    assert raw.done and raw.eval_count == 6
    assert raw.prompt_eval_count < templated.prompt_eval_count  # no chat template around it
    streamed = list(stack.ollama.generate(MODEL, "hello there", stream=True, options=GREEDY))
    assert "".join(part.response or "" for part in streamed) == templated.response
    loaded = stack.ollama.generate(MODEL, "")  # Ollama's way of loading a model
    assert loaded.done and loaded.done_reason == "load"


def test_format_json_or_a_schema_shapes_the_reply(stack: Stack) -> None:
    """Random weights write JSON only because the grammar masks everything else."""
    options = {"temperature": 0.0, "num_predict": 12}
    as_json = stack.ollama.chat(MODEL, messages=HELLO, format="json", options=options)
    assert as_json.message.content and as_json.message.content.startswith("{")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = stack.ollama.generate(MODEL, "a number", format=schema, options=options)
    assert shaped.response and shaped.response.startswith('{"n": ')


def test_tags_show_ps_and_version(stack: Stack) -> None:
    listed = {model.model for model in stack.ollama.list().models}
    assert {MODEL, FAULT, EMBED} <= listed
    shown = stack.ollama.show(f"{MODEL}:latest")  # Ollama's default tag names the model too
    assert shown.capabilities and "completion" in shown.capabilities
    assert shown.modelinfo and shown.modelinfo["fleet.tasks"] == ["text_generation"]
    running = {model.model: model for model in stack.ollama.ps().models}
    assert {MODEL, FAULT} <= set(running) and running[MODEL].context_length
    version = stack.ollama._request_raw("GET", "/api/version").json()  # the client has no call
    assert version["version"].count(".") == 2


def test_embed_one_or_many_inputs_and_the_older_route(stack: Stack) -> None:
    import ollama
    one = stack.ollama.embed(EMBED, "the same text")
    many = stack.ollama.embed(EMBED, ["the same text", "another text"])
    assert len(one.embeddings) == 1 and len(many.embeddings) == 2
    # The same text, the same vector (up to float rounding: batched with a longer text, it is
    # padded), and another text another vector.
    assert list(many.embeddings[0]) == pytest.approx(list(one.embeddings[0]), abs=1e-5)
    assert list(many.embeddings[1]) != pytest.approx(list(many.embeddings[0]), abs=1e-3)
    assert many.prompt_eval_count and many.prompt_eval_count > 0
    older = stack.ollama.embeddings(EMBED, "the same text")
    assert list(older.embedding) == pytest.approx(list(one.embeddings[0]), abs=1e-5)
    with pytest.raises(ollama.ResponseError) as not_embedding:
        stack.ollama.embed(MODEL, "text")  # a chat model makes no embeddings
    assert not_embedding.value.status_code == 400


def test_errors_in_ollamas_shape(stack: Stack) -> None:
    import ollama
    with pytest.raises(ollama.ResponseError) as missing:
        stack.ollama.chat("no-such-model", messages=HELLO, stream=False)
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        stack.ollama.chat(MODEL, messages=HELLO, options={"temperature": 9})
    assert bad.value.status_code == 400 and "temperature" in bad.value.error
    with pytest.raises(ollama.ResponseError) as refused:  # the runner refuses, after publishing
        stack.ollama.chat(FAULT, messages=[{"role": "user", "content": "reject:context_length"}],
                          stream=False)
    assert refused.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as unserved:  # a route Fleet does not serve
        stack.ollama.pull(MODEL)
    assert unserved.value.status_code == 404 and unserved.value.error == "Not Found"


def test_a_context_overflow_has_openais_code_through_the_sdk(stack: Stack) -> None:
    import openai
    overflow = [{"role": "user", "content": "reject:context_length"}]
    with pytest.raises(openai.BadRequestError) as chat:
        stack.openai.chat.completions.create(model=FAULT, messages=overflow)  # type: ignore[arg-type]
    assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"
    assert isinstance(chat.value.body, dict) and chat.value.body["fleet_code"] == "context_length"
    with pytest.raises(openai.BadRequestError) as completion:
        stack.openai.completions.create(model=FAULT, prompt="reject:context_length")
    assert completion.value.code == "context_length_exceeded"
    assert completion.value.param == "prompt"
    too_long = [{"role": "user", "content": "hello " * 3000}]  # over tiny-llm's 2,048 tokens
    with pytest.raises(openai.BadRequestError) as real:  # the mlx-lm runner's own refusal
        stack.openai.chat.completions.create(model=MODEL, messages=too_long)  # type: ignore[arg-type]
    assert real.value.code == "context_length_exceeded" and "2048" in real.value.message


def _runner_of(stack: Stack, task_id: str) -> str:
    """The runner that finished a task, from its native events."""
    body = httpx.get(f"{stack.url}/v1/tasks/{task_id}/events?format=native", timeout=60).text
    for block in sse_blocks(body):
        event = orjson.loads(block["data"])
        if event.get("type") == "task_finished":
            return event["runner_id"]
    raise AssertionError(f"task {task_id} did not finish")


def _turn(stack: Stack, session: str, text: str, how: str) -> str:
    """One chat turn of `session`, named as `how` says; the runner that served it."""
    named = {"header": {"extra_headers": {"X-Session-Id": session}},
             "user": {"user": session}, "prompt_cache_key": {"prompt_cache_key": session}}[how]
    raw = stack.openai.chat.completions.with_raw_response.create(
        model=FAULT, messages=[{"role": "user", "content": text}], **named,  # type: ignore[arg-type]
    )
    return _runner_of(stack, raw.headers["x-fleet-task-id"])


def test_a_sessions_turns_stay_on_its_runner(stack: Stack) -> None:
    # First turns at once, each slow: one slot per runner, so they take both runners.
    first = [("s-a", "header"), ("s-b", "user")]
    with ThreadPoolExecutor(2) as pool:
        homes = dict(zip(["s-a", "s-b"], pool.map(
            lambda asked: _turn(stack, asked[0], "tokens:50 delay_ms:40", asked[1]), first),
            strict=True))
    assert len(set(homes.values())) == 2, homes
    # Later turns one by one, short, the session named each way in turn: with both runners
    # idle and no prompt block to go by, only the session tells them apart (without it both
    # would go to the same runner).
    for how in ("prompt_cache_key", "user", "header"):
        for session, home in homes.items():
            assert _turn(stack, session, "tokens:2", how) == home, (session, how)
