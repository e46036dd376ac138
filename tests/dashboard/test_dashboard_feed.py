"""The dashboard without a browser: the pure pieces (the recent-tasks table, when a snapshot
counts as changed, a watched KV entry folded into a mirror, who sees a task) as table tests,
the routes' key checks in-process, and the feed against a real provisioned nats-server: one
set of watches for any number of tabs, a node joining and leaving, tasks split by tenant, and
1,000 tasks with 50 nodes arriving as a bounded number of coalesced messages."""

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

from fleet.bus.embedded import EmbeddedNats
from fleet.bus.kv_mirror import apply_entry
from fleet.commands.gateway import build_app
from fleet.config import Settings, load_settings
from fleet.dashboard.feed import Feed, Tab
from fleet.dashboard.model import RecentTasks, beats, changed, sees, snapshot
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import encode
from fleet.wire.events import TaskAccepted, TaskFinished, TaskStats, TokenChunk, Usage
from fleet.wire.records import TaskRecord

KEY = "fk-feed-test"


def accepted(task_id: str, at: float = 1.0) -> TaskAccepted:
    return TaskAccepted(task_id=task_id, at=at, model="m", node_id="n1", runner_id="r1")


def token(task_id: str, index: int = 0) -> TokenChunk:
    return TokenChunk(task_id=task_id, at=2.0, index=index, token_id=1, text="a")


def finished(task_id: str, status: str = "completed") -> TaskFinished:
    return TaskFinished(
        task_id=task_id, at=3.0, status=status, finish_reason="stop" if status == "completed"
        else None, usage=Usage(completion_tokens=5),
        stats=TaskStats(time_to_first_token_s=0.1, tokens_per_s=50.0, total_s=0.2),
    )


@pytest.mark.parametrize(("events", "expected"), [
    ([accepted("t")], {"model": "m", "node": "n1", "status": "running", "tokens": 0}),
    ([accepted("t"), token("t"), token("t", 1)], {"tokens": 2, "status": "running"}),
    # A re-sent copy, and a token stored out of order, count once: tokens are counted by index.
    ([accepted("t"), token("t"), token("t", 2), token("t", 1), token("t", 1)], {"tokens": 3}),
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


@pytest.mark.parametrize(("before", "entry", "after", "is_change"), [
    ({}, ("a", None, b"1"), {"a": b"1"}, True),
    ({"a": b"1"}, ("a", None, b"1"), {"a": b"1"}, False),  # the same value again
    ({"a": b"1"}, ("a", None, b"2"), {"a": b"2"}, True),
    ({"a": b"1"}, ("a", "DEL", b""), {}, True),
    ({"a": b"1"}, ("a", "PURGE", b""), {}, True),  # a TTL marker, as nats-py reads it
    ({"a": b"1"}, ("a", None, b""), {}, True),  # an entry without a value is absent
    ({}, ("a", "DEL", b""), {}, False),
])
def test_a_watched_entry_folds_into_the_mirror(before, entry, after, is_change) -> None:
    values = dict(before)
    assert apply_entry(values, *entry) is is_change
    assert values == after


def test_a_bounded_mirror_forgets_its_oldest_key_first() -> None:
    values: dict[str, bytes] = {}
    for key in "abcd":
        apply_entry(values, key, None, b"v", limit=3)
    assert list(values) == ["b", "c", "d"]


@pytest.mark.parametrize(("owner", "tenant", "sees_all", "expected"), [
    ("team-a", "team-a", False, True),
    ("team-b", "team-a", False, False),
    (None, "team-a", False, False),  # no known owner: the operators' alone
    (None, None, False, False),
    ("team-b", "ops", True, True),
    (None, None, True, True),  # an open gateway
])
def test_who_sees_a_task(owner, tenant, sees_all, expected) -> None:
    assert sees(owner, tenant, sees_all) is expected


def test_the_listing_holds_only_what_the_viewer_may_see() -> None:
    table = RecentTasks()
    for task_id, owner in (("t1", "a"), ("t2", "b"), ("t3", None)):
        table.fold(accepted(task_id)).tenant = owner
    assert [r["id"] for r in table.listing("a", sees_all=False)] == ["t1"]
    assert [r["id"] for r in table.listing("ops", sees_all=True)] == ["t3", "t2", "t1"]


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


def test_what_a_heartbeat_changes_goes_in_the_beats() -> None:
    assert beats([node("a", 5.0, 7)]) == {"a": {"at": 5.0, "memory_available_bytes": 7}}


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


async def next_of(tab: Tab, kind: bytes, timeout: float = 10.0) -> dict | list:
    async with asyncio.timeout(timeout):
        while True:
            head, _, data = (await tab.queue.get()).partition(b"\ndata: ")
            if head == b"event: " + kind:
                return orjson.loads(data)


async def next_fleet(tab: Tab, timeout: float = 10.0) -> dict:
    found = await next_of(tab, b"fleet", timeout)
    assert isinstance(found, dict)
    return found


async def test_every_tab_shares_one_reader_and_sees_a_node_join(
    app: Starlette, provisioned_nc: Client
) -> None:
    feed = app.state.dashboard_feed
    tabs = [feed.subscribe() for _ in range(5)]
    first = [await next_fleet(tab) for tab in tabs]
    assert all(f["nodes"] == [] for f in first)
    # three state watches, the owners' watch, the queue sampler, the task follower and the
    # flusher: the same seven for five tabs as for one
    assert sum(not child.done() for child in feed.children) == 7
    kv = await provisioned_nc.jetstream().key_value(subjects.NODES_BUCKET)
    info = NodeInfo(node_id="n-dash", hostname="h", memory_total_bytes=8, memory_available_bytes=4,
                    cpu_count=2, started_at=time.time(), at=time.time())
    await kv.put("n-dash", encode(info))
    for tab in tabs:
        seen = await next_fleet(tab)
        assert [n["node_id"] for n in seen["nodes"]] == ["n-dash"]
    await kv.delete("n-dash")  # a node's TTL marker reads the same to the watch (a purge)
    for tab in tabs:
        assert (await next_fleet(tab))["nodes"] == []
    for tab in tabs:
        feed.unsubscribe(tab)
    assert not feed.tabs


async def test_each_sample_counts_the_tokens_each_node_made(
    app: Starlette, provisioned_nc: Client
) -> None:
    feed: Feed = app.state.dashboard_feed
    tab = feed.subscribe()  # an open tab: the feed follows every task's events
    await asyncio.wait_for(feed.following.wait(), 10)
    for task_id, node in (("t-n1", "n1"), ("t-n2", "n2")):
        event = accepted(task_id).model_copy(update={"node_id": node})
        await provisioned_nc.publish(subjects.out(task_id), encode(event))
    three = TokenChunk(task_id="t-n1", at=2.0, index=0, token_id=1, token_ids=[1, 2, 3],
                       text="abc")
    await provisioned_nc.publish(subjects.out("t-n1"), encode(three))
    await provisioned_nc.publish(subjects.out("t-n2"), encode(token("t-n2")))
    made: dict[str, int] = {}
    total = 0
    async with asyncio.timeout(20):
        while made != {"n1": 3, "n2": 1}:
            sample = await next_of(tab, b"sample")
            assert isinstance(sample, dict)
            total += sample["tokens"]
            for node, count in sample["node_tokens"].items():
                made[node] = made.get(node, 0) + count
    assert total == 4  # tokens, not token events


async def test_a_node_card_that_does_not_decode_is_skipped_and_the_feed_goes_on(
    app: Starlette, provisioned_nc: Client
) -> None:
    feed = app.state.dashboard_feed
    tab = feed.subscribe()
    assert (await next_fleet(tab))["nodes"] == []
    kv = await provisioned_nc.jetstream().key_value(subjects.NODES_BUCKET)
    await kv.put("evil", b'{"type": "node_info", "hostname": "no node_id"}')
    await kv.put("garbage", b"not json")
    info = NodeInfo(node_id="n-real", hostname="h", memory_total_bytes=8,
                    memory_available_bytes=4, cpu_count=2, started_at=time.time(), at=time.time())
    await kv.put("n-real", encode(info))
    while (seen := await next_fleet(tab))["nodes"] == []:
        pass
    assert [n["node_id"] for n in seen["nodes"]] == ["n-real"]
    await kv.delete("n-real")
    assert (await next_fleet(tab))["nodes"] == []  # still flowing after the bad ones
    assert sum(not child.done() for child in feed.children) == 7  # no child died and was restarted


async def own(nc: Client, task_id: str, tenant: str) -> None:
    """The record a gateway writes before it publishes a task (fleet/gateway/owners.py)."""
    record = TaskRecord(tenant=tenant, api="chat.completions", model="tiny-llm", created=0)
    await nc.jetstream().publish(f"$KV.FLEET_TENANTS.task.{task_id}", encode(record),
                                 headers={"Nats-TTL": "3600s"})


async def rows_until(tab: Tab, wanted: set[str], timeout: float = 20.0) -> tuple[set[str], int]:
    """Task ids the tab was sent until it has `wanted`, and how many task_rows messages."""
    seen: set[str] = set()
    messages = 0
    async with asyncio.timeout(timeout):
        while not wanted <= seen:
            rows = await next_of(tab, b"task_rows", timeout)
            messages += 1
            seen |= {row["id"] for row in rows if row["status"] != "running"}
    return seen, messages


async def test_a_tenant_tab_gets_its_own_tasks_and_an_operator_tab_gets_all(
    app: Starlette, provisioned_nc: Client
) -> None:
    feed: Feed = app.state.dashboard_feed
    await feed.owners.ready.wait()
    mine, theirs = feed.subscribe("team-a", sees_all=False), feed.subscribe("ops", sees_all=True)
    for task_id, tenant in (("t-a", "team-a"), ("t-b", "team-b")):
        await own(provisioned_nc, task_id, tenant)
        await provisioned_nc.publish(subjects.out(task_id), encode(accepted(task_id)))
        await provisioned_nc.publish(subjects.out(task_id), encode(finished(task_id)))
    await provisioned_nc.publish(subjects.out("t-x"), encode(finished("t-x")))  # no owner
    seen, _ = await rows_until(theirs, {"t-a", "t-b", "t-x"})
    assert seen == {"t-a", "t-b", "t-x"}
    seen, _ = await rows_until(mine, {"t-a"})
    assert seen == {"t-a"}
    later = feed.subscribe("team-a", sees_all=False)  # a tab opened afterwards
    assert [row["id"] for row in await next_of(later, b"tasks")] == ["t-a"]


async def test_fifty_nodes_and_a_thousand_tasks_arrive_coalesced(
    app: Starlette, provisioned_nc: Client
) -> None:
    feed: Feed = app.state.dashboard_feed
    tab = feed.subscribe()
    await next_fleet(tab)
    kv = await provisioned_nc.jetstream().key_value(subjects.NODES_BUCKET)
    now = time.time()
    for n in range(50):
        info = NodeInfo(node_id=f"n{n:02}", hostname=f"h{n}", memory_total_bytes=8,
                        memory_available_bytes=4, cpu_count=2, started_at=now, at=now)
        await kv.put(info.node_id, encode(info))
    ids = {f"task-{n:04}" for n in range(1000)}
    for task_id in sorted(ids):
        await provisioned_nc.publish(subjects.out(task_id), encode(accepted(task_id)))
        await provisioned_nc.publish(subjects.out(task_id), encode(token(task_id)))
        await provisioned_nc.publish(subjects.out(task_id), encode(finished(task_id)))
    await provisioned_nc.flush()
    seen, messages = await rows_until(tab, ids, timeout=30)
    assert seen == ids
    async with asyncio.timeout(10):
        while len((feed.fleet or {}).get("nodes", [])) < 50:
            await next_fleet(tab)
    # 3,000 events and 50 puts, a few coalesced messages (one per window, each bounded by
    # the table's 1,000 rows), and the tab was never dropped for falling behind
    print(f"task_rows messages for 1,000 tasks: {messages}; sent: {feed.sent}")
    assert messages <= 40 and feed.sent["fleet"] <= 40
    assert tab in feed.tabs
    listing = feed.tasks.listing()
    assert len(listing) == 1000 and len(orjson.dumps(listing)) < 400_000


async def fleet_until(tab: Tab, node_ids: list[str], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while [n["node_id"] for n in (await next_fleet(tab, timeout))["nodes"]] != node_ids:
            pass


async def test_the_watches_start_afresh_after_the_server_restarts(
    app: Starlette, provisioned_nc: Client, nats_server: EmbeddedNats
) -> None:
    feed: Feed = app.state.dashboard_feed
    tab = feed.subscribe()
    kv = await provisioned_nc.jetstream().key_value(subjects.NODES_BUCKET)
    now = time.time()

    def info(node_id: str) -> bytes:
        return encode(NodeInfo(node_id=node_id, hostname="h", memory_total_bytes=8,
                               memory_available_bytes=4, cpu_count=2, started_at=now, at=now))

    await kv.put("n-before", info("n-before"))
    await fleet_until(tab, ["n-before"], 10)
    nats_server.stop()
    await asyncio.to_thread(nats_server.start)  # the same port and store
    async with asyncio.timeout(30):
        while not (provisioned_nc.is_connected and feed.backend.connected):
            await asyncio.sleep(0.1)  # nats-py reconnects on its own timer
    await kv.put("n-after", info("n-after"))
    await kv.delete("n-before")
    await fleet_until(tab, ["n-after"], 30)
