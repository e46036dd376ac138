"""One fault run: two `fleet worker` processes serving the fault engine against a Broker, N
tasks published through JetStream, a fault injected by the test, then a bounded wait for
every terminal and a count from what FLEET_OUT stored.

The fault engine (a plumbing double, see fleet/runner/fault_engine.py) makes exactly
`tokens` numbered tokens per task at a fixed pace, so a completed task's stored stream can be
checked token by token and the load lasts a known time without spending the 2 cores on maths.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import api

from fleet.bus.provision import provision
from fleet.bus.retry import with_retry
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_events
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.faults.servers import Broker, connect_client, replicas_of, until_jetstream
from tests.faults.tally import FaultCounts, Stored, history, tally
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    place_and_wait,
    submit,
    wait_node,
)

MODEL = "fault-llm"
RETURN_DEADLINE_S = 60.0  # the bar: every task finished within 60 s of the return
CHECK_STORE_S = 3.0  # re-read the store this often: live terminals can pass a disconnected client
_VARYING = re.compile(r"[0-9a-f]{6,}|\d+")
_ERROR_LINE = re.compile(r"Traceback|ERROR|CRITICAL|Error:|exited|left|stopping", re.IGNORECASE)


@dataclass(frozen=True)
class Load:
    tasks: int
    tokens: int  # the longest task's tokens; task i makes tokens - (i % 5) * tokens // 10
    delay_ms: int  # per engine step: one task lasts about tokens * delay_ms
    slots: int = 4  # per runner; two runners
    workers: int = 2

    def tokens_of(self, index: int) -> int:
        """Lengths differ, so tasks end at staggered times and any outage cuts some mid-stream
        and some at their terminal publish."""
        return self.tokens - (index % 5) * self.tokens // 10


@dataclass
class FaultReport:
    """What a test asserts on and prints: the counts plus what explains them."""

    counts: FaultCounts
    replicas: int
    queued_at_end: int = 0  # task messages still in FLEET_TASKS (unacked or never taken)
    unfinished_at_fault: list[int] = field(default_factory=list)
    worker_exits: list[int | None] = field(default_factory=list)
    worker_log_lines: list[str] = field(default_factory=list)
    timeline: list[tuple[str, float]] = field(default_factory=list)
    histories: dict[str, str] = field(default_factory=dict)  # example task id -> its story


async def provision_with(nc: Client, replicas: int) -> None:
    """Provision at `replicas` when provisioning takes a replica count (being added for the
    issue); an older provision() makes R1 streams, which the report then shows."""
    params = inspect.signature(provision).parameters
    if "replicas" in params:
        await provision(nc, replicas=replicas)  # type: ignore[call-arg]
    else:
        await provision(nc)


class FaultRun:
    def __init__(
        self, broker: Broker, root: Path, load: Load, replicas: int = 1, avoid: str | None = None
    ) -> None:
        """`avoid`: a server the workers and the test's client do not connect to (a scenario
        that hurts only the broker's groups there, not the connections)."""
        self.avoid = avoid
        # The workers' AckWait: 30 s measures the broker alone; a scenario that wants paused
        # connections taken over (the seam under a broker fault) sets the default 2 s.
        self.ack_wait_s = 30.0
        self.broker = broker
        self.root = root
        self.load = load
        self.replicas = replicas
        run_id = int(time.time() * 1000) % 100000
        self.expected = {f"f{i:04d}-{run_id}": load.tokens_of(i) for i in range(load.tasks)}
        self.task_ids = list(self.expected)
        self.workers: list[WorkerProcess] = []
        self.accepted: set[str] = set()
        self.finished: set[str] = set()
        self.changed = asyncio.Event()
        self.unfinished_at_fault: list[int] = []
        self.started = time.monotonic()
        self.marks: list[tuple[str, float]] = []  # (what happened, seconds since the start)
        self.arrivals: dict[str, list[float]] = {}  # task id -> monotonic time of each event

    # ---- set-up ------------------------------------------------------------------------

    async def start(self, seeded_dir: Path | None = None) -> None:
        self.nc = await connect_client(self.broker, avoid=self.avoid)
        await until_jetstream(self.nc)
        await provision_with(self.nc, self.replicas)
        # These runs stop, pause and kill broker servers, never a worker: a worker whose server
        # is paused for longer than a 2 s AckWait (the default) is taken over although it
        # lives (issue 24's seam), which most of these runs do not measure: with 30 s the
        # broker's faults are measured alone. The seam under a paused FLEET_OUT leader (once a
        # gap, fixed) has its own run at 2 s (`ack_wait_s`).
        env = {"FLEET_REPLICAS": str(self.replicas), "FLEET_SLOTS": str(self.load.slots),
               "FLEET_ACK_WAIT_S": str(self.ack_wait_s)}
        for index in range(self.load.workers):
            data_dir = self.root / f"w{index + 1}"
            card = add_fault_card(data_dir)
            urls = ",".join(url for name, url in self.broker.named_urls() if name != self.avoid)
            self.workers.append(WorkerProcess(urls, data_dir, **env).start())
        for worker in self.workers:
            node = await wait_node(self.nc, worker.data_dir, timeout=60)
            await place_and_wait(self.nc, card, node, slots=self.load.slots, timeout=60)
        await self.nc.subscribe("fleet.out.*", cb=self._on_event)
        self.mark("workers_ready")

    def mark(self, name: str) -> None:
        self.marks.append((name, round(time.monotonic() - self.started, 2)))

    async def _on_event(self, msg: Msg) -> None:
        task_id = msg.subject.rsplit(".", 1)[-1]
        self.arrivals.setdefault(task_id, []).append(time.monotonic())
        if b'"type":"task_finished"' in msg.data:
            self.finished.add(task_id)
            self.changed.set()
        elif b'"type":"task_accepted"' in msg.data:
            self.accepted.add(task_id)
            self.changed.set()

    async def publish(self, only: list[str] | None = None) -> None:
        """Publish the run's tasks (`only` those, when given)."""
        for task_id, tokens in self.expected.items():
            if only is not None and task_id not in only:
                continue
            knobs = f"tokens:{tokens} delay_ms:{self.load.delay_ms}"
            await submit(self.nc, TextGeneration(
                task_id=task_id, model=MODEL, max_tokens=tokens, temperature=0.0,
                messages=[ChatMessage(role="user", content=knobs)],
            ))
        self.mark("published")

    async def until_busy(self, timeout: float = 60.0) -> None:
        """Every slot of every runner has had a task and a few have ended: the fault lands in
        a steady, staggered load (some tasks mid-stream, some at their terminal)."""
        busy = min(self.load.tasks, self.load.slots * self.load.workers)
        async with asyncio.timeout(timeout):
            while len(self.accepted) < busy or len(self.finished) < 2:
                self.changed.clear()
                await self.changed.wait()
        self.mark("busy")

    def fault_now(self, name: str) -> None:
        """Called by a scenario as it injects a fault: how many tasks were still open."""
        self.unfinished_at_fault.append(len(set(self.task_ids) - self.finished))
        self.mark(name)

    # ---- the end -----------------------------------------------------------------------

    async def until_finished(
        self, returned_at: float, deadline_s: float = RETURN_DEADLINE_S
    ) -> None:
        """Wait until FLEET_OUT holds a terminal for every task, or the deadline passes.

        Woken by each live terminal; the store is read again at least every CHECK_STORE_S,
        since a terminal published while this client reconnected never arrives live."""
        until = time.monotonic() + max(0.0, returned_at + deadline_s - time.time())
        wanted = set(self.task_ids)
        while (remaining := until - time.monotonic()) > 0:
            if wanted <= self.finished:  # live says all ended: the store must agree
                with contextlib.suppress(NatsError, TimeoutError):
                    stored = await self._read_out_once()
                    self.finished = {t for t in wanted if _has_terminal(stored.get(t, []))}
                    if self.finished == wanted:
                        break
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(CHECK_STORE_S, remaining))
                continue
            except TimeoutError:
                pass
            with contextlib.suppress(NatsError, TimeoutError):  # quiet a while: ask the store
                stored = await self._read_out_once()
                self.finished |= {t for t in wanted if _has_terminal(stored.get(t, []))}
        self.mark("finished_wait")

    async def read_out(self) -> dict[str, list[Stored]]:
        """Every event FLEET_OUT stores for this run's tasks, in stream order, read through
        one counted pull-consumer snapshot (the count is fixed when it is created). A read
        the cluster answers 503 (a consumer created just after leaders moved may have none
        yet) starts again whole with a new snapshot: nothing read by the failed one counts."""
        return await with_retry(self._read_out_once, what="read FLEET_OUT", budget_s=60.0)

    async def _read_out_once(self) -> dict[str, list[Stored]]:
        js = self.nc.jetstream()
        consumer = await js.add_consumer(subjects.OUT_STREAM, api.ConsumerConfig(
            filter_subject="fleet.out.>", deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True,
        ))
        assert consumer.name is not None
        remaining = consumer.num_pending or 0
        found: dict[str, list[Stored]] = {}
        ours = set(self.task_ids)
        sub = await js.pull_subscribe_bind(consumer=consumer.name, stream=subjects.OUT_STREAM)
        try:
            while remaining > 0:
                for msg in await sub.fetch(min(remaining, 1000), timeout=5.0):
                    remaining -= 1
                    task_id = msg.subject.rsplit(".", 1)[-1]
                    if task_id not in ours:
                        continue
                    with contextlib.suppress(DecodeError):  # a terminal: its last tokens too
                        found.setdefault(task_id, []).extend(Stored(
                            event, msg.metadata.timestamp.timestamp(),
                            msg.metadata.sequence.stream,
                        ) for event in decode_events(msg.data))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await js.delete_consumer(subjects.OUT_STREAM, consumer.name)
        return found

    async def report(self, returned_at: float) -> FaultReport:
        """The counts from the store, and each worker's fate."""
        await until_jetstream(self.nc, (subjects.OUT_STREAM,))
        stored = await self.read_out()
        counts = tally(
            self.expected, stored, returned_at=returned_at, deadline_s=RETURN_DEADLINE_S,
        )
        exits = [w.process.poll() if w.process else None for w in self.workers]
        counts.workers_dead = sum(code is not None for code in exits)
        queue = await with_retry(lambda: self.nc.jetstream().stream_info(subjects.TASKS_STREAM),
                                 what="read FLEET_TASKS", budget_s=60.0)
        return FaultReport(
            counts=counts, replicas=await replicas_of(self.nc, subjects.OUT_STREAM),
            queued_at_end=queue.state.messages,
            unfinished_at_fault=self.unfinished_at_fault, worker_exits=exits,
            worker_log_lines=self.log_lines(), timeline=list(self.marks),
            histories={
                task_id: history(stored.get(task_id, []), returned_at)
                for ids in counts.examples.values() for task_id in ids[:3] if task_id in stored
            },
        )

    def log_lines(self, limit: int = 40) -> list[str]:
        """The workers' lines that explain a failure (errors, tracebacks, node changes), each
        kind once: a line that differs from an earlier one only in numbers and ids is skipped."""
        lines: list[str] = []
        seen: set[str] = set()
        for worker in self.workers:
            for line in worker.log().splitlines():
                kind = _VARYING.sub("#", line[24:])  # past the timestamp
                if _ERROR_LINE.search(line) and kind not in seen and len(lines) < limit:
                    seen.add(kind)
                    lines.append(f"{worker.data_dir.name}: {line[:300]}")
        return lines

    async def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), 5)


def _has_terminal(events: list[Stored]) -> bool:
    return any(s.event.type == "task_finished" for s in events)
