"""Tenants at the gateway: each API key reads, resumes and cancels only its own tasks and
images; another tenant's id answers 404, like an id that does not exist. Real nats-server,
the app in-process, a stand-in worker for the scripted events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from gateway_helpers import StandInWorker, tokens_script, vision_card
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from starlette.applications import Starlette
from test_images_api import image_script, png, stored

from fleet.bus.embedded import EmbeddedNats
from fleet.config import Settings
from fleet.errors import AtCapacity, InvalidRequest
from fleet.gateway.app import build_app
from fleet.gateway.capacity import Capacity, refusal
from fleet.gateway.keys import KeyRing, add_key, key_hash, parse_keys_file, plain_key_tenant
from fleet.gateway.owners import STREAM, Owners
from fleet.wire import subjects
from fleet.wire.records import TaskRecord
from tests.prometheus_text import Scrape

OUTAGE_S = 7.0

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("# a comment\n\n", {}),
        ('{"tenant": "a", "sha256": "' + "A" * 64 + '"}', {"a" * 64: "a"}),
        ('{"tenant": "a", "sha256": "' + "0" * 64 + '"}\n{"tenant": "b", "sha256": "'
         + "1" * 64 + '"}', {"0" * 64: "a", "1" * 64: "b"}),
    ],
)
def test_keys_file_lines(text: str, expected: dict[str, str]) -> None:
    assert parse_keys_file(text) == expected


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"tenant": "a"}',
        '{"tenant": "a b", "sha256": "' + "0" * 64 + '"}',
        '{"tenant": "a", "sha256": "abc"}',
        '["a", "b"]',
        '{"tenant": "a", "sha256": "' + "0" * 64 + '", "operator": "yes"}',
        '{"tenant": "h", "sha256": "' + "1" * 64 + '", "operator": false}',  # h: operator on 1
    ],
)
def test_a_bad_keys_file_line_is_an_error_naming_it(line: str) -> None:
    with pytest.raises(InvalidRequest, match=r"keys file:2:"):
        parse_keys_file('{"tenant": "h", "sha256": "' + "f" * 64 + '", "operator": true}\n'
                        + line)


def test_operators_are_named_in_the_keys_file_and_an_open_gateway_trusts_everyone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.jsonl"
    ops, team = add_key(path, "ops", operator=True), add_key(path, "team-a")
    ring = KeyRing.load(("sk-plain",), str(path))
    assert ring.tenant_of(ops.encode()) == "ops" and ring.is_operator("ops")
    assert not ring.is_operator(ring.tenant_of(team.encode()))
    assert not ring.is_operator(ring.tenant_of(b"sk-plain"))  # a plain key is a tenant only
    assert not ring.is_operator(None)
    assert KeyRing.load(()).is_operator(None)


def test_plain_keys_are_tenants_of_their_own_named_by_hash(tmp_path: Path) -> None:
    ring = KeyRing.load(("sk-one", "sk-two"))
    assert ring.tenant_of(b"sk-one") == plain_key_tenant("sk-one") != ring.tenant_of(b"sk-two")
    assert "sk-one" not in plain_key_tenant("sk-one")
    assert ring.tenant_of(b"sk-three") is None and ring.tenant_of(b"") is None
    assert KeyRing.load(()).open


def test_keys_add_appends_a_hash_and_never_the_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    key = add_key(path, "team-a")
    assert key not in path.read_text() and key_hash(key) in path.read_text()
    assert KeyRing.load((), str(path)).tenant_of(key.encode()) == "team-a"
    assert path.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("waiting", "mine", "refused"),
    [(0, 0, False), (9, 1, False), (9, 2, True), (10, 0, True), (10, 2, True)],
)
def test_capacity_refusals(waiting: int, mine: int, refused: bool) -> None:
    assert (refusal(waiting, mine, max_waiting=10, per_key=2) is not None) == refused


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "keys.jsonl"
    return {"file": str(path), "a": add_key(path, "team-a"), "b": add_key(path, "team-b")}


@pytest.fixture
async def tenant_app(
    settings: Settings, nc: Client, keys: dict[str, str]
) -> AsyncIterator[Starlette]:
    app = build_app(replace(settings, api_keys_file=keys["file"], gateway_events_idle_s=2.0))
    async with app.router.lifespan_context(app):
        yield app


def as_key(app: Starlette, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway",
        headers={"authorization": f"Bearer {key}"},
    )


async def test_another_tenant_cannot_read_resume_or_cancel_a_task(
    tenant_app: Starlette, keys: dict[str, str], worker: StandInWorker, nc: Client
) -> None:
    async with as_key(tenant_app, keys["a"]) as a, as_key(tenant_app, keys["b"]) as b:
        response, task = await asyncio.gather(
            a.post("/v1/chat/completions", json=CHAT), worker.answer(tokens_script("x", "y"))
        )
        assert response.status_code == 200, response.text
        task_id = task.task_id
        owned = await a.get(f"/v1/tasks/{task_id}/events?format=native")
        assert owned.status_code == 200 and "task_finished" in owned.text

        for attempt in (
            b.get(f"/v1/tasks/{task_id}/events"),
            b.get(f"/v1/tasks/{task_id}/events?after=1"),
            b.post(f"/v1/tasks/{task_id}/cancel"),
        ):
            refused = await attempt
            assert refused.status_code == 404, refused.text
            # the same answer as for an id nobody ever used: nothing confirms it exists
            assert task_id in refused.json()["error"]["message"]
        unknown = await b.get("/v1/tasks/no-such-task/events")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"].replace("no-such-task", task_id) == (
            refused.json()["error"]["message"]
        )
        # B's cancel did nothing: no cancel record exists for A's task
        kv = await nc.jetstream().key_value(subjects.CANCELS_BUCKET)
        with pytest.raises(KeyNotFoundError):
            await kv.get(task_id)
        assert (await a.post(f"/v1/tasks/{task_id}/cancel")).status_code == 200
    # the owner record lives in its own bucket, written by the gateway
    info = await nc.jetstream().stream_info(STREAM)
    assert info.state.messages >= 1


async def test_images_answer_only_the_tenant_that_made_or_sent_them(
    tenant_app: Starlette, keys: dict[str, str], nc: Client, settings: Settings
) -> None:
    image_worker = StandInWorker(nc, "tiny-flux2")
    made = png("green")
    [sha] = await stored(nc, made)
    async with as_key(tenant_app, keys["a"]) as a, as_key(tenant_app, keys["b"]) as b:
        assert (await b.get(f"/v1/images/{sha}")).status_code == 404  # nobody's yet
        body = {"model": "tiny-flux2", "prompt": "green", "size": "128x128",
                "response_format": "url"}
        response, _ = await asyncio.gather(
            a.post("/v1/images/generations", json=body), image_worker.answer(image_script(sha, []))
        )
        assert response.status_code == 200, response.text
        served = await a.get(f"/v1/images/{sha}")
        assert served.status_code == 200 and served.content == made
        # a shared proxy must not serve A's image to B from its cache
        assert served.headers["cache-control"].startswith("private")
        refused = await b.get(f"/v1/images/{sha}")
        assert refused.status_code == 404 and refused.content != made
        # nor can B use it as an input by naming its URL
        vision_card(settings.data_dir)
        chat = {"model": "tiny-vlm", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"http://gateway/v1/images/{sha}"}}]}]}
        used = await b.post("/v1/chat/completions", json=chat)
        assert used.status_code == 400 and "not stored" in used.text


async def test_health_without_a_key_says_only_up_and_never_the_password(
    settings: Settings, nc: Client, nats_url: str, keys: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret_url = nats_url.replace("nats://", "nats://fleet:s3cr3t-pw@")
    app = build_app(replace(settings, nats_url=secret_url, api_keys_file=keys["file"]))
    caplog.set_level("DEBUG")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as anyone:
            health = await anyone.get("/healthz")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            bad = await anyone.get("/healthz", headers={"authorization": "Bearer wrong"})
            assert bad.json() == {"status": "ok"}
            assert (await anyone.get("/metrics")).status_code == 200  # open unless protected
        async with as_key(app, keys["a"]) as a:
            detailed = (await a.get("/healthz")).json()
            assert detailed["status"] == "ok" and detailed["streams"]["FLEET_OUT"]
            assert detailed["nats"]["url"].startswith("nats://fleet:***@")
            everything = [health.text, detailed.__repr__(), (await a.get("/metrics")).text]
    assert "s3cr3t-pw" not in "".join(everything)
    assert "s3cr3t-pw" not in caplog.text


async def test_metrics_can_need_a_key(
    settings: Settings, nc: Client, keys: dict[str, str]
) -> None:
    app = build_app(replace(settings, api_keys_file=keys["file"], gateway_protect_metrics=True))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as anyone:
            assert (await anyone.get("/metrics")).status_code == 401
        async with as_key(app, keys["b"]) as b:
            scraped = await b.get("/metrics")
            assert scraped.status_code == 200
            assert Scrape.of(scraped.text).value("fleet_gateway_waiting_requests") == 0
            assert "team-" not in scraped.text  # no tenant named to whoever scrapes


def test_capacity_counts_per_tenant_and_in_all() -> None:
    capacity = Capacity(max_waiting=3, per_key=2)
    a1, a2 = capacity.take("a"), capacity.take("a")
    with pytest.raises(AtCapacity) as refused:
        capacity.take("a")
    assert refused.value.http_status == 429 and refused.value.retry_after_s == 1
    capacity.take("b")
    with pytest.raises(AtCapacity):
        capacity.take(None)  # the limit in all
    capacity.give_back(a1)
    capacity.give_back(a2)
    assert capacity.waiting == 1 and capacity.take(None) == ""


async def test_a_task_record_written_during_a_broker_outage_waits_for_it_like_other_calls(
    provisioned_nc: Client, nats_server: EmbeddedNats
) -> None:
    """Longer than the 5 s the owner's write once had: a KV leader election takes 4-8 s."""
    owners = Owners(lambda: provisioned_nc)
    record = TaskRecord(tenant="team-a", api="chat.completions", model="tiny-llm", created=0)
    nats_server.stop()
    writing = asyncio.create_task(owners.record_task("t-outage", record))
    done, _ = await asyncio.wait({writing}, timeout=OUTAGE_S)  # the outage lasts this long
    assert not done, "the write gave up (or ended) while the broker was away"
    await asyncio.to_thread(nats_server.start)  # the same port and store
    await asyncio.wait_for(writing, 30)
    assert (await owners.task_record("t-outage")) == record
