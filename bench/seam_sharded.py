"""The seam's sharded case (`sharded_kill`, issue 24: "rank 0 or rank 1 worker SIGKILL, 2
shards, a spare node ready: p50 <= 20 s").

The seam stack's two workers plus a third, the spare; the model's unsharded instances
removed and one 2-shard instance placed (two of the three nodes hold a rank each). Each round
starts as a fleet up a while would be: both ranks' runners ready, a warm standby runner on
every node (the ranks' nodes keep one for the restart into a new ring, the spare one for the
rank that moves there: fleet/worker/standby.py) and the sweeper and sentinel leases held by
two workers. A greedy answer of `sharded_max_tokens` (60) is submitted; at `sharded_kill_at`
(10) tokens the worker of rank 0 (even rounds) or rank 1 (odd rounds) is SIGKILLed with its
runner. The seam is the kill ->
the next token of the continued answer at the client; `group_ready_s` the kill -> both ranks
of the re-formed group ready (failover's move to the spare, the survivor's restart into the
new ring, both loads). The killed worker is restarted at once: the next round's spare. A round
whose answer was done before its kill (the client behind the answer by more than its rest
took to make) measured nothing and is run again (bench.seam.measured).

tests/integration/test_sharded_reform.py asserts the same path at CI size (one kill per
rank); this case repeats it for a p50.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.js.kv import KeyValue

from bench.seam import (
    EARLY,
    MADE_WHOLE,
    READY_S,
    ROUND_S,
    SHARDED,
    SeamStack,
    Watch,
    Worker,
    judge,
    measured,
    until_entry,
)
from fleet.bus.connect import js_publish
from fleet.models.catalog import get_card
from fleet.placement import place, read_instances, remove
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord
from fleet.wire.codec import decode_model
from fleet.wire.events import TaskAccepted
from fleet.wire.tasks import TextGeneration

SHARDS = 2
# A rank's runner serving the round's answer reports `running`: as ready as `ready`.
SERVING = ("ready", "running")


async def start_sharded(stack: SeamStack) -> Instance:
    """The spare worker started, the model's unsharded instances removed, one 2-shard
    instance placed (over any two of the three nodes)."""
    assert stack.nc is not None
    spare = stack.worker("c")
    stack.workers.append(spare)
    spare.start()
    await stack.beating(spare, time.monotonic() + READY_S)
    js = stack.nc.jetstream()
    for instance in await read_instances(js):
        if instance.model == stack.model:
            await remove(js, instance.instance_id)
    return await place(js, get_card(stack.model), slots=4, shards=SHARDS)


async def current(stack: SeamStack, instance_id: str) -> Instance:
    assert stack.nc is not None
    found = [i for i in await read_instances(stack.nc.jetstream())
             if i.instance_id == instance_id]
    if not found:
        raise LookupError(f"instance {instance_id} is gone")
    return found[0]


async def ranks_ready(
    stack: SeamStack, instance: Instance, before: set[str], deadline: float,
) -> dict[int, str]:
    """Until every rank of `instance` (as placed now) has a runner that reports ready on its
    node, none of the runners `before` nor a killed one (their last records stay in
    FLEET_RUNNERS a while): their runner ids by rank."""
    assert stack.nc is not None
    nodes = {shard.rank: shard.node_id for shard in instance.shards}
    ranks: dict[int, str] = {}

    def ready(entry: KeyValue.Entry) -> bool:
        if entry.value:
            record = decode_model(RunnerRecord, entry.value)
            if (record.instance_id == instance.instance_id
                    and record.status.state in SERVING
                    and nodes.get(record.rank) == record.node_id
                    and record.runner_id not in before
                    and record.runner_id not in stack.dead_runners):
                ranks[record.rank] = record.runner_id
        return set(ranks) == set(nodes)

    await until_entry(stack.nc, subjects.RUNNERS_BUCKET, ready, deadline,
                      f"the ranks of {instance.instance_id} were not all ready "
                      f"(ready: {ranks}, placed: {nodes})")
    return ranks


async def moved_off(stack: SeamStack, instance_id: str, gone: str, deadline: float) -> Instance:
    """The instance once failover has moved its shard off the node `gone`."""
    assert stack.nc is not None
    found: list[Instance] = []

    def moved(entry: KeyValue.Entry) -> bool:
        if entry.key == instance_id and entry.value:
            instance = decode_model(Instance, entry.value)
            if all(shard.node_id != gone for shard in instance.shards):
                found.append(instance)
        return bool(found)

    await until_entry(stack.nc, subjects.INSTANCES_BUCKET, moved, deadline,
                      f"{instance_id} was not moved off {gone}")
    return found[0]


async def regrouped(
    stack: SeamStack, instance_id: str, gone: str, before: set[str], deadline: float,
) -> float:
    """When (monotonic) the group re-formed after `gone` died: moved, and every rank ready on
    a runner that is none of `before`."""
    instance = await moved_off(stack, instance_id, gone, deadline)
    await ranks_ready(stack, instance, before, deadline)
    return time.monotonic()


def by_node(stack: SeamStack, node_id: str) -> Worker:
    return next(w for w in stack.workers if w.node_id == node_id)


class ShardedCase:
    """The rounds of one run, and what each must know of the one before it."""

    def __init__(self, stack: SeamStack, instance: Instance) -> None:
        self.stack = stack
        self.instance_id = instance.instance_id
        self.previous: set[str] = set()  # the runners of the group the last round broke

    async def settled(self, deadline: float) -> tuple[Instance, dict[int, str]]:
        """The round's start: every worker's current process beating with a warm standby,
        the group ready, both leases held."""
        stack = self.stack
        for worker in stack.workers:
            await stack.standby_warm(worker, deadline)
        instance = await current(stack, self.instance_id)
        ranks = await ranks_ready(stack, instance, self.previous, deadline)
        await stack.both_leases_held(deadline)
        return instance, ranks

    async def round(self, index: int) -> dict[str, Any]:
        stack, plan = self.stack, self.stack.plan
        assert stack.nc is not None
        began = time.monotonic()
        instance, ranks = await self.settled(time.monotonic() + READY_S)
        rank = index % SHARDS
        victim = by_node(stack, instance.shards[rank].node_id)
        task = stack.task(f"seam-{SHARDED}-{index}-{time.time_ns()}", plan.sharded_max_tokens)
        watch = Watch()
        sub = await stack.nc.subscribe(subjects.out(task.task_id), cb=watch.on_msg)
        group: asyncio.Task[float] | None = None
        try:
            await publish(stack, task)
            await watch.until(
                lambda: watch.tokens() >= plan.sharded_kill_at or watch.done(), ROUND_S)
            if watch.done():
                return {"rerun": EARLY, "rank": rank, **watch.ending()}
            group = asyncio.create_task(regrouped(
                stack, self.instance_id, victim.node_id, set(ranks.values()),
                time.monotonic() + ROUND_S))
            faulted_at = time.monotonic()
            victim.kill()
            stack.dead_runners.add(ranks[rank])
            self.previous = set(ranks.values())  # the next round's group has none of them
            await watch.until(
                lambda: watch.next_token_after(faulted_at) or watch.done(), ROUND_S)
            resumed = watch.next_token_after(faulted_at)  # None: made whole before the kill
            victim.start()  # the next round's spare; its start overlaps the answer's rest
            await watch.until(watch.done, ROUND_S)
            if resumed is None:  # the continuation had no token left to make: no seam
                return {"rerun": MADE_WHOLE, "rank": rank, **watch.ending()}
            stored = await stack.stored(task.task_id)
            row = {"rank": rank, "seam_s": round(resumed - faulted_at, 3),
                   **judge(stored, plan.sharded_max_tokens)}
            try:
                row["group_ready_s"] = round(await group - faulted_at, 3)
            except TimeoutError as exc:  # the answer continued; the group's watch saw no end
                row["group_error"] = str(exc)
        finally:
            await sub.unsubscribe()
            if group is not None and not group.done():  # not wanted now, nor its timeout
                group.cancel()
        accepted = [e for e in stored if isinstance(e, TaskAccepted)]
        row["attempts"] = len(accepted)
        row["round_s"] = round(time.monotonic() - began, 1)
        return row


async def publish(stack: SeamStack, task: TextGeneration) -> None:
    assert stack.nc is not None
    await js_publish(stack.nc.jetstream(), subjects.tasks(task.model), task,
                     msg_id=task.task_id)


async def run_sharded(stack: SeamStack) -> list[dict[str, Any]]:
    """Every round of the sharded case (a round that broke is a row with its error; one whose
    answer was done before its kill is run again: bench.seam.measured)."""
    case = ShardedCase(stack, await start_sharded(stack))

    async def broke() -> None:  # a round that broke after its kill
        for worker in stack.workers:
            if worker.process is None or worker.process.poll() is not None:
                worker.start()

    return await measured(stack.plan.rounds, case.round, broke)
