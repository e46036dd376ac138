"""Every model's durables keep the configuration Fleet gave them: `tasks-<model>` (the
default class) and the other priority classes' `interactive-tasks-<model>` and
`batch-tasks-<model>` (fleet.worker.priority), each checked once this worker has bound it.

Workers may create and update consumers on FLEET_TASKS (a model's durable is made when it is
placed), so one compromised worker could update `tasks-<model>` with another filter, a
1-message ack window or an inactive threshold and halt the model for every node. Each worker
compares the durables it pulls from with the definition (ops/jetstream/consumers/tasks.json
with its --max-deliver and --ack-wait, the class's filter) when it binds one and every
CHECK_INTERVAL_S, restores
what differs, and when the server refuses the restore stops pulling that model: an error log
line naming the consumer and each difference, and the counter
`fleet.worker.consumer_repairs{model, outcome}` (restored | stopped | passed_over: tasks it
will not deliver stayed for two checks), are the operator's alert. Tasks passed over while a
filter pointed elsewhere are delivered again (`ConsumerGuard.passed_over`). A durable deleted
outright is the puller's to make again (fleet.worker.pulls: its next pull of that class fails).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from nats.aio.client import Client
from opentelemetry.metrics import Meter

from fleet.bus.provision import consumer_definition
from fleet.bus.retry import is_transient
from fleet.bus.task_queue import TaskQueue
from fleet.wire import subjects

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 10.0  # one CONSUMER.INFO per placed model per interval: ~0.3 ms each
# Keys whose value decides which tasks a worker gets and when; a consumer made by Fleet has
# no inactive threshold (0) and a single filter.
GUARDED = ("durable_name", "filter_subject", "deliver_policy", "ack_policy", "ack_wait",
           "max_deliver", "max_ack_pending", "max_waiting", "replay_policy")
_ABSENT: dict[str, Any] = {"inactive_threshold": 0, "filter_subjects": []}
# A worker's own settings: when a worker binds, another value is another worker's settings
# (ensure_task_consumer reports that conflict); once it pulls, any change is restored.
SETTINGS = frozenset({"max_deliver", "ack_wait"})


def consumer_drift(
    wanted: dict[str, Any], actual: dict[str, Any], skip: frozenset[str] = frozenset()
) -> list[str]:
    """What `actual` (the server's consumer config) has that `wanted` does not, leaving out
    the keys in `skip`: one line per key, empty when they agree. Pure."""
    drift = [
        f"{key}: {actual.get(key)!r}, wanted {wanted[key]!r}"
        for key in GUARDED
        if key in wanted and key not in skip and actual.get(key) != wanted[key]
    ]
    drift += [
        f"{key}: {actual[key]!r}, wanted none"
        for key, none in _ABSENT.items() if actual.get(key, none) not in (none, None)
    ]
    return drift


def skipped_tasks(stored: int, pending: int, ack_pending: int) -> int:
    """Messages of a model's subject its durable will never deliver: in a work queue a
    message stays until acked, so whatever the stream holds beyond what the consumer still
    owes or awaits was passed over. Pure."""
    return max(0, stored - pending - ack_pending)


def _position(info: dict[str, Any]) -> tuple[Any, ...]:
    """What changes when a consumer delivers, is acked or is owed a new task."""
    return (info.get("delivered", {}).get("stream_seq"), info.get("ack_floor", {}).get(
        "stream_seq"), info.get("num_pending"), info.get("num_ack_pending"))


def passed_over_at(info: dict[str, Any], seq: int) -> bool:
    """Whether the task at stream sequence `seq` of the durable's subject was passed over,
    by its consumer info: after the last delivery, and nothing owed. Pure."""
    delivered = info.get("delivered", {}).get("stream_seq", 0)
    return seq > delivered and info.get("num_pending") == 0


class Puller(Protocol):
    subs: dict[str, Any]  # model -> the default class's subscription
    class_subs: dict[tuple[str, str], Any]  # (model, class) -> the other classes'

    async def stop_pulling(self, model: str, reason: str) -> None: ...


class ConsumerGuard:
    def __init__(
        self, nc: Client, puller: Puller, max_deliver: int, ack_wait_s: float,
        meter: Meter | None = None, interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.queue = TaskQueue(nc)  # each call within the broker budget (an election, not more)
        self.puller = puller
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.interval_s = interval_s
        self.streaks: dict[str, int] = {}  # durable -> checks in a row with tasks passed over
        self.repairs = meter.create_counter(
            "fleet.worker.consumer_repairs", unit="{repair}",
            description="Durable task consumers found changed: restored, or pulling stopped",
        ) if meter else None

    def wanted(self, model: str, priority: str = "default") -> dict[str, Any]:
        return consumer_definition(model, self.max_deliver, self.ack_wait_s, priority)

    def bound(self, model: str) -> list[str]:
        """The classes of `model` whose durables this worker has bound, default first."""
        return ([*(["default"] if model in self.puller.subs else []),
                 *(p for (m, p) in self.puller.class_subs if m == model)])

    async def check(self, model: str, priority: str = "default", *, binding: bool = False) -> str:
        """"ok", "restored" or "stopped" (the restore was refused: pulling that model ends).
        `binding`: before this worker pulls, its SETTINGS are left to ensure_task_consumer."""
        name = subjects.durable(model, priority)
        info = await self.queue.durable_json(name)
        if info is None:
            return "ok"  # gone: the puller recreates it on its next failed fetch
        actual = info["config"]
        skip = SETTINGS if binding else frozenset()
        wanted = {**self.wanted(model, priority), **{k: actual[k] for k in skip if k in actual}}
        drift = consumer_drift(wanted, actual)
        if not drift:
            return "ok"
        restored = await self.queue.put_durable(name, {**wanted, "inactive_threshold": 0})
        left = consumer_drift(wanted, restored.get("config") or actual)
        if "error" not in restored and not left:
            log.error("consumer %s was changed (%s): restored; a NATS user with worker or "
                      "operator credentials did it", name, "; ".join(drift))
            await self.passed_over(model, priority)
            self._count(model, "restored")
            return "restored"
        why = restored.get("error", {}).get("description") or "; ".join(left)
        log.error("consumer %s was changed (%s) and cannot be restored (%s): this worker stops "
                  "pulling %s; remove and re-place the model as the operator", name,
                  "; ".join(drift), why, model)
        await self.puller.stop_pulling(model, f"consumer {name} changed: {why}")
        self._count(model, "stopped")
        return "stopped"

    async def passed_over(self, model: str, priority: str = "default") -> int | None:
        """Tasks of `model` in FLEET_TASKS that its durable will not deliver; those after its
        last delivery are delivered again by a reset, and the count of the rest is returned.

        A filter pointed elsewhere for a while (changed and restored, even between two
        checks) moves the consumer's position past the tasks published meanwhile, and
        restoring the filter does not move it back: the server then owes nothing (no pending)
        while a task waits after the last delivery. The durable is reset to that task
        (`CONSUMER.RESET`), which delivers it and every later one. A reset counts deliveries
        below it as acknowledged: their holders still ack them (which removes them), but
        should a holder die its task is not redelivered: the log says how many were in
        flight. Tasks passed over below the last delivery (a position moved forward) cannot be
        told from tasks past MaxDeliver that the janitor has not moved yet: they are counted
        (skipped_tasks) for `round` to report when they stay; None when the consumer moved
        while they were counted (tasks flowing), so the count would mean nothing."""
        name, subject = subjects.durable(model, priority), subjects.tasks(model, priority)
        info = await self.queue.durable_json(name)
        if info is None:
            return 0
        after = info.get("delivered", {}).get("stream_seq", 0) + 1
        seq = await self.queue.first_seq_on(subject, after)
        if seq is not None:
            # Asked again after the look-up: a task published meanwhile is pending by now, or
            # already delivered (then the last delivery is at or past it). Only a task after
            # the last delivery that the server does not owe was passed over.
            again = await self.queue.durable_json(name)
            if again is not None and passed_over_at(again, seq):
                await self._reset(name, seq, again.get("num_ack_pending", 0))
                info = await self.queue.durable_json(name) or {"error": "gone"}
        stored = await self.queue.stored_on(subject)
        after_count = await self.queue.durable_json(name)
        if after_count is None or _position(after_count) != _position(info):
            return None
        return skipped_tasks(stored, info.get("num_pending", 0), info.get("num_ack_pending", 0))

    async def _reset(self, name: str, seq: int, in_flight: int) -> None:
        reset = await self.queue.reset_durable(name, seq)
        if "error" in reset:
            log.error("consumer %s passed over tasks from stream sequence %d, which stay "
                      "queued: the reset was refused (%s)", name, seq,
                      reset["error"].get("description"))
            return
        log.error("consumer %s passed over tasks (its position moved while its filter pointed "
                  "elsewhere): reset to stream sequence %d, they are delivered%s", name, seq,
                  f"; {in_flight} task(s) in flight are no longer redelivered should their "
                  "worker die" if in_flight else "")

    def _count(self, model: str, outcome: str) -> None:
        if self.repairs is not None:
            self.repairs.add(1, {"model": model, "outcome": outcome})

    async def round(self, model: str) -> None:
        """One check of each bound durable of `model` (default first, then the other classes
        bound): its configuration, then the tasks it passes over, reported once when they
        stay for two checks in a row (the janitor moves tasks past MaxDeliver within one)."""
        for priority in self.bound(model) or ["default"]:
            if await self.check(model, priority) == "stopped":
                return  # pulls of the whole model stopped: nothing more to look after
            await self._count_passed_over(model, priority)

    async def _count_passed_over(self, model: str, priority: str) -> None:
        skipped = await self.passed_over(model, priority)
        if skipped is None:
            return  # tasks flowing: no count this time
        name = subjects.durable(model, priority)
        streak = self.streaks[name] = self.streaks.get(name, 0) + 1 if skipped else 0
        if streak == 2:
            log.error("consumer %s: %d task(s) of %s stay in %s and will not be delivered "
                      "(its position was moved past them); the operator can deliver them by "
                      "a reset of the consumer ($JS.API.CONSUMER.RESET) to the first of them",
                      name, skipped, model, subjects.TASKS_STREAM)
            self._count(model, "passed_over")

    async def forever(self) -> None:
        """Check every bound durable each interval; a broker outage only skips a round."""
        while True:
            await asyncio.sleep(self.interval_s)
            bound = [*self.puller.subs, *(model for model, _ in self.puller.class_subs)]
            for model in dict.fromkeys(bound):
                try:
                    await self.round(model)
                except Exception as exc:
                    if not is_transient(exc):
                        log.warning("consumer %s not checked: %r", subjects.durable(model), exc)
