"""`fleet bench --only seam`: what a fault costs the user, measured at the client as the time
from the fault to the next token of the continued answer.

Two `fleet worker` processes (each with its runner, the model placed on both) against one
nats-server. Each round submits a long greedy answer (end of sequence banned), waits until the
client has seen `kill_at` tokens, then applies the fault to whatever serves it:

    worker_kill    SIGKILL of the worker's process group (worker and runner, a power loss);
                   the other worker's runner of the model is ready
    worker_kill_cold  the same, with the model placed on the victim alone: failover moves it
                   to the other node (no model there, its standby runner warm: a spare), whose
                   runner must start and load it first. Each row also says when that runner
                   was ready (`spare_ready_s`): the target is the seam <= that start + 3 s
    runner_kill    SIGKILL of the runner only (its worker alive)
    worker_pause   SIGSTOP of the worker process for `pause_s`, then SIGCONT: with AckWait
                   (30 s) longer than the pause nobody takes it over (the death watch sees a
                   paused worker as alive), and the seam is the pause; with a shorter AckWait
                   another worker takes it over and the resumed one must write nothing more

    sharded_kill   SIGKILL of the worker of rank 0 or rank 1 (alternately) of a 2-shard
                   instance, a third worker a spare (bench/seam_sharded.py; run last)

and reads the task's whole stored stream back to count gaps, duplicates and lost answers. The
killed process is restarted as soon as the seam is measured (its start overlaps the rest of
the answer), and its runner waited for, before the next round. `false takeovers`: answers run
beside CPU hogs (no fault) whose task was continued anyway. Every row says how long its round
took (`round_s`), every case its cost a fault (`per_fault_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from bench.fleet_stack import seed_data_dir
from bench.procs import free_port
from fleet.bus.connect import connect, js_publish
from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import provision
from fleet.errors import InvalidRequest
from fleet.models.catalog import get_card
from fleet.placement import place, read_instances, remove
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo, RunnerRecord
from fleet.wire.codec import DecodeError, decode_events, decode_model
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.continuation import stored_events

log = logging.getLogger(__name__)

READY_S = 300.0  # a worker start plus a model load, on a loaded machine
ROUND_S = 120.0
STORED_WAIT_S = 10.0
COLD = "worker_kill_cold"
# Why a round is run again (bench/README.md, Seam): its answer ended before the client saw
# `kill_at` tokens, or the fault came after the answer's last token was made (the continued
# attempt had none left to make: no seam). Either way the client, on a loaded box, was behind
# the answer by more than its remaining tokens took to make.
EARLY = "finished before the fault"
MADE_WHOLE = "made whole before the fault"
SHARDED = "sharded_kill"  # bench/seam_sharded.py; last: it adds a node and shards the model
CASES = ("worker_kill", "runner_kill", "worker_pause", COLD, SHARDED)


@dataclass
class SeamPlan:
    rounds: int = 20  # faults per case
    max_tokens: int = 60  # 30 after the fault: enough to judge the stream, not minutes
    kill_at: int = 30  # tokens the client has seen when the fault comes
    pause_s: float = 10.0
    sharded_kill_at: int = 10  # a 2-shard decode is slower; the seam is the group's re-form
    # 50 tokens after the fault. tiny-llm makes them in ~0.2 s, and the client (the bench,
    # on the loaded box) can be further behind: such a round ends before its fault (EARLY,
    # MADE_WHOLE) and is run again (`measured`), cheaper than a longer answer every round.
    sharded_max_tokens: int = 60
    ack_wait_s: float = 30.0  # the default: a dead worker is seen by the death watch
    load_tasks: int = 20  # answers run beside the CPU hogs, no fault
    load_concurrency: int = 4
    hogs: int = 8
    load_target: float = 8.0  # the 1-minute load average the hogs reach before the answers
    load_wait_s: float = 150.0  # at most this long


@dataclass
class Worker:
    name: str
    data_dir: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # wall time of the last start: its heartbeats' `started_at` follow

    def start(self) -> None:
        log = (self.data_dir / "worker.log").open("ab")
        self.started = time.time()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "--log-level", "info", "worker"], env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    @property
    def node_id(self) -> str:
        return (self.data_dir / "node_id").read_text().strip()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@dataclass
class Watch:
    """One task's events as a core subscriber sees them, with arrival times."""

    events: list[tuple[float, OutputEvent]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # unix time of each event's arrival: against an event's own `at` (when it was made), how
    # far the client is behind the answer
    walls: list[float] = field(default_factory=list)

    async def on_msg(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            now, wall = time.monotonic(), time.time()
            for event in decode_events(msg.data):  # a terminal may carry the last tokens
                self.events.append((now, event))
                self.walls.append(wall)
            self.changed.set()

    async def until(self, check: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := check()):
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(),
                                       max(0.01, deadline - time.monotonic()))
            except TimeoutError:  # say what the task did: a bare timeout told nothing
                attempts = [(a.attempt, a.node_id) for a in self.accepted()]
                raise TimeoutError(
                    f"{timeout:.0f} s without what the round waits for: the task had "
                    f"{self.tokens()} tokens, attempts {attempts}, finished {self.done()}"
                ) from None
        return found

    def tokens(self) -> int:
        return sum(e.count for _, e in self.events if isinstance(e, TokenChunk))

    def accepted(self) -> list[TaskAccepted]:
        return [e for _, e in self.events if isinstance(e, TaskAccepted)]

    def done(self) -> bool:
        return any(isinstance(e, TaskFinished) for _, e in self.events)

    def ending(self) -> dict[str, Any]:
        """How the task ended, for a round whose answer ended before its fault took effect:
        its terminal, how long its tokens took to make (`made_s`, first to last token's
        `at`), and how far behind them the client was (`behind_s`, the most any token event
        arrived after it was made). An answer made whole in less time than the client was
        behind ends before the client has seen `kill_at` tokens."""
        ends = [e for _, e in self.events if isinstance(e, TaskFinished)]
        end = ends[-1] if ends else None
        chunks = [(wall, e) for wall, (_, e) in zip(self.walls, self.events, strict=True)
                  if isinstance(e, TokenChunk)]
        return {"tokens": self.tokens(), "status": end and end.status,
                "finish_reason": end and end.finish_reason, "reason": end and end.reason,
                "message": end and end.message, "chunks": len(chunks),
                "made_s": round(chunks[-1][1].at - chunks[0][1].at, 3) if chunks else None,
                "behind_s": round(max(wall - e.at for wall, e in chunks), 3) if chunks else None}

    def next_token_after(self, at: float) -> float | None:
        """The first token after `at` of a later attempt than the one that was running."""
        attempts = len([1 for t, e in self.events if isinstance(e, TaskAccepted) and t <= at])
        seen = attempts
        for arrived, event in self.events:
            if isinstance(event, TaskAccepted):
                seen = max(seen, event.attempt + 1)
            elif isinstance(event, TokenChunk) and arrived > at and seen > attempts:
                return arrived
        return None

    def next_token_any_after(self, at: float) -> float | None:
        """The first token after `at`, of whichever attempt."""
        return next((arrived for arrived, event in self.events
                     if isinstance(event, TokenChunk) and arrived > at), None)


def judge(events: list[OutputEvent], max_tokens: int) -> dict[str, int]:
    """Gaps, duplicates and lost answers in a task's stored stream."""
    indexes = [e.index + k for e in events if isinstance(e, TokenChunk) for k in range(e.count)]
    terminals = [e for e in events if isinstance(e, TaskFinished)]
    completed = len(terminals) == 1 and terminals[0].status == "completed"
    return {
        "gaps": len(set(range(max(indexes, default=-1) + 1)) - set(indexes)),
        "duplicates": len(indexes) - len(set(indexes)),
        "lost": 0 if completed and len(set(indexes)) == max_tokens else 1,
        "terminals": len(terminals),
    }


async def until_entry(
    nc: Client, bucket: str, matches: Callable[[KeyValue.Entry], bool], deadline: float,
    failure: str,
) -> None:
    """Watch `bucket` (its current entries, then its updates) until `matches` says yes to one;
    TimeoutError(`failure`) at `deadline` (monotonic)."""
    kv = await nc.jetstream().key_value(bucket)
    watcher = await kv.watchall()
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await watcher.updates(timeout=min(left, 1.0))
            except TimeoutError:
                continue
            if entry is not None and matches(entry):
                return
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watcher.stop(), 5)
    raise TimeoutError(failure)


class SeamStack:
    def __init__(self, workdir: Path, env: dict[str, str], model: str, path: Path,
                 plan: SeamPlan) -> None:
        self.workdir, self.model, self.plan = workdir, model, plan
        self.path, self.env = path, env
        self.server = EmbeddedNats(workdir / "nats", port=free_port())
        self.workers = [self.worker(name) for name in ("a", "b")]
        self.eos = _eos_ids(path)
        self.nc: Client | None = None
        self.dead_runners: set[str] = set()

    def worker(self, name: str) -> Worker:
        data_dir = self.workdir / name
        seed_data_dir(data_dir, {self.model: self.path}, {})
        return Worker(name, data_dir, {
            **self.env, "FLEET_NATS_URL": self.server.url, "FLEET_DATA_DIR": str(data_dir),
            "FLEET_AUTO_PLACE": "0", "FLEET_ACK_WAIT_S": str(self.plan.ack_wait_s),
        })

    async def start(self) -> Client:
        await asyncio.to_thread(self.server.start)
        self.nc = await connect(self.server.url, "fleet-bench-seam")
        await provision(self.nc)
        for worker in self.workers:
            worker.start()
        for worker in self.workers:
            await self.serving(worker)
        return self.nc

    async def serving(self, worker: Worker) -> None:
        """Wait for the worker's own heartbeat, place the model there (once), wait for its
        runner."""
        assert self.nc is not None
        deadline = time.monotonic() + READY_S
        await self.beating(worker, deadline)
        await self.one_instance_on(worker.node_id, deadline)
        try:
            await self.runner_ready(worker.node_id, deadline)
        except TimeoutError as exc:  # say where the model is: what the wait could not see
            where = [(i.instance_id, [s.node_id for s in i.shards])
                     for i in await read_instances(self.nc.jetstream())
                     if i.model == self.model]
            raise TimeoutError(f"{exc}; instances of {self.model} now: {where}") from None

    async def beating(self, worker: Worker, deadline: float) -> None:
        """Until a heartbeat of the worker's current process is in FLEET_NODES. A restarted
        worker's node id is known at once (its data dir keeps it), and its dead predecessor's
        key outlives it by up to the TTL (15 s): a model placed there before the new process
        beats lands on a node the death watch declared dead, and the sweeper moves it to the
        other node within a sweep (5 s). That is what broke the quiet smollm2 run after its
        cold case: the bench waited 300 s for a runner on a node that no longer held the
        model (and the restarted worker printed its dead predecessor's last record, 'runner
        ... is ready', from FLEET_RUNNERS)."""
        assert self.nc is not None
        while not (worker.data_dir / "node_id").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker.name} never wrote its node id")
            await asyncio.sleep(0.1)  # polling a starting process, bounded by the deadline
        node_id = worker.node_id
        await until_entry(
            self.nc, subjects.NODES_BUCKET,
            lambda entry: bool(entry.value) and entry.key == node_id
            and decode_model(NodeInfo, entry.value).started_at >= worker.started,
            deadline, f"no heartbeat of worker {worker.name}'s new process on {node_id}")

    async def one_instance_on(self, node_id: str, deadline: float) -> None:
        """Exactly one instance of the model on each worker's node: a worker dead longer than
        its heartbeat's TTL has its instance moved to the survivor (failover), which then
        holds two; the bench moves it back, so every round starts alike."""
        assert self.nc is not None
        js = self.nc.jetstream()
        mine = [i for i in await read_instances(js) if i.model == self.model]
        on_node = [i for i in mine if i.shard_on(node_id) is not None]
        for node in {w.node_id for w in self.workers if (w.data_dir / "node_id").exists()}:
            for extra in [i for i in mine if i.shard_on(node) is not None][1:]:
                await remove(js, extra.instance_id)
        while not on_node:
            try:
                await place(js, get_card(self.model), node_id=node_id, slots=4)
            except InvalidRequest:  # its heartbeat is not in FLEET_NODES yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)  # polling a starting process, bounded by the deadline
                continue
            break

    async def runner_ready(self, node_id: str, deadline: float, since: float = 0.0) -> float:
        """When a ready record of the model on `node_id` came from a runner that was not
        killed (the killed ones' last records stay in FLEET_RUNNERS a while), written at or
        after `since` (unix time)."""
        assert self.nc is not None

        seen_at: list[float] = []  # as the record arrives, not after the watcher's stop

        def ready(entry: KeyValue.Entry) -> bool:
            if not entry.value:
                return False
            record = decode_model(RunnerRecord, entry.value)
            if (record.node_id == node_id and record.model == self.model
                    and record.status.state == "ready" and record.at >= since
                    and record.runner_id not in self.dead_runners):
                seen_at.append(time.monotonic())
            return bool(seen_at)

        await until_entry(self.nc, subjects.RUNNERS_BUCKET, ready, deadline,
                          f"no new runner of {self.model} became ready on {node_id}")
        return seen_at[0]

    def task(self, task_id: str, max_tokens: int = 0) -> TextGeneration:
        return TextGeneration(
            task_id=task_id, model=self.model, max_tokens=max_tokens or self.plan.max_tokens,
            temperature=0.0, logit_bias=dict.fromkeys(self.eos, -100.0),
            messages=[ChatMessage(role="user", content="Tell me a long story about the sea")],
        )

    async def only_on_one_node(self) -> None:
        """The cold case's start: the model on one node, the other a spare (no model, its
        standby runner warm, as on a node that has been up a while)."""
        assert self.nc is not None
        js = self.nc.jetstream()
        mine = [i for i in await read_instances(js) if i.model == self.model]
        for extra in mine[1:]:
            await remove(js, extra.instance_id)
        spare = next(w for w in self.workers if not any(
            i.shard_on(w.node_id) for i in mine[:1]))
        await self.standby_warm(spare, time.monotonic() + READY_S)
        await self.both_leases_held(time.monotonic() + READY_S)

    async def both_leases_held(self, deadline: float) -> None:
        """Until the sweeper and the sentinel leases are both held, as in a fleet up a while:
        a kill of the sweeper's holder right after the other worker's restart, before that
        one took the sentinel lease, is seen only when the heartbeat and lease expire (~40 s
        in a first run: two of four tiny-llm rounds)."""
        assert self.nc is not None
        held: dict[str, bytes] = {}

        def both(entry: KeyValue.Entry) -> bool:
            if entry.value and entry.operation not in ("DEL", "PURGE"):
                held[entry.key] = entry.value
            else:
                held.pop(entry.key, None)
            # Two holders: the sweeper's own stale sentinel key (given up since, but a
            # first run saw it lapse) watches nobody.
            return {"sweeper", "sentinel"} <= set(held) and held["sweeper"] != held["sentinel"]

        await until_entry(self.nc, "FLEET_LEASES", both, deadline,
                          "the sweeper and sentinel leases were not both held")

    async def standby_warm(self, worker: Worker, deadline: float) -> None:
        """Until the heartbeat of `worker`'s current process says a warm standby runner
        waits there (not its dead predecessor's key, which outlives it by up to the TTL)."""
        assert self.nc is not None
        node_id = worker.node_id

        def warm(entry: KeyValue.Entry) -> bool:
            if not entry.value or entry.key != node_id:
                return False
            info = decode_model(NodeInfo, entry.value)
            return info.standby_runner and info.started_at >= worker.started

        await until_entry(self.nc, subjects.NODES_BUCKET, warm, deadline,
                          f"no warm standby runner on {node_id}")

    async def round(self, case: str, index: int) -> dict[str, Any]:
        assert self.nc is not None
        began = time.monotonic()
        if case == COLD:
            await self.only_on_one_node()
        placed = [i for i in await read_instances(self.nc.jetstream()) if i.model == self.model]
        task = self.task(f"seam-{case}-{index}-{time.time_ns()}")
        watch = Watch()
        sub = await self.nc.subscribe(subjects.out(task.task_id), cb=watch.on_msg)
        recovery: asyncio.Task[None] | None = None
        spare_ready: asyncio.Task[float] | None = None
        try:
            await js_publish(self.nc.jetstream(), subjects.tasks(task.model), task,
                             msg_id=task.task_id)
            await watch.until(lambda: watch.tokens() >= self.plan.kill_at or watch.done(),
                              ROUND_S)
            if watch.done():
                return {"rerun": EARLY, **watch.ending()}
            running = watch.accepted()[-1]
            victim = next(w for w in self.workers if w.node_id == running.node_id)
            spare = next(w for w in self.workers if w is not victim)
            spare_ready = asyncio.create_task(self.runner_ready(
                spare.node_id, time.monotonic() + ROUND_S, since=time.time()))
            faulted_at = time.monotonic()
            await self.fault(case, victim, running.runner_id)
            if case != "worker_pause":
                self.dead_runners.add(running.runner_id)
            if case == "worker_pause" and self.plan.ack_wait_s > self.plan.pause_s:
                # Nobody takes a paused worker's task: it streams on when it resumes.
                await self.resume(victim, faulted_at)
                resumed = await watch.until(lambda: watch.next_token_any_after(faulted_at),
                                            ROUND_S)
            else:
                await watch.until(
                    lambda: watch.next_token_after(faulted_at) or watch.done(), ROUND_S)
                if case == "worker_pause":
                    await self.resume(victim, faulted_at)
                resumed = watch.next_token_after(faulted_at)  # None: made whole before it
            # The seam is measured: the recovery (the victim's start, its imports, its
            # runner's load) overlaps the rest of the answer instead of following it.
            recovery = asyncio.create_task(self.after_kill(case, victim, placed))
            await watch.until(watch.done, ROUND_S)
            await recovery
        except BaseException:
            if spare_ready is not None:  # its answer is not wanted now (nor its timeout)
                spare_ready.cancel()
            raise
        finally:
            await sub.unsubscribe()
            if recovery is not None and not recovery.done():
                recovery.cancel()
        if resumed is None:  # its continuation had no token left to make: nothing measured
            spare_ready.cancel()
            return {"rerun": MADE_WHOLE, **watch.ending()}
        stored = await self.stored(task.task_id)
        row = {"seam_s": round(resumed - faulted_at, 3), **judge(stored, self.plan.max_tokens)}
        if case == COLD:  # when the spare's new runner was ready, from the kill
            row["spare_ready_s"] = round(await spare_ready - faulted_at, 3)
        else:
            spare_ready.cancel()
        accepted = [e for e in stored if isinstance(e, TaskAccepted)]
        row["attempts"] = len(accepted)
        row["moved_from"] = accepted[-1].moved_from if accepted else None
        row["round_s"] = round(time.monotonic() - began, 1)  # the fault's whole cost, recovery in
        return row

    async def after_kill(self, case: str, victim: Worker, placed: list[Instance]) -> None:
        """The victim's recovery after its fault (the worker pause has none)."""
        if case in ("worker_kill", COLD):
            victim.start()
        if case == "worker_kill":
            await self.refill(victim, [i.instance_id for i in placed
                                       if i.shard_on(victim.node_id)])
        elif case == "runner_kill":
            await self.serving(victim)

    async def stored(self, task_id: str) -> list[OutputEvent]:
        """The task's stored events, once its terminal is stored: a core subscriber can see
        the terminal before the stream has stored it (one run counted a task lost that way)."""
        assert self.nc is not None
        deadline = time.monotonic() + STORED_WAIT_S
        while True:
            events = await stored_events(self.nc, self.nc.jetstream(), task_id)
            if any(isinstance(e, TaskFinished) for e in events) or time.monotonic() > deadline:
                return events
            await asyncio.sleep(0.2)  # polling the stream, bounded by the deadline

    async def fault(self, case: str, victim: Worker, runner_id: str) -> None:
        assert victim.process is not None
        match case:
            case "worker_kill" | "worker_kill_cold":
                victim.kill()
            case "runner_kill":
                os.kill(_runner_pid(runner_id), signal.SIGKILL)
            case "worker_pause":
                os.kill(victim.process.pid, signal.SIGSTOP)  # the worker only

    async def resume(self, victim: Worker, paused_at: float) -> None:
        assert victim.process is not None
        # The pause's length is the fault itself, not a wait for something.
        await asyncio.sleep(max(0.0, paused_at + self.plan.pause_s - time.monotonic()))
        os.kill(victim.process.pid, signal.SIGCONT)

    async def refill(self, victim: Worker, moved: list[str]) -> None:
        """After a worker kill, back to one instance a node: the victim's instances, which
        failover moved to the survivor (whose runner for them would load for nothing, beside
        the continuation), are removed, and a new one is placed on the victim once its new
        process beats. The continuation runs on the survivor's own runner, which stays."""
        assert self.nc is not None
        js = self.nc.jetstream()
        for instance_id in moved:
            await remove(js, instance_id)
        await self.serving(victim)

    async def revive(self) -> None:
        """After a round that broke: a worker it left dead is started and served again."""
        for worker in self.workers:
            if worker.process is None or worker.process.poll() is not None:
                worker.start()
                with contextlib.suppress(Exception):
                    await self.serving(worker)

    async def stop(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 5)
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.process.pid, signal.SIGCONT)
            worker.kill()
        await asyncio.to_thread(self.server.stop)


async def false_takeovers(stack: SeamStack) -> dict[str, Any]:
    """Answers beside CPU hogs, no fault: how many were taken over all the same."""
    assert stack.nc is not None
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(stack.plan.hogs)]
    try:
        deadline = time.monotonic() + stack.plan.load_wait_s
        while os.getloadavg()[0] < stack.plan.load_target and time.monotonic() < deadline:
            await asyncio.sleep(1.0)  # the load average is a 1-minute mean: let it climb
        load_before = os.getloadavg()[0]
        began = time.monotonic()
        taken_over = 0
        # A few at a time (a worker's slots run them side by side): each answer under load
        # is what a death watch could misjudge, and one by one they took minutes of smollm2.
        for first in range(0, stack.plan.load_tasks, stack.plan.load_concurrency):
            batch = range(first, min(stack.plan.load_tasks, first + stack.plan.load_concurrency))
            watches = await asyncio.gather(*(loaded_answer(stack, index) for index in batch))
            taken_over += sum(len(watch.accepted()) > 1 for watch in watches)
        return {"tasks": stack.plan.load_tasks, "taken_over": taken_over,
                "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                "answers_s": round(time.monotonic() - began, 1)}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


async def loaded_answer(stack: SeamStack, index: int) -> Watch:
    """One answer, no fault, to its end: its events."""
    assert stack.nc is not None
    task = stack.task(f"seam-load-{index}-{time.time_ns()}")
    watch = Watch()
    sub = await stack.nc.subscribe(subjects.out(task.task_id), cb=watch.on_msg)
    try:
        await js_publish(stack.nc.jetstream(), subjects.tasks(task.model), task,
                         msg_id=task.task_id)
        await watch.until(watch.done, ROUND_S)
    finally:
        await sub.unsubscribe()
    return watch


async def run_seam(
    model: str, path: Path, plan: SeamPlan, workdir: Path, env: dict[str, str],
    cases: tuple[str, ...] = CASES,
) -> dict[str, Any]:
    """The seam of every case on `model` (a catalogue model: tiny-llm, smollm2-135m)."""
    from bench.seam_sharded import run_sharded

    stack = SeamStack(workdir / f"seam-{model}", env, model, path, plan)
    result: dict[str, Any] = {"model": model, "plan": plan.__dict__, "cases": {}}
    unsharded = [case for case in cases if case != SHARDED]
    try:
        await stack.start()
        for case in unsharded:
            began = time.monotonic()
            rows = await measured(
                plan.rounds, lambda index, case=case: stack.round(case, index), stack.revive)
            result["cases"][case] = summarise(rows, time.monotonic() - began)
            if case == COLD and (case != unsharded[-1] or plan.load_tasks):
                # Back to one instance on each node for what follows.
                try:
                    for worker in stack.workers:
                        await stack.serving(worker)
                except TimeoutError as exc:
                    # The cases measured so far are kept (a smollm2 run of 20 faults a
                    # case lost 27 minutes of them here); what follows needs both nodes.
                    result["recovery_error"] = str(exc)
                    log.error("seam: after %s: %s; the rest of the cases are skipped", case,
                              exc)
                    return result
        if plan.load_tasks:
            result["false_takeovers"] = await false_takeovers(stack)
        if SHARDED in cases:
            began = time.monotonic()
            rows = await run_sharded(stack)
            result["cases"][SHARDED] = summarise(rows, time.monotonic() - began)
    finally:
        await stack.stop()
    return result


async def measured(
    rounds: int, one: Callable[[int], Awaitable[dict[str, Any]]],
    broke: Callable[[], Awaitable[None]],
) -> list[dict[str, Any]]:
    """The rows of `rounds` faults of a case. A round that broke is a row with its error (a
    finding, not the end: `broke` restores the stack). A round that measured nothing because
    its answer was done before its fault (`rerun`: EARLY, MADE_WHOLE) is run again with the
    same index, at most `rounds` times in all (then it stays, as an error): its row is kept,
    marked, so the case says how many were re-run and why."""
    rows: list[dict[str, Any]] = []
    reruns = 0
    while (index := sum("rerun" not in row for row in rows)) < rounds:
        try:
            row = await one(index)
        except Exception as exc:
            row = {"error": f"{type(exc).__name__}: {exc}"}
            await broke()
        if "rerun" in row:
            if reruns < rounds:
                reruns += 1
            else:
                row = {"error": row.pop("rerun"), **row}
        rows.append({"round": index, **row})
    return rows


def summarise(all_rows: list[dict[str, Any]], elapsed_s: float = 0.0) -> dict[str, Any]:
    rows = [r for r in all_rows if "rerun" not in r]  # a re-run round measured nothing
    reruns = [r for r in all_rows if "rerun" in r]
    seams = sorted(r["seam_s"] for r in rows if "seam_s" in r)
    return {
        "rounds": len(rows),
        # Rounds run again: their answer was done before the fault (`measured`).
        "reruns": len(reruns),
        "rerun_why": sorted({r["rerun"] for r in reruns}),
        # What a fault costs the run, its recovery and its re-runs included.
        "elapsed_s": round(elapsed_s, 1),
        "per_fault_s": round(elapsed_s / len(rows), 1) if rows else None,
        "p50_s": round(statistics.median(seams), 2) if seams else None,
        "p99_s": round(seams[min(len(seams) - 1, int(0.99 * len(seams)))], 2) if seams else None,
        "max_s": seams[-1] if seams else None,
        "gaps": sum(r.get("gaps", 0) for r in rows),
        "duplicates": sum(r.get("duplicates", 0) for r in rows),
        "lost": sum(r.get("lost", 0) for r in rows if "seam_s" in r),
        "errors": [r["error"] for r in rows if "error" in r],
        # The cold case: the spare's runner start (kill -> ready) and what the seam added.
        **({"spare_ready_p50_s": round(statistics.median(ready), 2),
            "over_spare_ready_p50_s": round(statistics.median(
                r["seam_s"] - r["spare_ready_s"] for r in rows if "spare_ready_s" in r), 2)}
           if (ready := [r["spare_ready_s"] for r in rows if "spare_ready_s" in r]) else {}),
        # The sharded case: kill -> both ranks of the re-formed group ready.
        **({"group_ready_p50_s": round(statistics.median(grouped), 2)}
           if (grouped := [r["group_ready_s"] for r in rows if "group_ready_s" in r]) else {}),
        "rows": all_rows,
    }


def seam_table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | case | faults | p50 s | p99 s | max s | gaps | duplicates | lost | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for case, row in result["cases"].items():
            label = case
            if "spare_ready_p50_s" in row:
                label += (f" (spare's runner ready p50 {row['spare_ready_p50_s']} s after the "
                          f"kill; seam - that p50 {row['over_spare_ready_p50_s']} s)")
            if "group_ready_p50_s" in row:
                label += (f" (2 shards, rank 0/1 alternately; the group ready p50 "
                          f"{row['group_ready_p50_s']} s after the kill)")
            label += f", {row['per_fault_s']} s a fault"
            if row.get("reruns"):
                label += f"; {row['reruns']} re-run ({', '.join(row['rerun_why'])})"
            lines.append(
                f"| {result['model']} | {label} | {row['rounds']} | {row['p50_s']} | "
                f"{row['p99_s']} | {row['max_s']} | {row['gaps']} | {row['duplicates']} | "
                f"{row['lost']} | {len(row['errors'])} |"
            )
        if broke := result.get("recovery_error"):
            lines.append(f"| {result['model']} | (the rest skipped: {broke}) | | | | | | | | |")
        if load := result.get("false_takeovers"):
            lines.append(
                f"| {result['model']} | no fault, {result['plan']['hogs']} CPU hogs (load "
                f"{load['load_average'][0]}-{load['load_average'][1]}) | {load['tasks']} | | | "
                f"| | | {load['taken_over']} taken over | |"
            )
    return lines


def _eos_ids(path: Path) -> list[int]:
    import json

    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    return list(eos) if isinstance(eos, list) else [eos] if eos is not None else []


def _runner_pid(runner_id: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            line = (entry / "cmdline").read_bytes()
            if b"fleet.runner.main" in line and runner_id.encode() in line:
                return int(entry.name)
    raise LookupError(f"no process of runner {runner_id}")
