"""Pulling tasks: one bound pull subscription per model on its shared durable consumer."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.bus.provision import ensure_task_consumer
from fleet.config import Settings
from fleet.wire import subjects

log = logging.getLogger(__name__)

FETCH_WAIT_S = 2.0


async def unsubscribe_pull(sub: JetStreamContext.PullSubscription) -> None:
    """Drop a pull subscription before the connection drains: a fetch cancelled mid-wait
    leaves the server's late answer queued unread, and draining waits on it for 30 s."""
    with contextlib.suppress(Exception):
        await sub.unsubscribe()


class TaskPuller:
    def __init__(self, nc: Client, js: JetStreamContext, settings: Settings) -> None:
        self.nc = nc
        self.js = js
        self.settings = settings
        self.subs: dict[str, JetStreamContext.PullSubscription] = {}

    async def fetch(self, model: str, batch: int) -> list[Msg]:
        """Up to `batch` tasks of `model`, waiting at most FETCH_WAIT_S; never raises."""
        try:
            sub = self.subs.get(model) or await self._subscribe(model)
            return await sub.fetch(batch, timeout=FETCH_WAIT_S)
        except TimeoutError:
            return []
        except Exception as exc:  # the loop must go on; the next plan pulls again
            log.warning("fetch for %s failed: %s", model, exc)
            await asyncio.sleep(0.5)  # pacing a retry after a broker error, not synchronisation
            return []

    async def _subscribe(self, model: str) -> JetStreamContext.PullSubscription:
        await ensure_task_consumer(
            self.nc, model, max_deliver=self.settings.max_deliver,
            ack_wait_s=self.settings.ack_wait_s,
        )
        sub = await self.js.pull_subscribe_bind(
            subjects.durable(model), stream=subjects.TASKS_STREAM
        )
        self.subs[model] = sub
        return sub

    async def close(self) -> None:
        for sub in self.subs.values():
            await unsubscribe_pull(sub)
