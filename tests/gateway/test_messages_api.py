"""The official `anthropic` client against real processes: nats-server, `fleet worker` running
tiny-llm, and `fleet gateway` with an API key and an alias (claude-* → tiny-llm). One stack
for the whole module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from tests.integration.harness import (
    REPO,
    WorkerProcess,
    client,
    place_and_wait,
    seed_models,
    wait_node,
)

# the anthropic client is imported where used, not at the top: collection imports this
# module in every xdist worker (1.9 s of CPU; issue 28).
if TYPE_CHECKING:
    import anthropic

pytestmark = pytest.mark.process

MODEL = "tiny-llm"
KEY = "sk-fleet-test-key"
LISTENING = re.compile(r"gateway listening on (http://\S+)/v1")
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "how are you?"}]


@dataclass(frozen=True)
class Stack:
    url: str
    claude: anthropic.Anthropic


def start_gateway(nats_url: str, data_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """`fleet gateway --port 0` with one API key; its URL read from its own log line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "--nats-url", nats_url, "--data-dir",
         str(data_dir), "gateway", "--port", "0"],
        cwd=REPO, env={**os.environ, "FLEET_API_KEYS": KEY}, stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True,
    )
    found: list[str] = []
    listening = threading.Event()

    def pump() -> None:
        assert process.stderr
        with (data_dir / "gateway.log").open("a") as log:
            for line in process.stderr:
                log.write(line)
                log.flush()
                if match := LISTENING.search(line):
                    found.append(match.group(1))
                    listening.set()

    threading.Thread(target=pump, daemon=True).start()
    if not listening.wait(60):
        process.kill()
        raise TimeoutError((data_dir / "gateway.log").read_text())
    return process, found[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_llm_dir: Path) -> Iterator[Stack]:
    import anthropic
    root = tmp_path_factory.mktemp("messages")
    gateway_dir = root / "gateway"
    (gateway_dir / "models").mkdir(parents=True)
    (gateway_dir / "models" / "aliases.json").write_text(json.dumps({"claude-*": MODEL}))
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as nats_server:
        worker_dir = root / "worker"
        seed_models(worker_dir, {MODEL: tiny_llm_dir})
        worker = WorkerProcess(nats_server.url, worker_dir).start()
        gateway, url = None, ""
        try:

            async def place_model() -> None:
                nc = await client(nats_server.url)
                await place_and_wait(nc, get_card(MODEL), await wait_node(nc, worker_dir))
                await nc.close()

            asyncio.run(place_model())
            gateway, url = start_gateway(nats_server.url, gateway_dir)
            yield Stack(url, anthropic.Anthropic(base_url=url, api_key=KEY, timeout=120,
                                                 max_retries=0))
        finally:
            if gateway is not None:
                gateway.terminate()
                gateway.wait(20)
            worker.kill()


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_conversation_whole_and_streamed_by_an_alias(stack: Stack) -> None:
    # This SDK no longer names temperature, top_p or top_k: they go as extra body fields.
    asked = {"model": "claude-sonnet-4-5", "max_tokens": 12, "extra_body": {"temperature": 0},
             "system": "You are terse.", "messages": CHAT}
    whole = stack.claude.messages.create(**asked)
    assert whole.model == MODEL  # the alias named it; the reply names the model that answered
    assert whole.role == "assistant" and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0

    with stack.claude.messages.stream(**asked) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text_of(whole) == text_of(final)  # greedy: the same both ways
    assert final.stop_reason == whole.stop_reason
    prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt

    events = [event.type for event in stack.claude.messages.create(**asked, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]  # the SDK drops `ping`
    assert events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in events and "content_block_stop" in events


def test_a_tool_use_round_trip(stack: Stack) -> None:
    asked = {"model": MODEL, "max_tokens": 48, "tools": [WEATHER],
             "tool_choice": {"type": "tool", "name": "get_weather"},
             "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    raw = list(stack.claude.messages.create(**asked, stream=True))
    deltas = [e.delta for e in raw if e.type == "content_block_delta"]
    assert any(delta.type == "input_json_delta" for delta in deltas)
    with stack.claude.messages.stream(**asked) as stream:
        called = stream.get_final_message()
    [call] = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)

    answer = stack.claude.messages.create(
        model=MODEL, max_tokens=8, tools=[WEATHER], messages=[
            *asked["messages"],
            {"role": "assistant", "content": [block.model_dump() for block in called.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
            ]},
        ],
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) > (
        called.usage.input_tokens + (called.usage.cache_read_input_tokens or 0))


def test_count_tokens_is_the_prompt_the_model_sees(stack: Stack) -> None:
    short = stack.claude.messages.count_tokens(model=MODEL, messages=CHAT[:1])
    longer = stack.claude.messages.count_tokens(model=MODEL, messages=CHAT, system="Be terse.")
    assert 0 < short.input_tokens < longer.input_tokens
    made = stack.claude.messages.create(model=MODEL, max_tokens=2, messages=CHAT,
                                        system="Be terse.")
    assert made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == (
        longer.input_tokens)


def test_errors_in_anthropics_shape(stack: Stack) -> None:
    import anthropic
    with pytest.raises(anthropic.NotFoundError) as missing:
        stack.claude.messages.create(model="no-such-model", max_tokens=4, messages=CHAT)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        stack.claude.messages.create(model=MODEL, max_tokens=4, messages=CHAT,
                                     extra_body={"temperature": 1.5})
    body = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "temperature" in body["error"]["message"]  # type: ignore[index]
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": "iVBORw0KGgo="}}
    question = {"role": "user", "content": [picture, {"type": "text", "text": "What is it?"}]}
    with pytest.raises(anthropic.BadRequestError) as image:
        stack.claude.messages.create(model=MODEL, max_tokens=4, messages=[question])
    assert "vision" in image.value.message
    stranger = anthropic.Anthropic(base_url=stack.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        stranger.messages.create(model=MODEL, max_tokens=4, messages=CHAT)
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_keys_as_x_api_key_or_bearer_and_aliases_listed(stack: Stack) -> None:
    import anthropic
    bearer = anthropic.Anthropic(base_url=stack.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=CHAT).content
    models = httpx.get(f"{stack.url}/v1/models", headers={"x-api-key": KEY}).json()["data"]
    assert "claude-*" in next(m for m in models if m["id"] == MODEL)["aliases"]
