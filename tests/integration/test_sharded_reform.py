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
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.models.catalog import get_card
from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import decode_event, decode_model
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk, token_indexes
from tests.integration.conftest import WorkerFactory
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
        got.append((time.monotonic(), decode_event(msg.data)))
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
