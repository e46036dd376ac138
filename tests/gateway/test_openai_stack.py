"""The official `openai` client against real processes: nats-server, `fleet worker` running
SmolLM2-135M and tiny-flux2 in runner subprocesses, and `fleet gateway`. One stack for the
whole module."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import orjson
import pytest
from gateway_helpers import sse_blocks
from PIL import Image

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from tests.gateway_process import GatewayProcess
from tests.integration.harness import (
    WorkerProcess,
    client,
    place_and_wait,
    seed_models,
    wait_node,
)

# the openai client is imported where used, not at the top: collection imports this module
# in every xdist worker (0.7 s of CPU; issue 28).
if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
IMAGE_MODEL = "tiny-flux2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Stack:
    url: str
    openai: openai.OpenAI


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, tiny_flux2_dir: Path
) -> Iterator[Stack]:
    import openai
    root = tmp_path_factory.mktemp("stack")
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as nats_server:
        worker_dir = root / "worker"
        seed_models(worker_dir, {MODEL: smollm2_dir, IMAGE_MODEL: tiny_flux2_dir})
        worker = WorkerProcess(nats_server.url, worker_dir).start()
        gateway = GatewayProcess(nats_server.url, root)
        try:

            async def place_models() -> None:
                nc = await client(nats_server.url)
                node = await wait_node(nc, worker_dir)
                await place_and_wait(nc, get_card(MODEL), node)
                await place_and_wait(nc, get_card(IMAGE_MODEL), node)
                await nc.close()

            asyncio.run(place_models())
            url = gateway.wait_listening()
            yield Stack(url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120))
        finally:
            gateway.stop()
            worker.kill()  # its graceful stop is the worker's own tests' business


def task_events(stack: Stack, task_id: str, after: int = 0) -> list[dict]:
    """A task's raw Fleet events after the first `after`, read until its terminal event."""
    response = httpx.get(f"{stack.url}/v1/tasks/{task_id}/events?after={after}&format=native",
                         timeout=120)
    assert response.status_code == 200
    return [orjson.loads(block["data"]) for block in sse_blocks(response.text)]


def task_seeds(stack: Stack, request_id: str) -> list[int | None]:
    """The seed each choice's task was accepted with (choice i: task `<request id>-i`)."""
    return [next(e["seed"] for e in task_events(stack, f"{request_id}-{index}")
                 if e["type"] == "task_accepted") for index in range(3)]


def task_text(stack: Stack, task_id: str) -> str:
    return "".join(e.get("text", "") for e in task_events(stack, task_id) if e["type"] == "token")


def test_chat_answers_paris_whole_and_streamed(stack: Stack) -> None:
    whole = stack.openai.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in (whole.choices[0].message.content or "")
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage and whole.usage.completion_tokens > 0

    chunks = list(
        stack.openai.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer both ways
    assert chunks[-1].usage and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # The same prompt again: the runner's prefix cache saved prefill, and usage says how much.
    details = chunks[-1].usage.prompt_tokens_details
    assert details and 0 < (details.cached_tokens or 0) <= whole.usage.prompt_tokens


def test_completions_models_and_errors(stack: Stack) -> None:
    import openai
    completion = stack.openai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text.strip()

    models = {model.id: model for model in stack.openai.models.list()}
    assert models[MODEL].model_extra and models[MODEL].model_extra["ready"] is True
    assert stack.openai.models.retrieve(MODEL).id == MODEL

    with pytest.raises(openai.NotFoundError):
        stack.openai.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as bad:
        stack.openai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)
    assert bad.value.body and bad.value.body["param"] == "temperature"  # type: ignore[index]


def test_a_dropped_stream_resumes_without_losing_a_token(stack: Stack) -> None:
    request = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
    reference = stack.openai.chat.completions.create(**request).choices[0].message.content

    seen_text, last_id, task_id = "", 0, ""
    with stack.openai.chat.completions.with_streaming_response.create(
        **request, stream=True, extra_body={"resumable": True}
    ) as response:
        for block in sse_blocks_of(response.iter_lines()):
            chunk = orjson.loads(block["data"])
            task_id = chunk["id"]
            seen_text += chunk["choices"][0]["delta"].get("content", "")
            last_id = int(block.get("id", last_id))
            if last_id >= 4:
                break  # the connection drops here, mid-answer

    rest = task_events(stack, task_id, after=last_id)
    assert rest[-1]["type"] == "task_finished" and rest[-1]["status"] == "completed"
    resumed = "".join(event["text"] for event in rest if event["type"] == "token")
    assert seen_text + resumed == reference
    # By default the resume speaks the request's own format: chat.completion.chunk.
    as_chat = httpx.get(f"{stack.url}/v1/tasks/{task_id}/events?after={last_id}", timeout=120)
    chunks = [orjson.loads(b["data"]) for b in sse_blocks(as_chat.text) if b["data"] != "[DONE]"]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert seen_text + "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == (
        reference)


def sse_blocks_of(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    fields: dict[str, str] = {}
    for line in lines:
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
        elif fields:
            yield fields
            fields = {}


def test_a_client_that_disconnects_cancels_its_task(stack: Stack) -> None:
    stream = stack.openai.chat.completions.create(
        model=MODEL,
        stream=True,
        temperature=0,
        max_tokens=400,
        messages=[{"role": "user", "content": "Count from 1 to 300, one number per line."}],
    )
    task_id = ""
    for index, chunk in enumerate(stream):
        task_id = chunk.id
        if index == 3:
            break
    stream.close()

    events = task_events(stack, task_id)
    assert events[-1]["type"] == "task_finished"
    assert events[-1]["status"] == "cancelled"
    assert sum(event["type"] == "token" for event in events) < 400


def test_images_generate_stream_and_edit(stack: Stack) -> None:
    # seed and steps are Fleet's: the SDK sends them through extra_body.
    fleet = {"seed": 7, "steps": 4}
    ask = {"model": IMAGE_MODEL, "prompt": "a lighthouse", "size": "128x128", "extra_body": fleet}
    as_b64 = stack.openai.images.generate(**ask, response_format="b64_json")
    png = base64.b64decode(as_b64.data[0].b64_json or "")
    assert Image.open(io.BytesIO(png)).size == (128, 128)

    as_url = stack.openai.images.generate(**ask, response_format="url")
    assert httpx.get(as_url.data[0].url or "").content == png  # same seed, same bytes

    events = list(stack.openai.images.generate(**ask, stream=True, partial_images=2))
    assert [event.type for event in events] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert base64.b64decode(events[-1].b64_json) == png

    edited = stack.openai.images.edit(
        model=IMAGE_MODEL, image=("in.png", png, "image/png"), prompt="at night", size="128x128"
    )
    assert Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json or ""))).size == (
        128,
        128,
    )


def test_a_json_schema_answer_parses_and_still_says_paris(stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 24}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    reply = stack.openai.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": schema, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" in json.loads(reply.choices[0].message.content or "")["capital"]


def test_n_choices_whole_and_streamed(stack: Stack) -> None:
    import openai
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 1.0,
               "seed": 11, "n": 3}
    whole = stack.openai.chat.completions.create(**request)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    texts = [choice.message.content or "" for choice in whole.choices]
    assert len(set(texts)) > 1  # seeds 11, 12, 13: the choices differ
    finished = [task_events(stack, f"{whole.id}-{index}")[-1] for index in range(3)]
    assert [event["type"] for event in finished] == ["task_finished"] * 3  # a task per choice
    assert whole.usage and whole.usage.completion_tokens == sum(
        event["usage"]["completion_tokens"] for event in finished
    )
    assert whole.usage.prompt_tokens == finished[0]["usage"]["prompt_tokens"]  # counted once
    assert texts == [task_text(stack, f"{whole.id}-{index}") for index in range(3)]

    chunks = list(stack.openai.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True},
    ))
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    # The same seeds as the whole request's choices. Not necessarily the same text: sampled
    # tokens are equal only for the same batch shapes (float sums differ by shape, and
    # temperature 1.0 follows them), and which choices share a batch step depends on when
    # each reaches the runner. What is guaranteed: each choice streams its own task's tokens.
    assert task_seeds(stack, chunks[0].id) == task_seeds(stack, whole.id) == [11, 12, 13]
    assert streamed == [task_text(stack, f"{chunks[0].id}-{index}") for index in range(3)]
    streamed_usage = sum(
        task_events(stack, f"{chunks[0].id}-{index}")[-1]["usage"]["completion_tokens"]
        for index in range(3)
    )
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == streamed_usage
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]

    with pytest.raises(openai.BadRequestError) as bad:  # the runner refuses both choices
        stack.openai.chat.completions.create(**request, logit_bias={"999999": 5})
    assert "vocabulary" in str(bad.value)


def test_responses_api_whole_and_streamed(stack: Stack) -> None:
    import openai
    ask = {"model": MODEL, "input": "What is the capital of France?", "temperature": 0,
           "max_output_tokens": 24, "instructions": "Answer in one short sentence."}
    whole = stack.openai.responses.create(**ask)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert "Paris" in whole.output_text
    assert whole.usage and whole.usage.output_tokens > 0

    events = list(stack.openai.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text  # greedy: the same answer both ways
    assert events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]

    # A message list: the same question as an input item with a text part.
    listed = stack.openai.responses.create(
        model=MODEL, temperature=0, max_output_tokens=24,
        instructions="Answer in one short sentence.",
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is the capital of France?"}]}],
    )
    assert listed.output_text == whole.output_text

    with pytest.raises(openai.BadRequestError) as bad:
        stack.openai.responses.create(model=MODEL, input="hi", previous_response_id="resp-x")
    assert bad.value.body and bad.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_completions_with_a_prompt_list_and_echo(stack: Stack) -> None:
    prompts = ["The capital of France is", "The capital of Italy is"]
    ask = {"model": MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 0, "echo": True}
    listed = stack.openai.completions.create(**ask)
    assert [choice.index for choice in listed.choices] == [0, 1]
    alone = [stack.openai.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
             for p in prompts]
    # one choice per prompt, each the prompt itself followed by what it alone gets (greedy)
    assert [c.text for c in listed.choices] == [
        p + a.choices[0].text for p, a in zip(prompts, alone, strict=True)]
    assert listed.usage and listed.usage.prompt_tokens == sum(
        a.usage.prompt_tokens for a in alone if a.usage)

    streamed = ["", ""]
    for chunk in stack.openai.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in listed.choices]
