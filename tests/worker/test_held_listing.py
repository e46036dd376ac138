"""A taken message is listed in a stored heartbeat before its task's work starts
(fleet.worker.heartbeat, `list_held`; issue 24), against a real nats-server: the window in
which a worker's death leaves its just-taken task to AckWait is the time from the message's
arrival to that stored beat, measured here; a burst of takes shares a few beats."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.kv_calls import open_bucket
from fleet.bus.pipelined import Sent
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo, RunnerRecord
from fleet.wire.codec import decode_model
from fleet.wire.runners import RunnerRunning
from fleet.worker import heartbeat
from fleet.worker.heartbeat import (
    HEARTBEAT_S,
    LIST_GAP_S,
    LIST_WAIT_S,
    Heartbeat,
    asks,
    listing,
    listing_wait,
    rebuilds,
    stored,
)

TAKES = 100
BURST = 32


def _info() -> NodeInfo:
    return NodeInfo(node_id="n1", hostname="h", memory_total_bytes=1, memory_available_bytes=1,
                    cpu_count=1, started_at=0.0, at=0.0)


async def _listed(nc: Client) -> list[str]:
    kv = await open_bucket(nc.jetstream(), subjects.NODES_BUCKET)
    return decode_model(NodeInfo, (await kv.get("n1")).value or b"").held_acks


async def _revision(nc: Client) -> int:
    kv = await open_bucket(nc.jetstream(), subjects.NODES_BUCKET)
    return (await kv.get("n1")).revision or 0


async def _beating_for(nc: Client, held: list[str],
                       info: Callable[[], NodeInfo] = _info) -> Heartbeat:
    """A node "n1"'s heartbeat listing what `held` holds, its first beat stored."""
    js = nc.jetstream()
    beat = Heartbeat(nc, await open_bucket(js, subjects.NODES_BUCKET),
                     await open_bucket(js, subjects.RUNNERS_BUCKET), "n1", info, list)
    beat.held = lambda: list(held)
    await beat.beat()
    return beat


async def test_a_taken_message_is_in_a_stored_beat_before_its_work_starts(
    provisioned_nc: Client,
) -> None:
    nc, js = provisioned_nc, provisioned_nc.jetstream()
    await js.add_stream(name="HELD", subjects=["held.>"])
    pull = await js.pull_subscribe("held.x", durable="takers")
    held: list[str] = []
    beat = await _beating_for(nc, held)
    beating = asyncio.ensure_future(beat.forever())
    try:
        windows: dict[str, list[float]] = {"back to back": [], "20 ms apart": []}
        for kind, pause_s in (("back to back", 0.0), ("20 ms apart", 0.02)):
            for n in range(TAKES):  # one at a time, as an idle worker takes them
                await asyncio.sleep(pause_s)  # pacing the takes (a load's shape), not a wait
                await js.publish("held.x", f"{n}".encode())
                [msg] = await pull.fetch(1, timeout=5)
                taken = time.monotonic()
                held.append(msg.reply)  # AckPolicy.hold, in the worker's loop
                waited = await beat.list_held(msg.reply)
                assert waited is not None, "not listed within LIST_WAIT_S"
                windows[kind].append(time.monotonic() - taken)
                assert msg.reply in await _listed(nc)  # what the sweeper reads: stored
                held.remove(msg.reply)
                await msg.ack()
        for kind, found in windows.items():
            found.sort()
            print(f"\ntaken -> listed in a stored beat, {kind}: p50 "
                  f"{statistics.median(found) * 1000:.2f} ms, p99 "
                  f"{found[int(0.99 * len(found))] * 1000:.2f} ms, max {found[-1] * 1000:.2f} ms "
                  f"({TAKES} takes)")
            assert found[int(0.99 * len(found))] < LIST_WAIT_S

        for n in range(BURST):
            await js.publish("held.x", f"burst {n}".encode())
        before = await _revision(nc)
        msgs: list[Msg] = await pull.fetch(BURST, timeout=5)
        held.extend(m.reply for m in msgs)
        waits = await asyncio.gather(*(beat.list_held(m.reply) for m in msgs))
        beats = await _revision(nc) - before
        print(f"a burst of {len(msgs)} takes: listed by {beats} beat(s), "
              f"the last in {max(w or 0 for w in waits) * 1000:.2f} ms")
        assert all(w is not None for w in waits)
        assert set(held) <= set(await _listed(nc))
        assert beats <= 3, "a burst costs a few puts, not one a message"
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def test_a_listing_asked_before_the_intake_is_found_after_it(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker asks for the beat (`ask_to_list`) as its intake starts and awaits
    `list_held` after it: by then the asked beat has listed the message. The periodic full
    beat is put off, so the beats counted are the asked ones alone (a loaded CI run took
    longer than its 3 s and counted one more)."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 3600.0)
    nc, js = provisioned_nc, provisioned_nc.jetstream()
    reply = "$JS.ACK.x.reply.1"
    held: list[str] = []
    beat = await _beating_for(nc, held)
    before = await _revision(nc)
    beating = asyncio.ensure_future(beat.forever())
    try:
        held.append(reply)  # AckPolicy.hold, in the worker's loop
        beat.ask_to_list(reply)
        await js.stream_info(f"KV_{subjects.NODES_BUCKET}")  # an intake's round trip, say
        assert await beat.list_held(reply) is not None
        assert reply in await _listed(nc)
        assert await _revision(nc) == before + 1, "one beat: the one asked for"
        beat.ask_to_list(reply)  # listed already: no beat is asked for
        assert not beat._asked.is_set()
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def _running(beat: Heartbeat) -> None:
    """Until the beat's `forever` has started (it answers probes first)."""
    while not beat._running:
        await asyncio.sleep(0.001)  # polling a flag the task sets, bounded by the caller


async def test_a_message_listed_from_its_fetch_is_stored_before_it_is_held(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`list_ahead` at the fetch: the asked beat lists the message before the loop holds it
    (the put goes out beside the claim's create); the intake's ask and wait after it, the
    message now held, find it listed and ask for no second beat."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 3600.0)
    nc = provisioned_nc
    reply = "$JS.ACK.x.reply.2"
    held: list[str] = []
    beat = await _beating_for(nc, held)
    before = await _revision(nc)
    beating = asyncio.ensure_future(beat.forever())
    try:
        await asyncio.wait_for(_running(beat), 5)
        beat._last_put = float("-inf")  # the first beat's put long past: no gap to keep
        await beat.list_ahead([reply, None])
        assert beat._sent is not None and reply in beat._listing, "its put is out already"
        assert await beat.list_held(reply) is not None  # not held yet: listed from its fetch
        assert reply in await _listed(nc)
        held.append(reply)  # AckPolicy.hold, in the worker's loop, later
        beat.taken_in(reply)  # its intake begins
        beat.ask_to_list(reply)
        assert not beat._asked.is_set()
        assert await beat.list_held(reply) is not None
        assert await _revision(nc) == before + 1, "one beat: the one the fetch asked for"
        # Settled before the next beat: listed by nothing, neither held nor just fetched.
        held.remove(reply)
        await beat.beat(records=False)
        assert reply not in await _listed(nc)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def test_a_listing_sent_ahead_whose_put_is_not_stored_falls_back(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put sent by `list_ahead` whose answer is not a stored one: the beat that reads it
    stores the record by the retried put; with no `forever` running nothing is sent ahead
    (no beat would read its answer), the listing is only asked for."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 3600.0)
    nc = provisioned_nc
    held: list[str] = []
    beat = await _beating_for(nc, held)
    await beat.list_ahead(["$JS.ACK.x.y.1"])
    assert beat._sent is None and beat._asked.is_set()
    monkeypatch.setattr(heartbeat, "stored", lambda answer: False)
    beating = asyncio.ensure_future(beat.forever())
    try:
        await asyncio.wait_for(_running(beat), 5)
        await beat.list_held("$JS.ACK.x.y.1")  # the asked beat lists it
        beat._last_put = float("-inf")  # its put long past: no gap to keep
        await beat.list_ahead(["$JS.ACK.x.y.2"])
        assert beat._sent is not None
        assert await beat.list_held("$JS.ACK.x.y.2") is not None
        assert "$JS.ACK.x.y.2" in await _listed(nc)
        assert beat.health.failures == 0
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


@pytest.mark.parametrize(("held", "ahead", "listed", "left"), [
    (["a"], {}, ["a"], {}),
    ([], {"b": 9.5}, ["b"], {"b": 9.5}),  # fetched, not held yet: listed from its fetch
    (["a"], {"a": 9.5, "b": 9.5}, ["a", "b"], {"b": 9.5}),  # held now: the held list has it
    ([], {"b": 9.0}, [], {}),  # fetched AHEAD_LISTED_S ago (1 s) and never held: ended
])
def test_listing(held: list[str], ahead: dict[str, float], listed: list[str],
                 left: dict[str, float]) -> None:
    assert listing(held, ahead, 10.0, keep=1.0) == (listed, left)


@pytest.mark.parametrize(("now", "last", "wait"), [
    (10.0, 10.0, LIST_GAP_S),  # asked as the last beat began: the whole gap
    (10.0 + LIST_GAP_S / 2, 10.0, LIST_GAP_S / 2),  # the rest of the gap
    (10.0 + LIST_GAP_S, 10.0, 0.0),  # a gap since: at once
    (10.005, 10.0, 0.0),  # a client's next task 5 ms after the last (issue 23): at once
    (13.0, 10.0, 0.0),  # the first ask after a quiet while: at once
])
def test_listing_wait(now: float, last: float, wait: float) -> None:
    assert listing_wait(now, last) == pytest.approx(wait)


@pytest.mark.parametrize(("full", "built_at", "now", "built"), [
    (True, 10.0, 10.0, True),  # a full beat builds the record afresh
    (False, 10.0, 10.001, False),  # a listing beat re-puts the last one (issue 23)
    (False, 10.0, 10.0 + HEARTBEAT_S - 0.01, False),  # within one period
    (False, 10.0, 10.0 + HEARTBEAT_S, True),  # a period old: never staler than that
    (True, 10.0, 99.0, True),
])
def test_rebuilds(full: bool, built_at: float, now: float, built: bool) -> None:
    assert rebuilds(full, built_at, now) is built


async def test_a_listing_beat_re_puts_the_last_record_built(provisioned_nc: Client) -> None:
    """The node record's facts (psutil's memory, the host, the models) are built by the full
    beats; a listing beat renews only the held list and the time (issue 23)."""
    nc, js = provisioned_nc, provisioned_nc.jetstream()
    built: list[NodeInfo] = []

    def info() -> NodeInfo:
        built.append(_info().model_copy(update={"memory_available_bytes": len(built) + 1}))
        return built[-1]

    held = ["$JS.ACK.x.y.1"]
    beat = await _beating_for(nc, held, info)
    kv = await open_bucket(js, subjects.NODES_BUCKET)
    first = decode_model(NodeInfo, (await kv.get("n1")).value or b"")
    held.append("$JS.ACK.x.y.2")
    await beat.beat(records=False)
    listed = decode_model(NodeInfo, (await kv.get("n1")).value or b"")
    assert len(built) == 1
    assert listed.held_acks == held and listed.at >= first.at
    assert listed.model_copy(update={"held_acks": [], "at": 0.0}) == \
        first.model_copy(update={"held_acks": [], "at": 0.0})
    await beat.beat()  # a full beat: built afresh
    assert len(built) == 2
    assert decode_model(NodeInfo, (await kv.get("n1")).value or b"").memory_available_bytes == 2


@pytest.mark.parametrize(("subject", "listed", "listing", "asked"), [
    ("a", frozenset(), frozenset(), True),  # held, listed nowhere: a beat is asked for
    ("a", frozenset({"a"}), frozenset(), False),  # stored already
    ("a", frozenset(), frozenset({"a"}), False),  # the beat in flight lists it: await it
    ("a", frozenset({"b"}), frozenset({"b"}), True),  # the beat in flight does not
    (None, frozenset(), frozenset(), False),  # no ack subject: nothing to list
    ("", frozenset(), frozenset(), False),
])
def test_asks(subject: str | None, listed: frozenset[str], listing: frozenset[str],
              asked: bool) -> None:
    assert asks(subject, listed, listing) is asked


async def test_a_wait_during_the_beat_that_lists_it_asks_for_no_other(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`list_held` called while the asked beat's put is in flight awaits that beat: one put
    a task, not two (issue 23: at light load every intake's wait found its beat in flight
    and asked for a second, 2 ms later)."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 3600.0)
    nc = provisioned_nc
    reply = "$JS.ACK.x.reply.1"
    held: list[str] = []
    beat = await _beating_for(nc, held)
    before = await _revision(nc)
    putting = asyncio.Event()
    put = beat._put

    async def put_seen(info: NodeInfo, budget_s: float, sent: Sent | None = None) -> None:
        putting.set()
        await put(info, budget_s, sent)

    monkeypatch.setattr(beat, "_put", put_seen)
    beating = asyncio.ensure_future(beat.forever())
    try:
        held.append(reply)
        beat.ask_to_list(reply)
        await asyncio.wait_for(putting.wait(), 5)
        assert reply in beat._listing, "the beat in flight lists it"
        assert await beat.list_held(reply) is not None
        assert not beat._asked.is_set(), "no second beat was asked for"
        assert await _revision(nc) == before + 1
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


@pytest.mark.parametrize(("answer", "ok"), [
    (b'{"stream":"KV_FLEET_NODES","seq":12}', True),  # a PubAck: stored
    (b'{"stream":"KV_FLEET_NODES","seq":0}', False),
    (b'{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily '
     b'unavailable"}}', False),
    (b"", False),  # no responders' empty status message, or not an answer at all
    (b"[1]", False),
])
def test_stored(answer: bytes, ok: bool) -> None:
    assert stored(answer) is ok


async def test_a_put_the_fast_path_cannot_make_falls_back_to_the_retried_put(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A beat whose pipelined put is not answered as stored still stores the record, by the
    retried put (NodeRecords.put)."""
    nc, js = provisioned_nc, provisioned_nc.jetstream()
    beat = Heartbeat(nc, await open_bucket(js, subjects.NODES_BUCKET),
                     await open_bucket(js, subjects.RUNNERS_BUCKET), "n1", _info, list)
    beat.held = lambda: ["$JS.ACK.x.y.9"]
    monkeypatch.setattr(heartbeat, "stored", lambda answer: False)
    await beat.beat()
    assert await _listed(nc) == ["$JS.ACK.x.y.9"]
    assert beat.health.failures == 0


@pytest.mark.parametrize("fast_stored", [True, False])
async def test_a_runner_record_is_put_by_the_fast_path_or_the_retried_put(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch, fast_stored: bool,
) -> None:
    """The status writer's put (`put_runner`): stored by one pipelined publish, or, when its
    answer is not a stored one, by the retried put; either way the record is in the bucket."""
    nc, js = provisioned_nc, provisioned_nc.jetstream()
    beat = Heartbeat(nc, await open_bucket(js, subjects.NODES_BUCKET),
                     await open_bucket(js, subjects.RUNNERS_BUCKET), "n1", _info, list)
    if not fast_stored:
        monkeypatch.setattr(heartbeat, "stored", lambda answer: False)
    record = RunnerRecord(runner_id="r-1", instance_id="i-1", node_id="n1", model="m",
                          status=RunnerRunning(), slots=4, active_tasks=1, rank=0, at=1.0)
    await beat.put_runner(record)
    kv = await open_bucket(js, subjects.RUNNERS_BUCKET)
    assert decode_model(RunnerRecord, (await kv.get("r-1")).value or b"") == record
