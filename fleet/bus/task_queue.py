"""The task queue: FLEET_TASKS (`fleet.tasks.<model>`, a work queue), where a task that no
worker could finish goes (FLEET_DEAD, `fleet.dead.<model>`), and the answers to a task message
that is refused (FLEET_REFUSED and the publisher's inbox), read and written through one facade.

Pulling tasks stays with the worker's consumers (fleet.worker.pulls); what is here are the
calls around them: the per-subject counts (demand, the triage of unknown models, the
gateway's queue depths), the consumers' counts and the dead letters (the gateway's metrics and
the dashboard), a stored task by sequence, the tasks stored on one subject, a purge, a dead
letter, a delete, a verb on a delivered message (or, by its ack subject, on one another
process holds), and the durable pull consumers the worker's duties read (advisories, deadline
markers). Each call has its own retry budget (fleet.bus.retry): an election delays
it, a longer outage raises BrokerUnavailable naming the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, RawStreamMsg
from nats.js.errors import NotFoundError

from fleet.bus.connect import MSG_ID, headers_for
from fleet.bus.provision import jetstream_api
from fleet.bus.replies import task_ack
from fleet.bus.retry import BROKER_BUDGET_S, with_retry
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskRefused

PURGE_TIMEOUT_S = 5.0


def dead_headers(seq: int, deliveries: object) -> dict[str, str]:
    """Pure but for the trace context: a dead letter's headers (one copy per stored task)."""
    return headers_for(msg_id=f"dead-{seq}", extra={
        "Fleet-Reason": "max_deliveries", "Fleet-Deliveries": str(deliveries),
    })


class TaskQueue:
    """FLEET_TASKS and FLEET_DEAD over one connection."""

    def __init__(self, nc: Client, js: JetStreamContext | None = None,
                 *, budget_s: float = BROKER_BUDGET_S) -> None:
        self.nc = nc
        self.js = js or nc.jetstream()
        self.budget_s = budget_s

    @classmethod
    def of(cls, js: JetStreamContext, *, budget_s: float = BROKER_BUDGET_S) -> TaskQueue:
        """The queue over the connection `js` was made from (nats-py keeps it as `_nc`)."""
        return cls(js._nc, js, budget_s=budget_s)

    async def counts(self) -> dict[str, int]:
        """How many tasks each `fleet.tasks.<model>` subject holds (subjects with none left
        out by the server)."""
        info = await with_retry(
            lambda: self.js.stream_info(subjects.TASKS_STREAM, subjects_filter=subjects.TASKS_ALL),
            what="count the queued tasks", budget_s=self.budget_s,
        )
        return dict(info.state.subjects or {})

    async def get(self, seq: int) -> RawStreamMsg:
        """The task stored at `seq` (NotFoundError when it is gone)."""
        return await with_retry(lambda: self.js.get_msg(subjects.TASKS_STREAM, seq),
                                what=f"read task {seq}", budget_s=self.budget_s)

    async def next_on(self, subject: str, after: int) -> RawStreamMsg | None:
        """The first task stored on `subject` after sequence `after`; None when none is."""
        try:
            return await with_retry(
                lambda: self.js.get_msg(subjects.TASKS_STREAM, seq=after + 1, subject=subject,
                                        next=True),
                what=f"read a task of {subject}", budget_s=self.budget_s,
            )
        except NotFoundError:
            return None

    async def purge_through(self, subject: str, last: int) -> None:
        """Remove the tasks stored on `subject` up to sequence `last` (those published since
        stay). nats-py's purge takes no sequence: the stream API's request does."""
        body = orjson.dumps({"filter": subject, "seq": last + 1})
        api = f"$JS.API.STREAM.PURGE.{subjects.TASKS_STREAM}"
        await with_retry(lambda: self.nc.request(api, body, timeout=PURGE_TIMEOUT_S),
                         what=f"purge {subject}", budget_s=self.budget_s)

    async def dead_letter(self, model: str, data: bytes, seq: int, deliveries: object) -> None:
        """Keep the task at `seq` on `fleet.dead.<model>`; its msg id keeps one copy."""
        headers = dead_headers(seq, deliveries)
        await with_retry(
            lambda: self.js.publish(subjects.dead_letter(model), data, headers=headers),
            what=f"dead-letter task {seq}", budget_s=self.budget_s,
        )

    async def consumers(self) -> list[ConsumerInfo]:
        """The consumers of FLEET_TASKS (one durable per model and class), with their counts of
        deliveries not acknowledged yet and of redeliveries."""
        return await with_retry(lambda: self.js.consumers_info(subjects.TASKS_STREAM),
                                what="read the task consumers", budget_s=self.budget_s)

    async def durable(self, name: str) -> ConsumerInfo | None:
        """The durable `name` of FLEET_TASKS; None when the server says it does not exist."""
        try:
            return await with_retry(lambda: self.js.consumer_info(subjects.TASKS_STREAM, name),
                                    what=f"read consumer {name}", budget_s=self.budget_s)
        except NotFoundError:
            return None

    # The consumer guard's calls (fleet.worker.consumer_guard): it compares the server's own
    # JSON of a durable with Fleet's definition, so these speak the stream API's JSON.

    async def durable_json(self, name: str) -> dict[str, Any] | None:
        """The server's CONSUMER.INFO answer for the durable (config, position, counts);
        None when it answers an error (the durable is gone)."""
        info = await self._api(f"CONSUMER.INFO.{subjects.TASKS_STREAM}.{name}")
        return None if "error" in info else info

    async def put_durable(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """Create or update the durable with `config`: the server's answer (its "error"
        when it refuses)."""
        return await self._api(f"CONSUMER.CREATE.{subjects.TASKS_STREAM}.{name}",
                               {"stream_name": subjects.TASKS_STREAM, "config": config})

    async def reset_durable(self, name: str, seq: int) -> dict[str, Any]:
        """Move the durable's position back to stream sequence `seq`: the server's answer."""
        return await self._api(f"CONSUMER.RESET.{subjects.TASKS_STREAM}.{name}", {"seq": seq})

    async def first_seq_on(self, subject: str, seq: int) -> int | None:
        """The sequence of the first task stored on `subject` at or after `seq`; None when
        none is."""
        found = await self._api(f"STREAM.MSG.GET.{subjects.TASKS_STREAM}",
                                {"seq": seq, "next_by_subj": subject})
        got = found.get("message", {}).get("seq")
        return int(got) if got is not None else None

    async def stored_on(self, subject: str) -> int:
        """How many tasks `subject` holds."""
        held = await self._api(f"STREAM.INFO.{subjects.TASKS_STREAM}",
                               {"subjects_filter": subject})
        return int((held.get("state", {}).get("subjects") or {}).get(subject, 0))

    async def _api(self, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await jetstream_api(self.nc, subject, body, budget_s=self.budget_s)

    async def dead_counts(self) -> dict[str, int]:
        """How many dead letters each `fleet.dead.<model>` subject holds."""
        info = await with_retry(
            lambda: self.js.stream_info(subjects.DEAD_LETTERS_STREAM,
                                        subjects_filter=subjects.DEAD_LETTERS_ALL),
            what="count the dead letters", budget_s=self.budget_s,
        )
        return dict(info.state.subjects or {})

    async def newest_dead(self, limit: int) -> list[RawStreamMsg]:
        """Up to `limit` dead letters, newest first (a letter removed meanwhile is skipped).
        By sequence, without a consumer: the gateway's role may read FLEET_DEAD's stored
        messages and nothing more of it (fleet/bus/roles.py)."""
        info = await with_retry(lambda: self.js.stream_info(subjects.DEAD_LETTERS_STREAM),
                                what="read the dead letters", budget_s=self.budget_s)
        found: list[RawStreamMsg] = []
        seq = info.state.last_seq
        while seq >= max(1, info.state.first_seq) and len(found) < limit:
            with contextlib.suppress(NotFoundError):
                found.append(await with_retry(
                    partial(self.js.get_msg, subjects.DEAD_LETTERS_STREAM, seq),
                    what=f"read dead letter {seq}", budget_s=self.budget_s,
                ))
            seq -= 1
        return found

    async def delete(self, seq: int) -> None:
        await with_retry(lambda: self.js.delete_msg(subjects.TASKS_STREAM, seq),
                         what=f"delete task {seq}", budget_s=self.budget_s)

    async def refuse(self, model: str, event: TaskRefused, reply: str | None) -> None:
        """Record a refused task message on `fleet.refused.<model>` (one record per message,
        however often it is delivered) and tell its publisher's inbox, when it named one
        (checked by the caller: fleet.bus.replies)."""
        body = encode(event)
        seq = event.stream_seq
        headers = {MSG_ID: f"refused-{seq}"} if seq is not None else None
        await with_retry(
            lambda: self.js.publish(subjects.refused(model), body, headers=headers),
            what=f"record refusal of task {event.task_id}", budget_s=self.budget_s,
        )
        if reply:
            await with_retry(lambda: self.nc.publish(reply, body),
                             what=f"tell {reply} of a refusal", budget_s=self.budget_s)


async def settle(send: Callable[[], Awaitable[None]], *, what: str,
                 budget_s: float = BROKER_BUDGET_S) -> None:
    """A verb on a delivered message (ack, nak, term, in_progress), retried: a verb is safe
    to repeat (the server settles a message once; MsgAlreadyAckdError says so)."""
    await with_retry(send, what=what, budget_s=budget_s)


async def nak_held(nc: Client, ack_subject: str, *, what: str,
                   budget_s: float = BROKER_BUDGET_S) -> None:
    """`nak` a FLEET_TASKS delivery that another process holds, by its ack subject (a dead
    node's heartbeat lists them: fleet.worker.deathwatch), so the broker hands it on at once.
    The subject was read from a message, so it is a capability (fleet.bus.replies): anything
    but a FLEET_TASKS ack is refused here, before anything is published."""
    if task_ack(ack_subject) is None:
        raise ValueError(f"not an ack of a FLEET_TASKS delivery: {ack_subject!r}")
    await settle(lambda: nc.publish(ack_subject, Msg.Ack.Nak), what=what, budget_s=budget_s)


async def durable_pull(js: JetStreamContext, stream: str, durable: str, *, what: str,
                       budget_s: float = BROKER_BUDGET_S) -> JetStreamContext.PullSubscription:
    """Bind a shared durable pull consumer of `stream`. Retried like every broker call at
    start: a consumer-info request that timed out once (a 3-node cluster beside a CPU hog)
    ended the worker before its first heartbeat."""
    return await with_retry(lambda: js.pull_subscribe("", durable=durable, stream=stream),
                            what=what, budget_s=budget_s)
