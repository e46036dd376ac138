"""Priority classes: which class a worker pulls first, how much of its slack batch work may
take, when a starved class is promoted, and which running task yields to a waiting one.

Three classes, highest first: interactive, default, batch. Each has its own subject and
durable consumer per model (`fleet.tasks.<model>[.<class>]`, fleet.wire.subjects), so the
broker keeps them apart and a worker chooses by pulling:

- Order: a pull takes from interactive first, then default, then batch (`pull_order`).
- Slack: batch takes at most `free - reserve` slots, where `reserve` is one slot of a model
  whose runners have more than one (`reserve_for`): an interactive task that arrives while
  batch work runs finds a free slot and joins the running batch at the next engine step,
  so batch delays it by at most one step. A single-slot runner has no slack to keep; there
  batch runs only when nothing else waits, and a batch task that has not sent its first
  token yields to a waiting interactive task (`yields_to`; fleet.worker.preemption wires it).
- Starvation: a lower class this worker has not served for PROMOTE_AFTER_S seconds is pulled
  ahead of the class above it (and ignores the reserve) for one pull; serving it resets the
  clock. So a queued batch task waits at most PROMOTE_AFTER_S["batch"] plus one task's run on
  a busy worker, a default task PROMOTE_AFTER_S["default"].

Pure: the clock and what the worker served are passed in; tested with tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleet.priorities import CLASSES, RANK
from fleet.wire.tasks import Priority

__all__ = ["CLASSES", "PROMOTE_AFTER_S", "Running", "Turn", "pull_order", "quota",
           "reserve_for", "yields_to"]

PROMOTE_AFTER_S: dict[str, float] = {"default": 30.0, "batch": 120.0}


def reserve_for(slots: int) -> int:
    """Slots of a model batch work leaves free: one, when its runners have more than one."""
    return 1 if slots > 1 else 0


@dataclass(frozen=True)
class Turn:
    priority: Priority
    promoted: bool = False  # pulled ahead of its rank because it was starved


def pull_order(last_served: Mapping[str, float], now: float) -> tuple[Turn, ...]:
    """The classes in the order a pull takes them; a starved class moves one place up."""
    order = [Turn(name) for name in CLASSES]
    for rank in range(1, len(order)):
        name = order[rank].priority
        waited = now - last_served.get(name, now)
        if name in PROMOTE_AFTER_S and waited > PROMOTE_AFTER_S[name]:
            order[rank - 1], order[rank] = Turn(name, promoted=True), order[rank - 1]
    return tuple(order)


def quota(turn: Turn, free: int, reserve: int) -> int:
    """How many tasks of this turn's class a pull with `free` slots may take."""
    if turn.priority == "batch" and not turn.promoted:
        return max(0, free - reserve)
    if turn.promoted:
        return min(free, 1)  # promotion unblocks one task; the next pull is in order again
    return free


@dataclass(frozen=True)
class Running:
    task_id: str
    priority: Priority
    first_token_sent: bool
    started_at: float


def yields_to(running: Sequence[Running], waiting: Priority) -> str | None:
    """The running task to preempt (requeue, not fail) for a waiting task of class `waiting`
    when no slot is free: one of a lower class that has sent no token yet (nothing of it
    reached a client, so it can start again elsewhere unseen), the lowest class first and,
    within it, the newest (it lost the least work). None when no task may yield."""
    candidates = [r for r in running
                  if not r.first_token_sent and RANK[r.priority] > RANK[waiting]]
    if not candidates:
        return None
    return max(candidates, key=lambda r: (RANK[r.priority], r.started_at)).task_id
