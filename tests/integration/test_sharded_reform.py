"""A 2-shard instance whose rank 0 or rank 1 worker is SIGKILLed mid-answer, with a spare node:
the death watch sees the node gone, failover moves that rank to the spare at once, the
surviving rank's runner (stuck in its ring) is killed and restarted into the new ring at once
(no backoff: its group broke because a rank moved), both new runners start from the standby
runners their nodes keep (fleet/worker/standby.py: mlx-lm's imports done ahead), and the task
continues on the new group.

Real processes: nats-server, three `fleet worker`s, SmolLM2-135M over mx.distributed's ring
on loopback. Prints the times from the kill (moved, group ready, next token)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.models.catalog import get_card
from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo, RunnerRecord
from fleet.wire.codec import decode_events, decode_model
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import NO_EOS, cmdline
from tests.integration.harness import STANDBY, client, events_of, finished, submit, wait_node
from tests.integration.test_sharded import moved_away, paris, ready_ranks


async def warm_standbys(nc: Client, nodes: Iterable[str], timeout: float = 240.0) -> None:
    """Until every one of `nodes` says in its heartbeat that a warm standby runner waits there
    (one KV watch; each node wakes its heartbeat when its standby turns warm)."""
    waiting = set(nodes)
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    watcher = await kv.watchall()
    try:
        async with asyncio.timeout(timeout):
            while waiting:
                entry = await watcher.updates(timeout=timeout)
                if entry is None or not entry.value:
                    continue
                if decode_model(NodeInfo, entry.value).standby_runner:
                    waiting.discard(entry.key)
    finally:
        await watcher.stop()


@pytest.mark.parametrize("rank", [0, 1])
async def test_a_rank_killed_moves_to_a_spare_and_the_group_serves_again_at_once(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path, rank: int,
) -> None:
    models = {"smollm2-135m": smollm2_dir}
    workers = [start_worker(f"w{i}", models=models, **STANDBY) for i in range(3)]
    nc = await client(nats_url)
    by_node = {await wait_node(nc, w.data_dir): w for w in workers}
    sharded = await place(nc.jetstream(), get_card("smollm2-135m"), slots=2, shards=2)
    before = await ready_ranks(nc, sharded)
    leader = sharded.shards[0].node_id
    victim = sharded.shards[rank].node_id
    # Every node keeps one: the ranks' (their runners restart with the group) and the spare's
    # (a moved rank starts there). A kill long after the group formed finds them warm.
    await warm_standbys(nc, by_node)

    task = paris(f"rank-{rank}-killed").model_copy(update={"max_tokens": 48})
    got: list[tuple[float, OutputEvent]] = []
    arrived = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        now = time.monotonic()
        got.extend((now, event) for event in decode_events(msg.data))
        arrived.set()

    await nc.subscribe(subjects.out(task.task_id), cb=on_event)
    await submit(nc, task)
    async with asyncio.timeout(240):
        while not any(isinstance(e, TokenChunk) for _, e in got):
            arrived.clear()
            await arrived.wait()
    killed_at = time.monotonic()
    by_node[victim].kill()
    healed = await moved_away(nc, sharded.instance_id, victim)
    moved_at = time.monotonic()
    survivor = 1 - rank
    assert healed.shards[survivor].node_id == sharded.shards[survivor].node_id  # it stays
    await ready_ranks(nc, healed, before=before.values())
    ready_at = time.monotonic()
    async with asyncio.timeout(240):
        while not any(isinstance(e, TaskFinished) for _, e in got):
            arrived.clear()
            await arrived.wait()
    after = [at for at, e in got if isinstance(e, TokenChunk) and at > killed_at]
    print(f"\nrank {rank} SIGKILL -> moved {moved_at - killed_at:.1f} s, group ready "
          f"{ready_at - killed_at:.1f} s, next token "
          f"{(after[0] - killed_at) if after else float('nan'):.1f} s")
    events = await events_of(nc, task.task_id)
    terminal = finished(events)
    assert terminal.status == "completed" or terminal.reason == "runner_crashed", terminal
    if terminal.status == "completed":
        indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
        assert indexes == list(range(len(indexes)))
        accepted = [e for e in events if isinstance(e, TaskAccepted)]
        assert len(accepted) == 2 and accepted[-1].continued_from > 0
        if rank == 0:  # rank 0's worker held the task: its continuation moved with the rank
            assert accepted[-1].moved_from == leader
    await nc.close()


async def new_runners_on(
    nc: Client, instance_id: str, node: str, known: Iterable[str], seconds: float,
) -> list[str]:
    """The runners of `instance_id` on `node` (none of `known`) that wrote a record within
    `seconds` (one KV watch over FLEET_RUNNERS)."""
    old = set(known)
    found: list[str] = []
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await watcher.updates(timeout=left)
            except TimeoutError:
                break
            if entry is None or not entry.value:
                continue
            record = decode_model(RunnerRecord, entry.value)
            if (record.instance_id == instance_id and record.node_id == node
                    and record.runner_id not in old and record.runner_id not in found):
                found.append(record.runner_id)
    finally:
        await watcher.stop()
    return found


def kill_runner(runner_id: str) -> None:
    """SIGKILL the runner process of `runner_id`, unless it has exited already."""
    for entry in Path("/proc").iterdir():
        line = cmdline(entry)
        if entry.name.isdigit() and b"fleet.runner.main" in line and runner_id.encode() in line:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


async def gone(nc: Client, runner_id: str, timeout: float = 60.0) -> None:
    """Until the runner's record is deleted (its worker saw it exit), or already was."""
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watch(runner_id)
    live = False
    try:
        async with asyncio.timeout(timeout):
            while True:
                entry = await watcher.updates(timeout=timeout)
                if entry is None:  # the current values are through
                    if not live:
                        return
                elif entry.operation in ("DEL", "PURGE"):
                    return
                else:
                    live = True
    finally:
        await watcher.stop()


async def test_the_survivor_of_a_dead_peer_restarts_only_into_the_moved_group(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """Rank 1's worker SIGKILLed mid-answer, no spare yet. The survivor, rank 0 (the rank
    that listens first in mlx's ring), starts no runner into the dead rank's layout: one
    started there (its 1 s crash backoff often ran out before failover's move) listened on
    the survivor's ring address, the moved rank's new runner connected to it and not to its
    successor, and neither new runner's ring formed until the 120 s ring timeout (2 of 20
    rounds of `fleet bench --only seam --seam-cases sharded_kill`, tiny-llm). When a spare
    joins, the rank moves there, the group forms and the answer is finished, whole.

    The survivor's runner is SIGKILLed right after the kill, so its worker sees the crash
    this test is about in every run: mlx either raises on the lost connection (exit code 3)
    or retries the closed socket for good, and under load the answer may be whole before the
    kill lands, leaving an idle runner that learns nothing (two CI runs waited 60 s for it)."""
    workers = [start_worker(f"w{i}", **STANDBY) for i in range(2)]
    nc = await client(nats_url)
    by_node = {await wait_node(nc, w.data_dir): w for w in workers}
    sharded = await place(nc.jetstream(), get_card("tiny-llm"), slots=2, shards=2)
    before = await ready_ranks(nc, sharded)
    survivor, victim = sharded.shards[0].node_id, sharded.shards[1].node_id
    await warm_standbys(nc, by_node)  # a restart there would report at once

    task = TextGeneration(
        task_id="survivor-waits", model="tiny-llm", max_tokens=1500, temperature=0.0,
        logit_bias=NO_EOS, messages=[ChatMessage(role="user", content="Tell me a story")])
    got: list[OutputEvent] = []
    arrived = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        got.extend(decode_events(msg.data))  # a terminal may carry the last tokens
        arrived.set()

    await nc.subscribe(subjects.out(task.task_id), cb=on_event)
    await submit(nc, task)
    async with asyncio.timeout(120):
        while not any(isinstance(e, TokenChunk) for e in got):
            arrived.clear()
            await arrived.wait()
    by_node[victim].kill()
    kill_runner(before[0])  # dies with its ring, stuck in it, or idle: see above
    await gone(nc, before[0])
    # Its crash backoff is 1 s: a restart into the dead layout would report well within 4 s.
    assert await new_runners_on(nc, sharded.instance_id, survivor, before.values(), 4.0) == []

    start_worker("w2", **STANDBY)
    healed = await moved_away(nc, sharded.instance_id, victim)
    # Well inside the ring timeout (120 s), which a ring that joined a stale runner waits out.
    await ready_ranks(nc, healed, timeout=90, before=before.values())
    async with asyncio.timeout(90):
        while not any(isinstance(e, TaskFinished) for e in got):
            arrived.clear()
            await arrived.wait()
    events = await events_of(nc, task.task_id)
    assert finished(events).status == "completed", finished(events)
    indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
    assert indexes == list(range(task.max_tokens))
    await nc.close()
