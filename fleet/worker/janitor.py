"""Tasks no model consumer will ever finish: unknown models, and tasks past MaxDeliver.

Unknown models are caught by a queue-group subscription on `fleet.tasks.>`; MaxDeliver
advisories by the shared durable consumer `janitor` on FLEET_ADVISORIES. Either way exactly
one worker of the fleet answers each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.bus.connect import headers_for, js_publish
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event, decode_task
from fleet.wire.events import ErrorReason, TaskFinished, failed
from fleet.worker.pulls import unsubscribe_pull

log = logging.getLogger(__name__)

def readable_task_id(data: bytes) -> str | None:
    try:
        return decode_task(data).task_id
    except DecodeError as exc:
        return exc.task_id


class Janitor:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        is_known: Callable[[str], bool],
        on_known: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        """`is_known(model)`: a card on this node or an instance placed anywhere;
        `on_known(model)`: told of each task for a known model (placement on demand)."""
        self.nc = nc
        self.js = js
        self.is_known = is_known
        self.on_known = on_known

    async def start(self) -> None:
        await self.nc.subscribe(subjects.TASKS_ALL, queue="fleet-triage", cb=self._triage)
        # Advisories are fire-and-forget; FLEET_ADVISORIES keeps them until a worker is there.
        self.advisories = await self.js.pull_subscribe(
            "", durable="janitor", stream=subjects.ADVISORIES_STREAM
        )
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        self._sweeper.cancel()
        await unsubscribe_pull(self.advisories)

    async def _sweep_forever(self) -> None:
        while True:
            try:
                msgs = await self.advisories.fetch(16, timeout=5.0)
            except TimeoutError:
                continue
            except Exception as exc:
                log.warning("advisory fetch failed: %s", exc)
                await asyncio.sleep(1.0)  # pacing a retry after a broker error
                continue
            for msg in msgs:
                try:
                    await self._dead(msg)
                    await msg.ack()
                except Exception as exc:
                    log.warning("dead letter handling failed, retrying later: %s", exc)
                    await msg.nak(delay=2.0)

    async def _finish(self, task_id: str, reason: ErrorReason, message: str) -> None:
        event = failed(task_id, time.time(), reason, message)
        await js_publish(self.js, subjects.out(task_id), event, msg_id=f"finished-{task_id}")

    async def _triage(self, msg: Msg) -> None:
        model = subjects.model_of_task_subject(msg.subject)
        if self.is_known(model):
            if self.on_known is not None:
                try:
                    await self.on_known(model)
                except Exception as exc:
                    log.warning("placing %s on demand failed: %s", model, exc)
            return
        task_id = readable_task_id(msg.data)
        log.warning("task %s names unknown model %r", task_id, model)
        # Nobody consumes this subject: remove what was stored so the queue does not fill.
        body = orjson.dumps({"filter": msg.subject})
        await self.nc.request(f"$JS.API.STREAM.PURGE.{subjects.TASKS_STREAM}", body, timeout=5)
        if task_id:
            await self._finish(task_id, ErrorReason.MODEL_NOT_FOUND, f"no model named {model!r}")

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
            headers=headers_for(msg_id=f"dead-{seq}", extra={
                "Fleet-Reason": "max_deliveries", "Fleet-Deliveries": str(deliveries),
            }),
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
