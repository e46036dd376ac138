"""The sweeper lease's holder SIGKILLed while another node dies: both nodes' instances still
move, each exactly once (fleet.worker.sweeper), on a real server with simulated nodes in
processes of their own (bench.scale_sim)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.scale_sim import KILL, READY, sim_model, sim_node_id
from fleet.bus.kv_read import live_values
from fleet.placement import new_instance
from fleet.runner.fault_engine import fault_card
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo
from fleet.wire.codec import decode_model, encode
from fleet.worker.sweeper import LEASES_BUCKET, SWEEPER

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]
MODELS = 2
# The lease goes 10 s after its holder stops, a node's heartbeat key 15 s after its last beat
# and a new holder trusts absences once its own heartbeats went through for 15 s.
MOVED_WITHIN_S = 60.0
ANOTHER_SWEEP_S = 6.0  # after the moves: one more sweep period (5 s), to see no second move


@pytest.fixture
def sims(nats_url: str, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def start_sims(url: str, first: int, count: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "bench.scale_sim", "--url", url, "--first", str(first),
             "--count", str(count), "--models", str(MODELS)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


async def until(check: object, timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := await check():  # type: ignore[operator]
            return found
        await asyncio.sleep(0.2)  # polling the bucket, bounded by the deadline
    raise TimeoutError(what)


async def test_the_sweeper_killed_as_a_node_dies_its_instances_still_move_once(
    provisioned_nc: Client, nats_url: str, sims: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    nc = provisioned_nc
    js = nc.jetstream()
    ready: asyncio.Queue[str] = asyncio.Queue()

    async def on_ready(msg: Msg) -> None:
        ready.put_nowait(msg.data.decode())

    await nc.subscribe(READY, cb=on_ready)
    sims.append(start_sims(nats_url, 0, 1, tmp_path / "holder.log"))
    await asyncio.wait_for(ready.get(), 60)
    leases = await js.key_value(LEASES_BUCKET)

    async def holder() -> str | None:
        with contextlib.suppress(Exception):
            return ((await leases.get(SWEEPER)).value or b"").decode() or None
        return None

    assert await until(holder, 20, "nobody took the lease") == sim_node_id(0)
    sims.append(start_sims(nats_url, 1, 3, tmp_path / "others.log"))
    await asyncio.wait_for(ready.get(), 60)

    nodes = {n.node_id: n for n in await live_values(js, subjects.NODES_BUCKET, NodeInfo)}
    instances = await js.key_value(subjects.INSTANCES_BUCKET)
    doomed = [sim_node_id(0), sim_node_id(1)]  # the lease's holder and another node
    for node in doomed:
        card = fault_card(sim_model(0, MODELS))
        placed = new_instance(card, nodes[node], 4, time.time(), f"{node}-i")
        await instances.put(placed.instance_id, encode(placed))
    writes: dict[str, list[Instance]] = {f"{node}-i": [] for node in doomed}
    watcher = await instances.watchall()
    while await watcher.updates(timeout=10) is not None:  # the placements
        pass

    os.killpg(sims[0].pid, signal.SIGKILL)  # the sweeper, without a word
    await nc.publish(KILL, sim_node_id(1).encode())  # a node gone, its key left to expire

    async def moved() -> bool:
        with contextlib.suppress(TimeoutError):
            entry = await watcher.updates(timeout=0.5)
            if entry is not None and entry.value and entry.key in writes:
                writes[entry.key].append(decode_model(Instance, entry.value))
        return all(writes[key] for key in writes)

    await until(moved, MOVED_WITHIN_S, f"instances not moved off {doomed}: {writes}")
    settle = time.monotonic() + ANOTHER_SWEEP_S
    while time.monotonic() < settle:  # an observation window: a second move would show
        await moved()
    await watcher.stop()
    for key, seen in writes.items():
        assert len(seen) == 1, f"{key} was written {len(seen)} times: {seen}"
        assert all(shard.node_id not in doomed for shard in seen[0].shards)
    assert await holder() in {sim_node_id(i) for i in (2, 3)}  # the lease changed hands
