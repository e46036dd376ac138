"""Every model's durable `tasks-<model>` keeps the configuration Fleet gave it.

Workers may create and update consumers on FLEET_TASKS (a model's durable is made when it is
placed), so one compromised worker could update `tasks-<model>` with another filter, a
1-message ack window or an inactive threshold and halt the model for every node. Each worker
compares the durables it pulls from with the definition (ops/jetstream/consumers/tasks.json
with its --max-deliver and --ack-wait) when it binds one and every CHECK_INTERVAL_S, restores
what differs, and when the server refuses the restore stops pulling that model: an error log
line naming the consumer and each difference, and the counter
`fleet.worker.consumer_repairs{model, outcome}` (restored | stopped), are the operator's alert.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from nats.aio.client import Client
from opentelemetry.metrics import Meter

from fleet.bus.provision import consumer_definition, jetstream_api
from fleet.bus.retry import is_transient
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


class Puller(Protocol):
    subs: dict[str, Any]

    async def stop_pulling(self, model: str, reason: str) -> None: ...


class ConsumerGuard:
    def __init__(
        self, nc: Client, puller: Puller, max_deliver: int, ack_wait_s: float,
        meter: Meter | None = None, interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.nc = nc
        self.puller = puller
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.interval_s = interval_s
        self.repairs = meter.create_counter(
            "fleet.worker.consumer_repairs", unit="{repair}",
            description="Durable task consumers found changed: restored, or pulling stopped",
        ) if meter else None

    def wanted(self, model: str) -> dict[str, Any]:
        return consumer_definition(model, self.max_deliver, self.ack_wait_s)

    async def check(self, model: str, *, binding: bool = False) -> str:
        """"ok", "restored" or "stopped" (the restore was refused: pulling that model ends).
        `binding`: before this worker pulls, its SETTINGS are left to ensure_task_consumer."""
        name = subjects.durable(model)
        info = await jetstream_api(self.nc, f"CONSUMER.INFO.{subjects.TASKS_STREAM}.{name}")
        if "error" in info:
            return "ok"  # gone: the puller recreates it on its next failed fetch
        actual = info["config"]
        skip = SETTINGS if binding else frozenset()
        wanted = {**self.wanted(model), **{k: actual[k] for k in skip if k in actual}}
        drift = consumer_drift(wanted, actual)
        if not drift:
            return "ok"
        restored = await jetstream_api(
            self.nc, f"CONSUMER.CREATE.{subjects.TASKS_STREAM}.{name}",
            {"stream_name": subjects.TASKS_STREAM, "config": {**wanted, "inactive_threshold": 0}},
        )
        left = consumer_drift(wanted, restored.get("config") or actual)
        if "error" not in restored and not left:
            log.error("consumer %s was changed (%s): restored; a NATS user with worker or "
                      "operator credentials did it", name, "; ".join(drift))
            await self._deliver_skipped(model, name)
            self._count(model, "restored")
            return "restored"
        why = restored.get("error", {}).get("description") or "; ".join(left)
        log.error("consumer %s was changed (%s) and cannot be restored (%s): this worker stops "
                  "pulling %s; remove and re-place the model as the operator", name,
                  "; ".join(drift), why, model)
        await self.puller.stop_pulling(model, f"consumer {name} changed: {why}")
        self._count(model, "stopped")
        return "stopped"

    async def _deliver_skipped(self, model: str, name: str) -> None:
        """Tasks published while the filter pointed elsewhere were passed over: the consumer's
        position moved beyond them, and a restored filter does not move it back. Counted as
        what the stream holds on the model's subject beyond what the consumer still owes
        (pending) or awaits (ack pending); then the consumer is reset to the first task after
        its last delivery, which delivers them. A reset counts the deliveries below it as
        acknowledged: their holders still ack them (which removes them), but should a holder
        die, the server no longer redelivers its task: said in the log."""
        subject, stream = subjects.tasks(model), subjects.TASKS_STREAM
        info = await jetstream_api(self.nc, f"CONSUMER.INFO.{stream}.{name}")
        held = await jetstream_api(self.nc, f"STREAM.INFO.{stream}", {"subjects_filter": subject})
        stored = (held.get("state", {}).get("subjects") or {}).get(subject, 0)
        skipped = skipped_tasks(stored, info.get("num_pending", 0), info.get("num_ack_pending", 0))
        if not skipped:
            return
        after = info.get("delivered", {}).get("stream_seq", 0) + 1
        first = await jetstream_api(self.nc, f"STREAM.MSG.GET.{stream}",
                                    {"seq": after, "next_by_subj": subject})
        seq = first.get("message", {}).get("seq")
        if seq is None:
            return
        reset = await jetstream_api(self.nc, f"CONSUMER.RESET.{stream}.{name}", {"seq": seq})
        if "error" in reset:
            log.error("consumer %s: %d task(s) passed over while it was changed stay queued: "
                      "the reset was refused (%s)", name, skipped,
                      reset["error"].get("description"))
            return
        log.error("consumer %s: %d task(s) passed over while it was changed are delivered "
                  "again (reset to stream sequence %d)%s", name, skipped, seq,
                  f"; {info['num_ack_pending']} task(s) in flight are no longer redelivered "
                  "should their worker die" if info.get("num_ack_pending") else "")

    def _count(self, model: str, outcome: str) -> None:
        if self.repairs is not None:
            self.repairs.add(1, {"model": model, "outcome": outcome})

    async def forever(self) -> None:
        """Check every bound durable each interval; a broker outage only skips a round."""
        while True:
            await asyncio.sleep(self.interval_s)
            for model in list(self.puller.subs):
                try:
                    await self.check(model)
                except Exception as exc:
                    if not is_transient(exc):
                        log.warning("consumer %s not checked: %r", subjects.durable(model), exc)
