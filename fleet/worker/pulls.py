"""Pulling tasks: one bound pull subscription per model on its shared durable consumer.

The durable `tasks-<model>` can vanish under a running worker (someone deleted it, a stream
was recreated). A fetch then fails with 503 (no responders), exactly as it does during a
leader election; so after a failed fetch the consumer is looked up, and when the server says
it does not exist it is created again (`ensure_task_consumer`) and the subscription rebound.
A durable whose configuration was changed is restored before binding, and checked while
pulling (fleet.worker.consumer_guard); one that cannot be restored stops this model's pulls.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from opentelemetry.metrics import Meter

from fleet.bus.provision import ensure_task_consumer
from fleet.bus.retry import is_transient
from fleet.config import Settings
from fleet.wire import subjects
from fleet.worker.consumer_guard import ConsumerGuard

log = logging.getLogger(__name__)

FETCH_WAIT_S = 2.0
ERROR_PAUSE_S = 0.5


async def unsubscribe_pull(sub: JetStreamContext.PullSubscription) -> None:
    """Drop a pull subscription before the connection drains: a fetch cancelled mid-wait
    leaves the server's late answer queued unread, and draining waits on it for 30 s."""
    try:
        await sub.unsubscribe()
    except Exception as exc:  # closing anyway: say so, nothing to retry
        log.debug("pull subscription not unsubscribed: %s", exc)


class TaskPuller:
    def __init__(
        self, nc: Client, js: JetStreamContext, settings: Settings, meter: Meter | None = None
    ) -> None:
        self.nc = nc
        self.js = js
        self.settings = settings
        self.subs: dict[str, JetStreamContext.PullSubscription] = {}
        self.recreated: dict[str, int] = {}  # model -> times its consumer was recreated
        self.stopped: dict[str, str] = {}  # model -> why its pulls stopped (a changed consumer)
        self.guard = ConsumerGuard(nc, self, settings.max_deliver, settings.ack_wait_s, meter)

    async def fetch(self, model: str, batch: int) -> list[Msg]:
        """Up to `batch` tasks of `model`, waiting at most FETCH_WAIT_S; never raises."""
        if model in self.stopped:
            return []
        try:
            sub = self.subs.get(model) or await self._subscribe(model)
            return await sub.fetch(batch, timeout=FETCH_WAIT_S)
        except TimeoutError:
            return []
        except Exception as exc:  # the loop must go on; the next plan pulls again
            log.warning("fetch for %s failed: %s", model, type(exc).__name__ + f" {exc}".rstrip())
            await self._recover(model)
            await asyncio.sleep(ERROR_PAUSE_S)  # pacing a retry after a broker error
            return []

    async def _recover(self, model: str) -> None:
        """After a failed fetch: recreate the durable consumer if it is gone."""
        if model not in self.subs:
            return
        try:
            await self.js.consumer_info(subjects.TASKS_STREAM, subjects.durable(model))
        except NotFoundError:
            log.warning(
                "consumer %s is gone (deleted under this worker): recreating it",
                subjects.durable(model),
            )
            self.recreated[model] = self.recreated.get(model, 0) + 1
            await unsubscribe_pull(self.subs.pop(model))
            try:
                await self._subscribe(model)
            except Exception as exc:
                log.warning("consumer %s not recreated yet: %s", subjects.durable(model), exc)
        except Exception as exc:
            if not is_transient(exc):
                log.warning("consumer %s not checked: %s", subjects.durable(model), exc)

    async def stop_pulling(self, model: str, reason: str) -> None:
        self.stopped[model] = reason
        if sub := self.subs.pop(model, None):
            await unsubscribe_pull(sub)

    async def _subscribe(self, model: str) -> JetStreamContext.PullSubscription:
        await self.guard.check(model, binding=True)
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
