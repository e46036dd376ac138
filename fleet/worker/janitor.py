"""Tasks no model consumer will ever finish: unknown models, and tasks past MaxDeliver.

Both run as queue-group subscriptions, so exactly one worker of the fleet answers each.
"""

from __future__ import annotations

import logging
import time

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.bus.connect import headers_for, js_publish
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event, decode_task
from fleet.wire.events import ErrorReason, TaskFinished, failed

log = logging.getLogger(__name__)

MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.FLEET_TASKS.>"


def readable_task_id(data: bytes) -> str | None:
    try:
        return decode_task(data).task_id
    except DecodeError as exc:
        return exc.task_id


class Janitor:
    def __init__(self, nc: Client, js: JetStreamContext, known_models: set[str]) -> None:
        self.nc = nc
        self.js = js
        self.known_models = known_models

    async def start(self) -> None:
        await self.nc.subscribe(subjects.TASKS_ALL, queue="fleet-triage", cb=self._triage)
        await self.nc.subscribe(MAX_DELIVERIES_ADVISORY, queue="fleet-dead", cb=self._dead)

    async def _finish(self, task_id: str, reason: ErrorReason, message: str) -> None:
        event = failed(task_id, time.time(), reason, message)
        await js_publish(self.js, subjects.out(task_id), event, msg_id=f"finished-{task_id}")

    async def _triage(self, msg: Msg) -> None:
        model = subjects.model_of_task_subject(msg.subject)
        if model in self.known_models:
            return
        task_id = readable_task_id(msg.data)
        log.warning("task %s names unknown model %r", task_id, model)
        if task_id:
            await self._finish(task_id, ErrorReason.MODEL_NOT_FOUND, f"no model named {model!r}")
        # Nobody consumes this subject: remove what was stored so the queue does not fill.
        body = orjson.dumps({"filter": msg.subject})
        await self.nc.request(f"$JS.API.STREAM.PURGE.{subjects.TASKS_STREAM}", body, timeout=5)

    async def _dead(self, msg: Msg) -> None:
        """Move a task past MaxDeliver out of the work queue, record it, and finish it."""
        advisory = orjson.loads(msg.data)
        seq = advisory.get("stream_seq")
        if not seq:
            return
        try:
            stored = await self.js.get_msg(subjects.TASKS_STREAM, seq)
        except Exception as exc:
            log.warning("dead letter %s already gone: %s", seq, exc)
            return
        data = stored.data or b""
        model = subjects.model_of_task_subject(stored.subject or "")
        deliveries = advisory.get("deliveries")
        await self.js.publish(
            subjects.dead_letter(model), data,
            headers=headers_for(extra={"Fleet-Reason": "max_deliveries",
                                       "Fleet-Deliveries": str(deliveries)}),
        )
        task_id = readable_task_id(data)
        if task_id and not await self._already_finished(task_id):
            await self._finish(
                task_id, ErrorReason.MAX_DELIVERIES,
                f"delivered {deliveries} times without finishing; moved to fleet.dead.{model}",
            )
        await self.js.delete_msg(subjects.TASKS_STREAM, seq)

    async def _already_finished(self, task_id: str) -> bool:
        try:
            raw = await self.js.get_last_msg(subjects.OUT_STREAM, subjects.out(task_id))
            return isinstance(decode_event(raw.data or b""), TaskFinished)
        except Exception:
            return False
