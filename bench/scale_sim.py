"""`python -m bench.scale_sim`: many simulated nodes in one process, for `fleet bench --only scale`.

Each simulated node has a NATS connection of its own (the server fans out per connection, as
it would to real machines) and runs Fleet's node-agent code as a worker does: the heartbeat
(fleet.worker.heartbeat), the fleet-wide duties (fleet.worker.sweeper: the heartbeat watch
and failover sweep under a lease), the prefix adverts of the models it serves
(fleet.worker.prefix_adverts) and its own prefix adverts; `--design baseline` composes the same
parts as before the scale redesign (every node watched every heartbeat and every advert, and
swept). Hand-offs and ask responders are left out: they cost per task, not per node. Its
runner is the fault engine's plumbing only: a busy node publishes token events for its streams on
`fleet.out.<task>` (stored by FLEET_OUT, as a runner's are) and advertises its prefix blocks
as a loaded worker does (its load changes four times a second, its blocks with each new
prompt); an idle one writes nothing (its advert lasts: fleet.bus.kv_lasting), where the
baseline refreshed it every 20 s.

Control (core NATS, from the harness): `bench.scale.kill` with a node id closes that node's
connection without a goodbye (its heartbeat key expires, as after a SIGKILL), answered once
done when sent as a request (a starved process's control connection may drop a publish);
`bench.scale.load` with `{"busy": [node ids]}` sets which nodes carry streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import time

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from fleet.aio import cancel_and_wait, set_within
from fleet.bus.connect import connect
from fleet.bus.kv_calls import kv_put
from fleet.bus.kv_lasting import put_lasting
from fleet.bus.kv_mirror import Mirror
from fleet.bus.replies import inbox_reply
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo, RunnerRecord, ShardAssignment
from fleet.wire.codec import encode
from fleet.wire.events import TokenChunk
from fleet.wire.prefixes import PrefixSummary
from fleet.wire.runners import RunnerReady
from fleet.worker.failover import Failover
from fleet.worker.heartbeat import HEARTBEAT_S, Heartbeat
from fleet.worker.node import node_info
from fleet.worker.prefix_adverts import (
    LOAD_SUFFIX,
    REFRESH_S,
    ServedPrefixes,
    Written,
    advert_due,
    advert_key,
)
from fleet.worker.prefix_blocks import BLOCK_CHARS
from fleet.worker.sweeper import FleetDuties

log = logging.getLogger("bench.scale_sim")

KILL = "bench.scale.kill"
LOAD = "bench.scale.load"
READY = "bench.scale.ready"
STREAMS_PER_BUSY_NODE = 2
TOKENS_PER_S = 20.0
ADVERT_EVERY_S = 0.25
BUSY_BLOCKS = 1024  # a loaded runner's cache: ~18 KB of hashes in its summary
NEW_PROMPT_S = 2.0  # a busy runner's blocks change with each new prompt
IDLE_BLOCKS = 64
WATCH_CAUGHT_UP_S = 120.0


def sim_model(index: int, models: int) -> str:
    return f"sim-m{index % models}"


def sim_node_id(index: int) -> str:
    return f"sim-{index:05d}"


class SimNode:
    def __init__(self, url: str, index: int, models: int, template: NodeInfo,
                 cards: dict[str, ModelCard], design: str, place_own: bool = False) -> None:
        self.url = url
        self.place_own = place_own
        self.design = design
        self.index = index
        self.node_id = sim_node_id(index)
        self.model = sim_model(index, models)
        self.runner_id = f"{self.node_id}-r0"
        self.info = template.model_copy(update={
            "node_id": self.node_id, "models_available": sorted(cards), "runners": [self.runner_id],
        })
        self.cards = cards
        self.loaded = asyncio.Event()  # set while busy: an idle node's streams wait on it
        self.blocks = [secrets.randbits(64) for _ in range(BUSY_BLOCKS)]
        self.nc: Client | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.nc = nc = await connect(self.url, f"sim-node-{self.node_id}", inbox_owner="worker")
        self.js = js = nc.jetstream()
        nodes = await js.key_value(subjects.NODES_BUCKET)
        runners = await js.key_value(subjects.RUNNERS_BUCKET)
        self.prefixes = await js.key_value(subjects.PREFIXES_BUCKET)
        record = RunnerRecord(runner_id=self.runner_id, instance_id=f"{self.node_id}-i",
                              node_id=self.node_id, model=self.model,
                              status=RunnerReady(), slots=4, at=time.time())
        self.heartbeat = Heartbeat(nc, nodes, runners, self.node_id, self._info, lambda: [record])
        await self.heartbeat.beat(budget_s=30.0)
        failover = Failover(js, nodes, await js.key_value(subjects.INSTANCES_BUCKET),
                            self.cards, self_id=self.node_id,
                            trusted=self.heartbeat.trusts_absences,
                            on_own_key_gone=self.heartbeat.wake.set, on_gap=self.heartbeat.gap)
        link = _Link(nc)
        # Started only once its instance watch has read the table (1,000 instances at
        # N = 1,000, for each of 1,000 nodes): the harness's stand-in beats for it until then,
        # and a process still reading its nodes' backlogs let live nodes' beats lapse.
        watcher = await (await js.key_value(subjects.INSTANCES_BUCKET)).watchall()
        caught_up = asyncio.Event()
        if self.design == "baseline":  # every node watched every heartbeat, swept, heard all
            mirror = Mirror(subjects.PREFIXES_BUCKET,
                            lambda key: self._adverts_changed(mirror.values, key))
            duties = [failover.watch(), failover.sweep_forever(), mirror.run(link)]
        else:
            served = ServedPrefixes(lambda: {self.model}, self._adverts_changed)
            duties = [FleetDuties(js, self.node_id, failover).forever(), served.run(link)]
        self.tasks = [
            asyncio.create_task(self._beat()),
            *(asyncio.create_task(duty) for duty in duties),
            asyncio.create_task(self._watch_instances(watcher, caught_up)),
            asyncio.create_task(self._advertise()),
            asyncio.create_task(self._stream()),
        ]
        if not await set_within(caught_up, WATCH_CAUGHT_UP_S):
            log.warning("%s: its instance watch not caught up in %.0f s", self.node_id,
                        WATCH_CAUGHT_UP_S)
        if self.place_own:
            # An instance of its model on it, written once it beats: placed on a live node, as
            # placement does, never one the sweeper could find without a heartbeat.
            instance = Instance(
                instance_id=f"{self.node_id}-i", model=self.model, slots=4,
                shards=[ShardAssignment(node_id=self.node_id, runner_id=self.runner_id)],
                created_at=time.time())
            await kv_put(await js.key_value(subjects.INSTANCES_BUCKET), instance.instance_id,
                         encode(instance))

    async def _beat(self) -> None:
        """The heartbeat's rounds (fleet.worker.heartbeat: every HEARTBEAT_S, at once when the
        node's own key was seen to expire) and its answers to probes, without the worker's
        poll for newly held task messages every HELD_CHECK_S: a simulated node holds none, and
        1,000 nodes polling (20,000 wakes a second) starved the simulator at N = 1,000 (144
        live nodes' beats late past the TTL, their instances moved as if dead)."""
        assert self.nc is not None
        nc = self.nc

        async def answer(msg: Msg) -> None:  # as Heartbeat's: any answer says "alive"
            if (reply := inbox_reply(msg.reply)) is not None:
                with contextlib.suppress(Exception):
                    await nc.publish(reply, b"")

        await nc.subscribe(subjects.alive(self.node_id), cb=answer)
        last = time.monotonic()
        while True:
            await set_within(self.heartbeat.wake, max(0.0, last + HEARTBEAT_S - time.monotonic()))
            self.heartbeat.wake.clear()
            last = time.monotonic()
            await self.heartbeat.beat()

    async def _watch_instances(self, watcher: KeyValue.KeyWatcher,
                               caught_up: asyncio.Event) -> None:
        """As a worker's instance watch (fleet.worker.cluster): the whole table."""
        async for entry in watcher:
            if entry is None:  # the end of the initial values
                caught_up.set()

    @property
    def busy(self) -> bool:
        return self.loaded.is_set()

    @busy.setter
    def busy(self, busy: bool) -> None:
        if busy:
            self.loaded.set()
        else:
            self.loaded.clear()

    def _info(self) -> NodeInfo:
        return self.info.model_copy(update={"at": time.time()})

    def _adverts_changed(self, values: dict[str, bytes], key: str | None) -> None:
        self.adverts_seen = len(values)  # parsed by a worker; here only held, as a mirror is

    async def _advertise(self) -> None:
        """As fleet.worker.prefix_adverts decides: a busy runner's load changes every period
        (tasks start and end), its blocks with each new prompt (every NEW_PROMPT_S); baseline:
        every change writes the whole summary, as before."""
        last: Written | None = None
        blocks_mark, prompt_at, tick = 0, 0.0, 0
        while True:
            now = time.time()
            if self.busy:
                tick += 1
                if now - prompt_at >= NEW_PROMPT_S:  # a new prompt: its blocks are the newest
                    self.blocks = self.blocks[8:] + [secrets.randbits(64) for _ in range(8)]
                    blocks_mark, prompt_at = blocks_mark + 1, now
            load = (1 + tick % 2 if self.busy else 0, 0, True)
            if self.design == "baseline":
                changed = last is None or (blocks_mark, load) != (last.blocks, last.load)
                due = "whole" if changed or now - last.whole_at >= REFRESH_S else None
            else:
                due = advert_due(last, blocks_mark, load, now)
            if due is not None:
                blocks = self.blocks if self.busy or blocks_mark else self.blocks[:IDLE_BLOCKS]
                summary = PrefixSummary(
                    runner_id=self.runner_id, node_id=self.node_id, model=self.model,
                    block_chars=BLOCK_CHARS, load_only=due == "load",
                    blocks=[] if due == "load" else [f"{b:016x}" for b in blocks],
                    in_flight=load[0], slots=4, at=now)
                key = (self.runner_id if self.design == "baseline"
                       else advert_key(self.model, self.runner_id))
                key += LOAD_SUFFIX if due == "load" else ""
                with contextlib.suppress(Exception):
                    if self.design == "baseline":
                        await kv_put(self.prefixes, key, encode(summary))
                    else:  # as a worker writes them: on change only, never expiring by age
                        await put_lasting(self.js, self.prefixes, key, encode(summary))
                last = (Written(blocks_mark, load, now, now) if due == "whole" or last is None
                        else Written(last.blocks, load, last.whole_at, now))
            if self.design != "baseline" and due is None and not self.busy:
                # Idle and written: nothing changes until load comes (4 wakes a second of
                # 1,000 idle nodes were 4,000 wakes of harness for nothing).
                await self.loaded.wait()
                continue
            await asyncio.sleep(ADVERT_EVERY_S)  # the advert period of a worker

    async def _stream(self) -> None:
        """While busy: STREAMS_PER_BUSY_NODE tasks, TOKENS_PER_S each, on fleet.out.<id>."""
        period = 1.0 / TOKENS_PER_S
        tasks = [f"sim-{self.node_id}-{n}-{secrets.token_hex(4)}"
                 for n in range(STREAMS_PER_BUSY_NODE)]
        index = 0
        while True:
            # Idle, it waits for load rather than waking 20 times a second (250 nodes a process:
            # 5,000 wakes a second of harness). At N = 1,000 (load 14) live nodes' heartbeats
            # lapsed and the sweeper moved 19 of their instances: the simulator starved.
            await self.loaded.wait()
            await asyncio.sleep(period)  # the token rate of a stream
            if self.nc is None:
                continue
            now = time.time()
            for task_id in tasks:
                event = TokenChunk(task_id=task_id, index=index, token_id=7, text="tok", at=now)
                with contextlib.suppress(Exception):
                    await self.nc.publish(subjects.out(task_id), encode(event))
            index += 1

    async def kill(self) -> None:
        """Gone without a goodbye: no key deleted, no event published."""
        # Repeated cancels: one that lands as a KV put is answered is dropped on Python 3.11
        # (fleet.aio), and a heartbeat left running would keep the node alive.
        if still := await cancel_and_wait(self.tasks):
            log.warning("%s: %d of its tasks did not stop", self.node_id, len(still))
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 5.0)
            self.nc = None


class _Link:
    def __init__(self, nc: Client) -> None:
        self.nc = nc

    @property
    def connected(self) -> bool:
        return self.nc.is_connected


async def run(url: str, first: int, count: int, models: int, design: str,
              place_own: bool) -> None:
    template = node_info("template", time.time(), [], [], None)
    from fleet.runner.fault_engine import fault_card

    cards = {sim_model(i, models): fault_card(sim_model(i, models)) for i in range(models)}
    nodes = {sim_node_id(i): SimNode(url, i, models, template, cards, design, place_own)
             for i in range(first, first + count)}
    control = await connect(url, f"sim-control-{first}")

    async def on_kill(msg: Msg) -> None:
        node = nodes.pop(msg.data.decode(), None)
        if node is not None:
            await node.kill()
            if msg.reply:  # the harness's request: the node is gone (its beats have stopped)
                await control.publish(msg.reply, b"killed")

    async def on_load(msg: Msg) -> None:
        busy = set(orjson.loads(msg.data)["busy"])
        for node in nodes.values():
            node.busy = node.node_id in busy

    await control.subscribe(KILL, cb=on_kill)
    await control.subscribe(LOAD, cb=on_load)
    for batch in range(0, count, 50):  # connections in batches: a burst of 1,000 TLS-less
        await asyncio.gather(*(n.start() for n in list(nodes.values())[batch:batch + 50]))
    await control.publish(READY, f"{first}:{count}".encode())
    await control.flush()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--design", choices=("baseline", "current"), default="current",
                        help="baseline: composed as before the scale redesign (every node "
                        "watches every heartbeat and advert, and sweeps)")
    parser.add_argument("--place-own", action="store_true",
                        help="each node writes an instance of its model on itself once started")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("SIM_LOG", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    import uvloop

    uvloop.run(run(args.url, args.first, args.count, args.models, args.design,
                   args.place_own))


if __name__ == "__main__":
    main()

