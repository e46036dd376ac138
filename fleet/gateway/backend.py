"""The gateway's side of NATS: one connection, and every verb the HTTP routes need from it.

The gateway must start and answer (503) while NATS is down, so the first connection is retried
in the background; after that nats-py reconnects by itself. Errors leave this module as Fleet
errors: a full queue is QueueFull (429), anything unreachable is NatsUnavailable (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

import anyio
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import APIError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from fleet.aio import Supervisor
from fleet.bus.connect import connect_with, js_publish, redact_urls
from fleet.bus.deadlines import publish_deadline, task_ttl_header
from fleet.bus.fairness import charged_by_publisher
from fleet.bus.kv_calls import stream_exists
from fleet.bus.kv_read import live_values
from fleet.bus.objects import ObjectBucket
from fleet.bus.provision import provision
from fleet.bus.records import CancelRecords
from fleet.bus.task_events import TaskEvents
from fleet.bus.task_log import TaskLog
from fleet.bus.task_queue import TaskQueue
from fleet.config import Settings
from fleet.errors import (
    CorruptImage,
    FleetError,
    NatsUnavailable,
    ObjectCorrupt,
    ObjectError,
    ObjectMissing,
    PayloadTooLarge,
    QueueFull,
)
from fleet.gateway.owners import Owners
from fleet.gateway.task_feed import StitchedEvents, TaskSubscriptions
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord
from fleet.wire.codec import encode
from fleet.wire.tasks import CancelTask, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelQueue:
    """A model's tasks as JetStream counts them."""

    queued: int = 0  # in FLEET_TASKS: waiting, or handed out and not acknowledged yet
    in_flight: int = 0  # handed to a worker, not acknowledged yet
    redelivered: int = 0  # of those, handed out more than once (a worker died or stalled)
    dead_lettered: int = 0  # in FLEET_DEAD after their last delivery


Model = TypeVar("Model", bound=BaseModel)


# JetStream answers a publish over a stream's message limits with this code; FLEET_TASKS has
# DiscardNew and a per-subject limit, so it means the model's queue is full.
MAXIMUM_MESSAGES_EXCEEDED = 10077


MAXIMUM_BYTES_EXCEEDED = 10078


RECONNECT_WAIT_S = 1.0


# The retry budgets of the gateway's broker calls (fleet.bus.retry): a request waits out an
# election (3.5-8 s measured, NOTES.md), not an outage, which answers 503. A cancel is a write
# a worker may be waiting for, so it waits as long as an election can take.
READ_BUDGET_S = 5.0
CANCEL_BUDGET_S = 10.0


# Room for the headers a task is published with (Nats-Msg-Id, traceparent, tracestate).
HEADER_ALLOWANCE = 1024


STREAMS = (subjects.TASKS_STREAM, subjects.OUT_STREAM)


BUCKETS = (
    subjects.INSTANCES_BUCKET,
    subjects.RUNNERS_BUCKET,
    subjects.CANCELS_BUCKET,
    subjects.IMAGES_BUCKET,
)


@contextlib.contextmanager
def unavailable_on_nats_errors(doing: str) -> Iterator[None]:
    try:
        yield
    except FleetError:
        raise
    except (NatsError, OSError, TimeoutError) as exc:
        raise NatsUnavailable(f"NATS could not {doing}: {exc!r}") from None


def hash_matches(sha256: str, data: bytes) -> bool:
    return hashlib.sha256(data).hexdigest() == sha256


class Backend:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.url = redact_urls(settings.urls)  # for log lines and errors: no password
        self.nc: Client | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._buckets: dict[str, KeyValue] = {}
        self._cancels: CancelRecords | None = None
        # A core subscription per task read here (fleet.gateway.task_feed), not every task's.
        self.hub = TaskSubscriptions(self._client)
        self.owners = Owners(self._client)

    async def start(self, owner: Supervisor) -> None:
        """The connect loop and the refills as children of `owner` (the gateway's lifespan,
        fleet/gateway/app.py), which cancels them before `close`."""
        self._connecting = owner.spawn("nats connect", self._connect_until_up())
        owner.spawn("refills", self.hub.watch_reconnects())
        # Give the first attempt a moment so a healthy start answers its first request.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._connecting), timeout=2.0)

    async def _connect_until_up(self) -> None:
        while True:
            try:
                nc = await connect_with(self.settings, "fleet-gateway", connect_timeout=2.0,
                                        role="gateway")
                break
            except NatsUnavailable as exc:
                log.warning("%s; retrying", exc.message)
                await asyncio.sleep(RECONNECT_WAIT_S)
        try:
            await provision(nc, replicas=self.settings.replicas)
        except FleetError as exc:
            log.error("provisioning JetStream failed: %s", exc.message)
        self.nc = nc
        log.info("connected to NATS at %s", self.url)

    async def close(self) -> None:
        """After the owner's children ended: the subscriptions, then the connection."""
        await self.hub.close()
        if self.nc is not None:
            with contextlib.suppress(NatsError, OSError):
                await self.nc.close()

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def _client(self) -> Client:
        if self.nc is None or not self.nc.is_connected:
            raise NatsUnavailable(f"not connected to NATS at {self.url}")
        return self.nc

    def jetstream(self) -> JetStreamContext:
        return self._client().jetstream()

    def task_queue(self) -> TaskQueue:
        """FLEET_TASKS and FLEET_DEAD through their facade, within the gateway's read budget."""
        return TaskQueue.of(self.jetstream(), budget_s=READ_BUDGET_S)

    def task_log(self) -> TaskLog:
        """FLEET_OUT's reads through their facade, within the gateway's read budget."""
        return TaskLog.of(self.jetstream(), budget_s=READ_BUDGET_S)

    async def _bucket(self, name: str) -> KeyValue:
        if name not in self._buckets:
            with unavailable_on_nats_errors(f"open bucket {name}"):
                self._buckets[name] = await self.jetstream().key_value(name)
        return self._buckets[name]

    async def publish_task(self, task: Task) -> None:
        """On its class's subject; with a deadline, the broker drops it unstarted then
        (`Nats-TTL`) and its sentinel has a worker end it `expired` (fleet.bus.deadlines)."""
        try:
            await js_publish(
                self.jetstream(), subjects.tasks(task.model, task.priority), task,
                msg_id=task.task_id,
                extra_headers=task_ttl_header(task.deadline, time.time())
                | charged_by_publisher(task.tenant),
            )
            await publish_deadline(self.jetstream(), task)
        except APIError as exc:
            if exc.err_code in (MAXIMUM_MESSAGES_EXCEEDED, MAXIMUM_BYTES_EXCEEDED):
                raise QueueFull(f"the queue of model {task.model} is full; retry later") from None
            raise NatsUnavailable(f"JetStream refused the task: {exc.description}") from None
        except FleetError:
            raise
        except (NatsError, OSError, TimeoutError) as exc:
            raise NatsUnavailable(f"could not publish the task: {exc!r}") from None

    def check_size(self, task: Task) -> None:
        """413 for a task the broker would refuse as larger than its max_payload."""
        if self.nc is None or not self.nc.is_connected:
            return  # publishing will say NATS is unavailable
        size = len(encode(task)) + HEADER_ALLOWANCE
        if size > self.nc.max_payload:
            raise PayloadTooLarge(
                f"the task is {size} bytes, over the {self.nc.max_payload} bytes a NATS "
                "message may carry here; send a shorter prompt"
            )

    async def events(
        self,
        task_id: str,
        deadline: float,
        after: int = 0,
        *,
        replay: bool = True,
        idle_s: float | None = None,
    ) -> TaskEvents:
        """The task's events: subscribed before anything is read (or its task published)."""
        await self.hub.follow(task_id)
        reader = StitchedEvents(
            self.jetstream(), task_id, deadline, after, hub=self.hub, replay=replay, idle_s=idle_s
        )
        try:
            return await reader.open()
        except BaseException:
            await self.hub.unfollow(task_id)
            raise

    async def cancel(self, task_id: str, reason: str) -> None:
        """Record the cancel (for a worker that has not fetched the task yet), then announce it:
        CancelRecords.send, the one cancel writer (`fleet cancel` sends the same way)."""
        cancel = CancelTask(task_id=task_id, reason=reason)
        with unavailable_on_nats_errors("record the cancel"):
            if self._cancels is None:
                self._cancels = await CancelRecords.open(self.jetstream(),
                                                         budget_s=CANCEL_BUDGET_S)
            await self._cancels.send(cancel)

    async def cancel_quietly(self, task_id: str, reason: str) -> None:
        """Cancel from cleanup paths: shielded from the caller's cancellation, never raising."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await self.cancel(task_id, reason)
            except FleetError as exc:
                log.warning("could not cancel task %s: %s", task_id, exc.message)

    def _images(self) -> ObjectBucket:
        return ObjectBucket(self._client(), subjects.IMAGES_BUCKET)

    async def put_image(self, data: bytes) -> str:
        try:
            return await self._images().put_by_hash(data)
        except ObjectError as exc:
            raise NatsUnavailable(f"could not store the image: {exc.message}") from None

    async def has_image(self, sha256: str) -> bool:
        try:
            return await self._images().find(sha256) is not None
        except ObjectError as exc:
            raise NatsUnavailable(f"could not look up image {sha256}: {exc.message}") from None

    async def get_image(self, sha256: str) -> bytes | None:
        """The image's bytes, checked against its name: a mismatch is refused and logged."""
        try:
            data = await self._images().get(sha256)
        except ObjectMissing:
            return None
        except ObjectCorrupt as exc:
            log.error("refused to serve image %s: %s", sha256, exc.message)
            raise CorruptImage(f"image {sha256} is corrupt in the store; not served") from None
        except ObjectError as exc:
            raise NatsUnavailable(f"could not read image {sha256}: {exc.message}") from None
        if not hash_matches(sha256, data):
            log.error(
                "refused to serve image %s: its %d stored bytes hash to %s",
                sha256, len(data), hashlib.sha256(data).hexdigest(),
            )
            raise CorruptImage(f"image {sha256} is corrupt in the store; not served")
        return data

    async def _values(self, name: str, model: type[Model]) -> list[Model]:
        with unavailable_on_nats_errors(f"read bucket {name}"):
            return await live_values(self.jetstream(), name, model)

    async def instances(self) -> list[Instance]:
        return await self._values(subjects.INSTANCES_BUCKET, Instance)

    async def runners(self) -> list[RunnerRecord]:
        return await self._values(subjects.RUNNERS_BUCKET, RunnerRecord)

    async def queue_depths(self) -> dict[str, int]:
        """Tasks stored per model: WorkQueue keeps a task until a worker acks it."""
        with unavailable_on_nats_errors("read the task queue"):
            per_subject = await self.task_queue().counts()
        depths: dict[str, int] = {}
        for subject, count in per_subject.items():  # a model's classes summed
            model = subjects.model_of_task_subject(subject)
            depths[model] = depths.get(model, 0) + count
        return depths

    async def queue_stats(self) -> dict[str, ModelQueue]:
        """Per model: tasks queued, handed out, handed out more than once, dead-lettered."""
        depths = await self.queue_depths()
        queue = self.task_queue()
        with unavailable_on_nats_errors("read the task consumers and dead letters"):
            consumers = await queue.consumers()
            dead = await queue.dead_counts()
        stats = {model: ModelQueue(queued=count) for model, count in depths.items()}
        for consumer in consumers:
            if (model := subjects.model_of_durable(consumer.name or "")) is not None:
                known = stats.get(model, ModelQueue())  # a model's classes summed
                stats[model] = replace(
                    known, in_flight=known.in_flight + (consumer.num_ack_pending or 0),
                    redelivered=known.redelivered + (consumer.num_redelivered or 0),
                )
        for subject, count in dead.items():
            model = subjects.model_of_dead_letter(subject)
            stats[model] = replace(stats.get(model, ModelQueue()), dead_lettered=count)
        return stats

    async def stored_events(self, task_id: str) -> int:
        """How many events FLEET_OUT holds for the task (every copy), through its task log."""
        with unavailable_on_nats_errors("count a task's events"):
            return await self.task_log().count(task_id)

    async def present(self) -> dict[str, bool]:
        """Which of the streams and buckets the gateway relies on exist."""
        js = self.jetstream()
        names = [*STREAMS, *(f"KV_{b}" for b in BUCKETS[:-1]), f"OBJ_{BUCKETS[-1]}"]
        found = {}
        for name in names:
            with unavailable_on_nats_errors(f"say whether {name} exists"):
                found[name] = await stream_exists(js, name, budget_s=READ_BUDGET_S)
        return found
