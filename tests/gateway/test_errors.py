"""Every refusal in OpenAI's error shape with the right status, against a real nats-server."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
from gateway_helpers import vision_card
from nats.aio.client import Client
from starlette.applications import Starlette

from fleet.config import Settings
from fleet.gateway.app import build_app
from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.tasks import CancelTask

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}
PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
        ("/v1/images/generations", {"model": "no-such-model", "prompt": "x"}),
    ],
)
async def test_unknown_model_is_404(client: httpx.AsyncClient, path: str, body: dict) -> None:
    assert_error(await client.post(path, json=body), 404, "model_not_found")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "temperature": 3}, "temperature"),
        ({**CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({**CHAT, "n": 9}, "n"),
        ({**CHAT, "n": 2, "stream": True, "resumable": True}, "n"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "stop": ["a"] * 9}, "stop"),
        ({**CHAT, "logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"messages": CHAT["messages"]}, "model"),
        ({**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
        ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            {**CHAT, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            }},
            "response_format",
        ),
    ],
)
async def test_bad_chat_bodies_are_400_naming_the_param(
    client: httpx.AsyncClient, body: dict, param: str
) -> None:
    error = assert_error(await client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content", [b"{not json", b"[1, 2]", b"", '"\u00e9"'.encode(), b"\xff\xfe"]
)
async def test_broken_json_is_400(client: httpx.AsyncClient, content: bytes) -> None:
    response = await client.post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert_error(response, 400)


def image_message(url: str) -> list[dict]:
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return [{"role": "user", "content": parts}]


async def test_an_image_for_a_text_only_model_is_400_saying_so(client: httpx.AsyncClient) -> None:
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    body = {**CHAT, "messages": image_message(url)}
    error = assert_error(await client.post("/v1/chat/completions", json=body), 400)
    assert "text-only" in error["message"]


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "data:image/png;base64,@@@",
        "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
    ],
)
async def test_unusable_image_urls_are_400(
    client: httpx.AsyncClient, settings: Settings, url: str
) -> None:
    vision_card(settings.data_dir)
    body = {**CHAT, "model": "tiny-vlm", "messages": image_message(url)}
    assert_error(await client.post("/v1/chat/completions", json=body), 400)


async def test_a_model_asked_for_the_wrong_kind_of_task_is_400(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny-llm", "prompt": "a red fox"}
    error = assert_error(await client.post("/v1/images/generations", json=body), 400)
    assert "text to image" in error["message"]


async def test_a_body_over_the_cap_is_413(client: httpx.AsyncClient, settings: Settings) -> None:
    huge = {
        **CHAT,
        "messages": [{"role": "user", "content": "x" * settings.gateway_max_body_bytes}],
    }
    assert_error(await client.post("/v1/chat/completions", json=huge), 413, "payload_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(settings.gateway_max_body_bytes // 1024 + 2):
            yield b" " * 1024

    response = await client.post("/v1/chat/completions", content=chunked())
    assert_error(response, 413, "payload_too_large")


async def test_unknown_routes_and_methods_are_openai_errors(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing-here"), 404, "not_found")
    assert_error(await client.get("/v1/chat/completions"), 405, "method_not_allowed")
    assert_error(await client.get("/v1/images/not-a-hash"), 404, "not_found")
    assert_error(await client.get("/v1/images/edits"), 405, "method_not_allowed")
    assert_error(await client.get("/v1/images/" + "0" * 64), 404, "not_found")
    assert_error(await client.get("/v1/tasks/a.b/events"), 400)
    assert_error(await client.get("/v1/tasks/abc/events?after=x"), 400)


async def test_a_deadline_is_504_and_cancels_the_task(
    client: httpx.AsyncClient, nc: Client
) -> None:
    cancels = await nc.subscribe(subjects.cancel("*"))
    response = await client.post("/v1/chat/completions", json={**CHAT, "timeout": 0.3})
    assert_error(response, 504, "deadline")
    message = await cancels.next_msg(timeout=5)
    cancel = decode_model(CancelTask, message.data)
    assert response.headers["x-fleet-task-id"] == cancel.task_id
    kv = await nc.jetstream().key_value(subjects.CANCELS_BUCKET)
    assert (await kv.get(cancel.task_id)).value


async def test_no_nats_is_503(settings: Settings, unused_tcp_port: int) -> None:
    app: Starlette = build_app(replace(settings, nats_url=f"nats://127.0.0.1:{unused_tcp_port}"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            assert_error(await client.post("/v1/chat/completions", json=CHAT), 503)
            assert (await client.get("/healthz")).status_code == 503
            models = (await client.get("/v1/models")).json()["data"]
            assert {m["ready"] for m in models} == {None}  # unknown, not "no"


async def test_api_keys_guard_v1_but_not_the_probes(settings: Settings, nc: Client) -> None:
    app: Starlette = build_app(replace(settings, api_keys=("sk-right",)))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            assert_error(await client.get("/v1/models"), 401, "invalid_api_key")
            wrong = {"authorization": "Bearer sk-wrong"}
            assert_error(await client.get("/v1/models", headers=wrong), 401)
            right = {"authorization": "Bearer sk-right"}
            assert (await client.get("/v1/models", headers=right)).status_code == 200
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
