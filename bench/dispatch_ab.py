"""Dispatch A/B in one run: two checkouts' `fleet up`, side by side (issue 23).

    python -m bench.dispatch_ab BASE_CHECKOUT NEW_CHECKOUT [--tasks 400] [--batch 1000]
                                [--rounds 6] [--gap 0.02] [--gap 0 ...]

On a shared machine two runs one after the other moved more than a change did (a quick
plumbing-rate run read 20.8 and then 13.4 ms for the same commit). Here both stacks run at
once, each a `fleet up` of the fault engine with 64 slots started from its own checkout (a
`git worktree add` of the base commit, say), and the load falls on both alike: tasks of
max_tokens 1 go to them one at a time, each pair in a drawn order (publish ->
`task_accepted`), then batches published at once alternate (tasks/s, and the CPU of `fleet up`
a task).

`--gap`: the pause before each timed task (repeatable: each gap timed, interleaved). 0 sends
a side's next task as soon as its last one finished (less the other side's turn), as
plumbing-rate's accept measure does; a cycle shorter than a timer on the worker's path (the
10 ms listing gap that cost plumbing-rate ~4 ms an accept, 20ca43b) shows only there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from nats.aio.client import Client

from bench.fleet_stack import FleetStack
from bench.plumbing_rate import (
    MODEL,
    SLOTS,
    STREAM_TIMEOUT_S,
    RawEvents,
    _task,
    room_for,
    seed_fault_card,
)
from bench.workload import percentile
from fleet.bus.task_queue import TaskQueue
from fleet.wire import subjects
from fleet.wire.codec import encode

WARM_TASKS = 5
GAP_S = 0.02  # between accepts: one task at a time, the worker idle when the next comes
ORDER_SEED = 23  # the side order of each task pair: the same draw every run


class Side:
    def __init__(self, checkout: Path) -> None:
        data_dir = Path(tempfile.mkdtemp(prefix="dispatch-ab-")) / "fleet-data"
        seed_fault_card(data_dir)
        env = dict(os.environ, PYTHONPATH=str(checkout), MLX_DISABLE_COMPILE="1",
                   OPENBLAS_NUM_THREADS="1")
        self.stack = FleetStack(data_dir, [MODEL], SLOTS, env, cwd=checkout)
        self.events = RawEvents()
        self.accepts: dict[float, list[float]] = {}  # gap before the task -> latencies
        self.rates: list[float] = []
        self.cpu_us: list[float] = []
        self.others_us: dict[str, list[float]] = {}  # nats-server, the runner: CPU a task
        self.stored: dict[str, list[float]] = {}  # stream -> messages it stored a task

    async def start(self) -> Client:
        self.nc = await self.stack.start()
        await self.nc.subscribe("fleet.out.*", cb=self.events.on_msg,
                                pending_msgs_limit=1_000_000)
        return self.nc

    async def accept(self) -> float:
        task_id = f"ab-{secrets.token_hex(8)}"
        done = self.events.waiter(task_id)
        began = time.perf_counter()
        await self.nc.jetstream().publish(subjects.tasks(MODEL), encode(_task(task_id, 1)),
                                          headers={"Nats-Msg-Id": task_id})
        await asyncio.wait_for(done, STREAM_TIMEOUT_S)
        return self.events.accepted[task_id] - began

    async def batch(self, tasks: int) -> None:
        # The last batch's terminals came before its acks: wait until this one fits under
        # FLEET_TASKS's per-subject cap, or its last publishes are refused (err 10077).
        await room_for(TaskQueue(self.nc), tasks, STREAM_TIMEOUT_S)
        processes = self.stack.processes()
        up: psutil.Process = processes["up"]
        cpu = sum(up.cpu_times()[:2])
        others = {name.split(":")[0]: (p, sum(p.cpu_times()[:2]))
                  for name, p in processes.items() if name != "up"}
        streams = await self._last_seqs()
        ids = [f"ab-{secrets.token_hex(8)}" for _ in range(tasks)]
        waiters = [self.events.waiter(task_id) for task_id in ids]
        js = self.nc.jetstream()
        began = time.perf_counter()
        acks = [await js.publish_async(subjects.tasks(MODEL), encode(_task(task_id, 1)),
                                       headers={"Nats-Msg-Id": task_id}) for task_id in ids]
        await asyncio.wait_for(asyncio.gather(*acks), STREAM_TIMEOUT_S)
        ended = await asyncio.wait_for(asyncio.gather(*waiters), 5 * STREAM_TIMEOUT_S)
        self.rates.append(round(tasks / (time.perf_counter() - began), 1))
        self.cpu_us.append(round(1e6 * (sum(up.cpu_times()[:2]) - cpu) / tasks))
        for name, (process, before) in others.items():
            used = sum(process.cpu_times()[:2]) - before
            self.others_us.setdefault(name, []).append(round(1e6 * used / tasks))
        for stream, seq in (await self._last_seqs()).items():
            self.stored.setdefault(stream, []).append(round((seq - streams[stream]) / tasks, 2))
        if failed := sum(1 for event in ended if event.get("status") != "completed"):
            raise RuntimeError(f"{failed} of {tasks} tasks did not complete")

    async def _last_seqs(self) -> dict[str, int]:
        """Each stream's last sequence: what a batch stored, per stream (spans, events...)."""
        js = self.nc.jetstream()
        return {info.config.name: info.state.last_seq for info in await js.streams_info()}

    def summary(self) -> dict[str, Any]:
        def ms(found: list[float], q: float) -> float | None:
            value = percentile(found, q)
            return None if value is None else round(1000 * value, 2)

        mean = round(sum(self.rates) / len(self.rates), 1) if self.rates else None
        accepts = {f"gap_{round(gap * 1000)}ms": {f"p{q}_ms": ms(found, q) for q in (50, 90, 99)}
                   for gap, found in self.accepts.items()}
        return {"accept": accepts, "tasks_per_s": self.rates, "tasks_per_s_mean": mean,
                "up_cpu_us_per_task": self.cpu_us, "other_cpu_us_per_task": self.others_us,
                "stored_per_task": {stream: per_task for stream, per_task in self.stored.items()
                                    if any(per_task)}}


async def run(base: Path, new: Path, tasks: int, batch: int, rounds: int,
              gaps: list[float]) -> dict[str, Any]:
    sides = [Side(base), Side(new)]
    try:
        for side in sides:
            await side.start()
            for _ in range(WARM_TASKS):
                await side.accept()
        # Which side goes first is drawn for each task pair: a stack whose own task ended
        # just before (its loop awake) accepts ~0.4 ms sooner back to back, and the fixed
        # alternation this replaced gave that to the base side only (A/A runs read the new
        # side 0.4-0.5 ms slower at gap 0, nothing at 20 ms; 2026-12-06).
        order = random.Random(ORDER_SEED)
        for i in range(tasks):
            for gap in gaps if i % 2 == 0 else gaps[::-1]:
                for side in order.sample(sides, len(sides)):
                    if gap:
                        await asyncio.sleep(gap)  # pacing the publisher, not synchronisation
                    side.accepts.setdefault(gap, []).append(await side.accept())
        for i in range(rounds if batch else 0):
            for side in sides if i % 2 == 0 else sides[::-1]:
                await side.batch(batch)
        return {"base": {"checkout": str(base), **sides[0].summary()},
                "new": {"checkout": str(new), **sides[1].summary()},
                "load_average": [round(x, 2) for x in os.getloadavg()]}
    finally:
        for side in sides:
            if side.stack.process is not None:
                await side.stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="checkout of the base (a git worktree)")
    parser.add_argument("new", type=Path, help="checkout of the change")
    parser.add_argument("--tasks", type=int, default=400, help="accepts timed per side")
    parser.add_argument("--batch", type=int, default=1000, help="tasks a batch (0: none)")
    parser.add_argument("--rounds", type=int, default=6, help="batches per side")
    parser.add_argument("--gap", type=float, action="append",
                        help=f"seconds before each timed task, repeatable (default {GAP_S})")
    args = parser.parse_args()
    result = asyncio.run(run(args.base.resolve(), args.new.resolve(), args.tasks, args.batch,
                             args.rounds, args.gap or [GAP_S]))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
