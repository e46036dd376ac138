"""The dashboard without a browser: the pure pieces (the recent-tasks table, when a snapshot
counts as changed) as table tests, the routes' key checks in-process, and the feed against a
real provisioned nats-server: one reader for any number of tabs, a node in FLEET_NODES seen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import orjson
import pytest
from nats.aio.client import Client
from starlette.applications import Starlette

from fleet.config import Settings, load_settings
from fleet.dashboard.model import RecentTasks, changed, snapshot
from fleet.gateway.app import build_app
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import encode
from fleet.wire.events import TaskAccepted, TaskFinished, TaskStats, TokenChunk, Usage

KEY = "fk-feed-test"


def accepted(task_id: str, at: float = 1.0) -> TaskAccepted:
    return TaskAccepted(task_id=task_id, at=at, model="m", node_id="n1", runner_id="r1")


def token(task_id: str) -> TokenChunk:
    return TokenChunk(task_id=task_id, at=2.0, index=0, token_id=1, text="a")


def finished(task_id: str, status: str = "completed") -> TaskFinished:
    return TaskFinished(
        task_id=task_id, at=3.0, status=status, finish_reason="stop" if status == "completed"
        else None, usage=Usage(completion_tokens=5),
        stats=TaskStats(time_to_first_token_s=0.1, tokens_per_s=50.0, total_s=0.2),
    )


@pytest.mark.parametrize(("events", "expected"), [
    ([accepted("t")], {"model": "m", "node": "n1", "status": "running", "tokens": 0}),
    ([accepted("t"), token("t"), token("t")], {"tokens": 2, "status": "running"}),
    ([accepted("t"), token("t"), finished("t")],
     {"status": "completed", "reason": "stop", "tokens": 5, "ttft_s": 0.1, "duration_s": 0.2}),
    ([accepted("t"), finished("t", "cancelled")], {"status": "cancelled", "reason": None}),
    ([token("t")], {"model": "", "tokens": 1}),  # joined mid-task: still listed
])
def test_a_tasks_events_fold_into_its_row(events: list, expected: dict) -> None:
    table = RecentTasks()
    for event in events:
        row = table.fold(event)
    assert {k: getattr(row, k) for k in expected} == expected


def test_the_recent_tasks_table_keeps_the_newest_and_lists_them_first() -> None:
    table = RecentTasks(limit=3)
    for n in range(5):
        table.fold(accepted(f"t{n}", at=n))
    assert [row["id"] for row in table.listing()] == ["t4", "t3", "t2"]


def node(node_id: str, at: float, available: int = 1) -> dict:
    return {"node_id": node_id, "at": at, "memory_available_bytes": available}


@pytest.mark.parametrize(("before", "after", "expected"), [
    (None, snapshot([], [], [], {}, 0), True),
    (snapshot([node("a", 1)], [], [], {}, 5), snapshot([node("a", 2, 7)], [], [], {}, 6), False),
    (snapshot([node("a", 1)], [], [], {}, 5), snapshot([], [], [], {}, 6), True),
    (snapshot([], [], [], {"m": {"queued": 0}}, 5), snapshot([], [], [], {"m": {"queued": 1}}, 5),
     True),
])
def test_only_what_the_page_draws_differently_is_a_change(before, after, expected) -> None:
    assert changed(before, after) is expected


@pytest.fixture
def settings(tmp_path: Path, nats_url: str) -> Settings:
    return replace(load_settings({"nats_url": nats_url, "data_dir": tmp_path / "data"}, env={}),
                   api_keys=(KEY,))


@pytest.fixture
async def app(settings: Settings, provisioned_nc: Client) -> AsyncIterator[Starlette]:
    application = build_app(settings)
    async with application.router.lifespan_context(application):
        yield application


async def test_the_page_is_open_and_its_api_needs_the_key(app: Starlette) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        page = await http.get("/ui")
        assert page.status_code == 200 and "API key" in page.text
        assert (await http.get("/ui/static/app.js")).status_code == 200
        assert (await http.get("/ui/api/whoami")).status_code == 401
        assert (await http.get("/ui/api/feed")).status_code == 401
        good = await http.get("/ui/api/whoami", headers={"Authorization": f"Bearer {KEY}"})
        assert good.status_code == 200 and good.json()["tenant"].startswith("key-")
        assert (await http.get("/v1/models")).status_code == 401  # the API is unchanged


async def next_fleet(queue: asyncio.Queue[bytes], timeout: float = 10.0) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            head, _, data = (await queue.get()).partition(b"\ndata: ")
            if head == b"event: fleet":
                return orjson.loads(data)


async def test_every_tab_shares_one_reader_and_sees_a_node_join(
    app: Starlette, provisioned_nc: Client
) -> None:
    feed = app.state.dashboard_feed
    tabs = [feed.subscribe() for _ in range(5)]
    first = [await next_fleet(tab) for tab in tabs]
    assert all(f["nodes"] == [] for f in first)
    assert feed._supervisor.children == 2  # the fleet reader and the task follower, not 5x
    kv = await provisioned_nc.jetstream().key_value(subjects.NODES_BUCKET)
    info = NodeInfo(node_id="n-dash", hostname="h", memory_total_bytes=8, memory_available_bytes=4,
                    cpu_count=2, started_at=time.time(), at=time.time())
    await kv.put("n-dash", encode(info))
    for tab in tabs:
        seen = await next_fleet(tab)
        assert [n["node_id"] for n in seen["nodes"]] == ["n-dash"]
    for tab in tabs:
        feed.unsubscribe(tab)
    assert not feed.subscribers
