"""A 2-shard instance whose rank 0 worker is SIGKILLed mid-answer, with a spare node: the death
watch sees the node gone, failover moves rank 0 to the spare at once, the surviving rank's
runner (stuck in its ring) is killed and restarted into the new ring at once (its watchdog no
longer holds its pipe open for the ring timeout), and the task continues on the new group.

Real processes: nats-server, three `fleet worker`s, SmolLM2-135M over mx.distributed's ring
on loopback. Prints the times from the kill (moved, group ready, next token)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nats.aio.msg import Msg

from fleet.models.catalog import get_card
from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.codec import decode_event
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk, token_indexes
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import client, events_of, finished, submit, wait_node
from tests.integration.test_sharded import moved_away, paris, ready_ranks


async def test_rank_0_killed_moves_to_a_spare_and_the_group_serves_again_at_once(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path,
) -> None:
    models = {"smollm2-135m": smollm2_dir}
    workers = [start_worker(f"w{i}", models=models) for i in range(3)]
    nc = await client(nats_url)
    by_node = {await wait_node(nc, w.data_dir): w for w in workers}
    sharded = await place(nc.jetstream(), get_card("smollm2-135m"), slots=2, shards=2)
    before = await ready_ranks(nc, sharded)
    leader = sharded.shards[0].node_id

    task = paris("rank-0-killed").model_copy(update={"max_tokens": 48})
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
    by_node[leader].kill()
    healed = await moved_away(nc, sharded.instance_id, leader)
    moved_at = time.monotonic()
    assert healed.shards[1].node_id == sharded.shards[1].node_id  # rank 1 stays
    await ready_ranks(nc, healed, before=before.values())
    ready_at = time.monotonic()
    async with asyncio.timeout(240):
        while not any(isinstance(e, TaskFinished) for _, e in got):
            arrived.clear()
            await arrived.wait()
    after = [at for at, e in got if isinstance(e, TokenChunk) and at > killed_at]
    print(f"\nrank 0 SIGKILL -> moved {moved_at - killed_at:.1f} s, group ready "
          f"{ready_at - killed_at:.1f} s, next token "
          f"{(after[0] - killed_at) if after else float('nan'):.1f} s")
    events = await events_of(nc, task.task_id)
    terminal = finished(events)
    assert terminal.status == "completed" or terminal.reason == "runner_crashed", terminal
    if terminal.status == "completed":
        indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
        assert indexes == list(range(len(indexes)))
        accepted = [e for e in events if isinstance(e, TaskAccepted)]
        assert accepted[-1].moved_from == leader
    await nc.close()
