"""A text engine that is one rank of a sharded instance, stepping in lockstep with the others.

Every rank runs the same engine (batch generator, prefix cache, samplers, stop rules) over its
own layers, and the pipeline gives every rank the same logits, so the same inputs give every
rank the same batch at every step. The inputs that are not the same everywhere are what rank
0 is told by its worker: tasks to admit and tasks to cancel. So rank 0 decides them and sends
them, as a `StepPlan`, before each step; the other ranks apply the plan, then step. Finishes
need no message: each rank reaches them itself from the same tokens. A sampled task without a
seed gets one here, so that every rank draws the same tokens.

Only rank 0 reports events; the others' are the same and only make that rank's spans (its
prefill and decode in the task's trace, with `fleet.rank`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import replace

from fleet.errors import TaskRejected
from fleet.runner.engine import Admission, EngineEvent, GroupLost, Progress
from fleet.runner.ring import PlanChannel, join_ring, lost
from fleet.runner.text import TextEngine
from fleet.wire.pipe import SubmitTask
from fleet.wire.ring import GroupSpec, PlannedAdmission, StepPlan
from fleet.wire.tasks import TextGeneration

log = logging.getLogger(__name__)


class LockstepEngine:
    def __init__(
        self, inner: TextEngine, group: GroupSpec, last_words: Callable[[str], None],
    ) -> None:
        """`last_words(reason)` reports the runner failed when its ring never forms."""
        self.inner = inner
        self.group = group
        self._last_words = last_words
        self._channel: PlanChannel | None = None
        self._admitted: list[PlannedAdmission] = []
        self._cancel_lock = threading.Lock()
        self._cancels: set[str] = set()

    @property
    def leads(self) -> bool:
        return self.group.rank == 0

    def connect(self) -> None:
        ring = join_ring(self.group, self._last_words)
        self.inner.use_ring(ring, self.group.start_layer, self.group.end_layer)
        self._channel = PlanChannel(ring)

    def load(self, progress: Progress) -> None:
        self.inner.load(progress)

    def warm_up(self) -> None:
        self.inner.warm_up()  # the same fixed tasks on every rank: no plan needed

    def admit(self, admission: Admission) -> None:
        task = admission.task
        if isinstance(task, TextGeneration) and task.temperature > 0 and task.seed is None:
            admission = replace(
                admission, task=task.model_copy(update={"seed": secrets.randbits(63)})
            )
        self.inner.admit(admission)  # a TaskRejected is rank 0's alone: nothing is planned
        assert isinstance(admission.task, TextGeneration)
        self._admitted.append(PlannedAdmission(
            task=admission.task, generated=list(admission.generated),
            queue_wait_s=admission.queue_wait_s, traceparent=admission.traceparent,
            tracestate=admission.tracestate,
        ))

    def cancel(self, task_id: str) -> None:
        """Thread-safe; applied on every rank at the next step."""
        with self._cancel_lock:
            self._cancels.add(task_id)

    def step(self) -> list[EngineEvent]:
        with self._cancel_lock:
            cancels, self._cancels = sorted(self._cancels), set()
        plan = StepPlan(admit=self._admitted, cancel=cancels)
        self._admitted = []
        try:
            self._require_channel().send(plan)
            for task_id in cancels:
                self.inner.cancel(task_id)
            return self.inner.step()
        except RuntimeError as exc:
            if lost(exc):
                raise GroupLost(f"rank 0 lost its group: {exc}") from exc
            raise

    def follow(
        self, admitted: Callable[[SubmitTask], None], emit: Callable[[EngineEvent], None],
    ) -> None:
        """A rank > 0: apply rank 0's plans and step, until rank 0 stops the group. Each
        admission and event also goes to `admitted` and `emit` (this rank's spans)."""
        channel = self._require_channel()
        try:
            while not (plan := channel.receive()).stop:
                for planned in plan.admit:
                    admitted(SubmitTask(
                        task=planned.task, generated=planned.generated,
                        queue_wait_s=planned.queue_wait_s, traceparent=planned.traceparent,
                        tracestate=planned.tracestate,
                    ))
                    try:
                        self.inner.admit(Admission(
                            task=planned.task, generated=tuple(planned.generated),
                            queue_wait_s=planned.queue_wait_s,
                        ))
                    except TaskRejected as exc:  # rank 0 admitted it: the ranks disagree
                        raise GroupLost(f"rank {self.group.rank} could not admit "
                                        f"{planned.task.task_id} as rank 0 did: {exc}") from exc
                for task_id in plan.cancel:
                    self.inner.cancel(task_id)
                for event in self.inner.step():
                    emit(event)
        except RuntimeError as exc:
            if lost(exc):
                raise GroupLost(f"rank {self.group.rank} lost its group: {exc}") from exc
            raise

    @property
    def active(self) -> int:
        return self.inner.active

    def close(self) -> None:
        if self.leads and self._channel is not None:
            try:
                self._channel.send(StepPlan(stop=True))
            except RuntimeError as exc:
                log.warning("could not tell the other ranks to stop: %s", exc)
        self.inner.close()

    def _require_channel(self) -> PlanChannel:
        if self._channel is None:
            raise RuntimeError("the runner has not joined its group")
        return self._channel
