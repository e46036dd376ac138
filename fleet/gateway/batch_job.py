"""One batch job run by the gateway that holds its lease: validate the input file, feed its
lines as tasks (a window at a time, so FLEET_TASKS' per-model bound is never hit by one job),
record each line's result as it ends, then write the output and error files.

Everything it knows is in NATS, so a gateway that takes the job over (its holder died) starts
from what is recorded: lines with a result are skipped; a line published before is published
again under the same task id (`<batch_id>-<line>`): JetStream drops it as a duplicate within
its window, and after that the worker's FLEET_CLAIMS claim refuses it, so no line runs
twice; its events are read back from FLEET_OUT (replay) either way.

A line waits for its tenant's turn in the model's batch class before it is published, by the
rule gateway requests follow (fleet.gateway.fair_share, state in KV FLEET_FAIRNESS): one
tenant's big job is held while it is ahead of another tenant's job, or requests, waiting in
the same class, and each line is charged the tokens it served, once: the charge is keyed by
the line's task id in the tenant's entry (settled, then forgotten once its result is
recorded), so a gateway that takes the job over neither holds nor charges again a line its
holder had admitted or settled. A job's lines take that turn
one at a time (`feeding`), each then waiting for slack and published before the next asks: a
job admits nothing ahead of what it can publish, so a tenant whose job starts first cannot
have all its window's lines admitted before another tenant's job has joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.js.errors import APIError

from fleet.bus.batch_store import BatchStore
from fleet.bus.connect import js_publish
from fleet.bus.deadlines import publish_deadline, task_ttl_header
from fleet.bus.fairness import charged_by_publisher
from fleet.bus.task_events import Indexed
from fleet.errors import DeadlineExceeded, FleetError, QueueFull, failure_of
from fleet.gateway.backend import MAXIMUM_MESSAGES_EXCEEDED
from fleet.gateway.batch_lines import (
    InputLine,
    counts,
    expired_body,
    final_status,
    parse_input,
    split_files,
    task_id_of,
)
from fleet.gateway.batch_slack import Slack
from fleet.gateway.batch_tasks import line_task
from fleet.gateway.errors import error_body
from fleet.gateway.fair_share import Ticket
from fleet.gateway.priority import OPEN, TenantPolicy
from fleet.gateway.relay import served_tokens
from fleet.gateway.resume import renderer_for
from fleet.gateway.service import Gateway
from fleet.wire import subjects
from fleet.wire.batches import BatchRecord, BatchResult, FileRecord, RequestCounts
from fleet.wire.events import ErrorChunk
from fleet.wire.tasks import Task

log = logging.getLogger(__name__)

WINDOW = 64  # lines of one job in flight at once (FLEET_TASKS holds 1,000 a model)
PROGRESS_S = 1.0  # how often the record's counts are written
QUEUE_FULL_WAIT_S = 0.5

Policies = Callable[[str | None], TenantPolicy]  # a tenant's record (fleet.gateway.keys)


class JobEnded(FleetError):
    """The job's record is gone (it expired from KV FLEET_BATCHES)."""


class LinesUnrecorded(FleetError):
    """Some lines have no result yet (NATS failed them): the job stays leased, so the next
    holder (this gateway's next scan, or another's) goes on with them."""


@dataclass
class Job:
    gateway: Gateway
    store: BatchStore
    batch_id: str
    slack: Slack
    policy: Policies = lambda _: OPEN
    recorded: dict[int, BatchResult] = field(default_factory=dict)
    cancelling: asyncio.Event = field(default_factory=asyncio.Event)
    feeding: asyncio.Lock = field(default_factory=asyncio.Lock)  # one line's turn at a time
    tickets: dict[str, Ticket] = field(default_factory=dict)  # lines settled, not recorded

    async def run(self) -> None:
        found = await self.store.batch(self.batch_id)
        if found is None:
            log.warning("batch %s has a lease but no record; ending its lease", self.batch_id)
            return
        record, revision = found
        if record.status in ("failed", "completed", "expired", "cancelled"):
            return
        data = await self.store.file_bytes(record.input_file_id)
        lines, errors = parse_input(data, record.endpoint)
        if record.status == "validating":
            if errors:
                await self._write(record, revision, status="failed", failed_at=_now(),
                                  errors=errors)
                return
            record, revision = await self._write(
                record, revision, status="in_progress", in_progress_at=_now(),
                request_counts=RequestCounts(total=len(lines)))
        resumed = record.in_progress_at is not None and record.in_progress_at < _now() - 1
        self.recorded = {r.line: r for r in await self.store.results(self.batch_id)}
        if record.status == "cancelling":
            self.cancelling.set()
        async with asyncio.TaskGroup() as group:
            progress = group.create_task(self._progress(record.id))
            await self._feed(group, record, [ln for ln in lines if ln.line not in self.recorded],
                             resumed or bool(self.recorded))
            progress.cancel()
        await self._finish(lines)

    async def _feed(self, group: asyncio.TaskGroup, record: BatchRecord,
                    lines: list[InputLine], replay: bool) -> None:
        window = asyncio.Semaphore(WINDOW)
        for line in lines:
            await window.acquire()
            if self.cancelling.is_set() or time.time() >= record.expires_at:
                window.release()
                break
            group.create_task(self._line(record, line, replay, window))
        for _ in range(WINDOW):  # the lines in flight end (or are cancelled) first
            await window.acquire()

    async def _line(self, record: BatchRecord, line: InputLine, replay: bool,
                    window: asyncio.Semaphore) -> None:
        try:
            result = await self._outcome(record, line, replay)
            await self.store.record_result(result)
            self.recorded[line.line] = result
            if (ticket := self.tickets.get(task_id_of(record.id, line.line))) is not None:
                await ticket.forget()  # recorded: no takeover runs it again
        except FleetError as exc:
            # NATS gone: the line stays without a result; whoever runs the job next does it
            log.warning("batch %s line %d: %s", record.id, line.line, exc.message)
        finally:
            self.tickets.pop(task_id_of(record.id, line.line), None)
            window.release()

    async def _outcome(self, record: BatchRecord, line: InputLine, replay: bool) -> BatchResult:
        task_id = task_id_of(record.id, line.line)

        def result(status: int, body: dict) -> BatchResult:  # type: ignore[type-arg]
            return BatchResult(batch_id=record.id, line=line.line, custom_id=line.custom_id,
                               task_id=task_id, status_code=status, body=body)

        backend = self.gateway.backend
        try:
            task, task_record = await line_task(self.gateway, record.endpoint, line.body,
                                                task_id, record.id, record.tenant,
                                                record.expires_at)
        except FleetError as exc:
            return result(exc.http_status, error_body(exc))
        await backend.owners.record_task(task_id, task_record)
        loop = asyncio.get_running_loop()
        events = await backend.events(task_id, deadline=loop.time() + record.expires_at
                                      - time.time(), replay=replay)
        ticket: Ticket | None = None
        ended = False  # the line's outcome is known here (else whoever runs the job next)
        try:
            async with self.feeding:
                ticket = await self._turn(task, record)
                if ticket is not None:
                    self.tickets[task_id] = ticket
                    events.when_running(ticket.running)
                await self._publish(task, record.expires_at)
            items = await self._until_end(events.rest(), task_id)
            ended = True
        except DeadlineExceeded:
            ended = True
            await backend.cancel_quietly(task_id, "the batch's completion window closed")
            return result(408, expired_body(record.id))
        finally:
            await events.close()
            # A line stopped here unended (lease lost, NATS) keeps its keyed charge for the
            # gateway that goes on with it, which settles it once with what it served.
            if ticket is not None and (ended or ticket.key is None):
                await ticket.settle(served_tokens(events.finished))
        if events.finished and (failed := failure_of(events.finished, _last_error(items))):
            return result(failed.http_status, error_body(failed))
        renderer = renderer_for(task_record, task_id, backend, lambda sha: f"/v1/images/{sha}")
        return result(200, await renderer.body([item.event for item in items]))

    async def _turn(self, task: Task, record: BatchRecord) -> Ticket | None:
        """Wait for the job's tenant's turn in the model's batch class (none for a job made
        on an open gateway: no tenants to be fair among)."""
        if record.tenant is None:
            return None
        return await self.gateway.fair_admit(record.tenant, self.policy(record.tenant).weight,
                                             [task], key=task.task_id)

    async def _until_end(self, rest: object, task_id: str) -> list[Indexed]:
        """The task's events to its end; a cancel of the job cancels the task (its terminal
        still comes: `cancelled`, recorded as the line's error)."""
        reading = asyncio.ensure_future(rest)  # type: ignore[arg-type]
        cancel = asyncio.ensure_future(self.cancelling.wait())
        try:
            await asyncio.wait({reading, cancel}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                await self.gateway.backend.cancel_quietly(task_id, "the batch was cancelled")
            return await reading
        finally:
            cancel.cancel()

    async def _publish(self, task: Task, expires_at: int) -> None:
        """Published with the job's window (plus a takeover's grace, fleet.bus.deadlines) as
        its per-message TTL; its sentinel ends it `expired` when the window closes unstarted.
        A full queue is waited out, not failed."""
        ttl = task_ttl_header(task.deadline, time.time())  # the window, plus a takeover's grace
        ttl |= charged_by_publisher(task.tenant)  # its turn charges it (not the worker)
        await self.slack.room(task.model)  # batch work fills slack (fleet.gateway.batch_slack)
        while True:
            try:
                await js_publish(self.gateway.backend.jetstream(),
                                 subjects.tasks(task.model, task.priority),
                                 task, msg_id=task.task_id, extra_headers=ttl)
                await publish_deadline(self.gateway.backend.jetstream(), task)
                return
            except APIError as exc:
                if exc.err_code != MAXIMUM_MESSAGES_EXCEEDED:
                    raise QueueFull(f"JetStream refused {task.task_id}: {exc.description}") \
                        from None
            await asyncio.sleep(QUEUE_FULL_WAIT_S)  # the batch waits for room in the queue

    async def _progress(self, batch_id: str) -> None:
        """Every PROGRESS_S: the counts into the record, and a cancel noticed."""
        while True:
            await asyncio.sleep(PROGRESS_S)
            with contextlib.suppress(FleetError):
                found = await self.store.batch(batch_id)
                if found is None:
                    continue
                record, revision = found
                if record.status == "cancelling":
                    self.cancelling.set()
                fresh = counts(record.request_counts.total, self.recorded.values())
                if fresh != record.request_counts:
                    await self.store.update_batch(
                        record.model_copy(update={"request_counts": fresh}), revision)

    async def _finish(self, lines: list[InputLine]) -> None:
        """The final status, the output and error files, then the record (in that order: a
        record that names a file names one that can be read)."""
        while True:
            found = await self.store.batch(self.batch_id)
            if found is None:
                raise JobEnded(f"batch {self.batch_id} has no record any more")
            record, revision = found
            recorded = await self.store.results(self.batch_id)
            status = final_status(record, len(recorded), time.time())
            if status is None:
                raise LinesUnrecorded(f"batch {record.id}: {len(recorded)} of "
                                      f"{record.request_counts.total} lines recorded")
            if status == "expired":
                done = {r.line for r in recorded}
                for line in lines:
                    if line.line not in done:
                        await self.store.record_result(BatchResult(
                            batch_id=record.id, line=line.line, custom_id=line.custom_id,
                            task_id=None, status_code=408, body=expired_body(record.id)))
                recorded = await self.store.results(self.batch_id)
            output, errors = split_files(recorded)
            update: dict[str, object] = {
                "status": status, f"{status}_at": _now(),
                "request_counts": counts(record.request_counts.total, recorded),
                "finalizing_at": record.finalizing_at or _now(),
                "output_file_id": await self._file(record, "output", output),
                "error_file_id": await self._file(record, "error", errors),
            }
            if await self.store.update_batch(record.model_copy(update=update), revision):
                log.info("batch %s %s: %s", record.id, status, update["request_counts"])
                return

    async def _file(self, record: BatchRecord, kind: str, data: bytes) -> str | None:
        if not data:
            return None
        file_id = f"file-{record.id}-{kind}"
        if await self.store.file(file_id) is None:
            await self.store.put_file(FileRecord(
                id=file_id, tenant=record.tenant, filename=f"{record.id}_{kind}.jsonl",
                purpose="batch_output", bytes=len(data), created_at=_now()), data)
        return file_id

    async def _write(self, record: BatchRecord, revision: int,
                     **update: object) -> tuple[BatchRecord, int]:
        """Compare-and-set; a cancel that came in between wins (and is noticed)."""
        while True:
            changed = record.model_copy(update=update)
            if (new_revision := await self.store.update_batch(changed, revision)) is not None:
                return changed, new_revision
            found = await self.store.batch(record.id)
            if found is None:
                raise JobEnded(f"batch {record.id} has no record any more")
            record, revision = found
            if record.status == "cancelling":
                self.cancelling.set()
                return found


def _last_error(items: list[Indexed]) -> ErrorChunk | None:
    errors = [item.event for item in items if isinstance(item.event, ErrorChunk)]
    return errors[-1] if errors else None


def _now() -> int:
    return int(time.time())
