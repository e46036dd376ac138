"""Preemption: a waiting interactive task takes the slot of a lower-class task that has not
sent its first token yet (fleet.worker.priority.yields_to chooses which).

Two pure planner rules over the worker's state:

- `preempt`: a model's runners here have no free slot, interactive tasks wait here ready to
  run (more than the tasks already yielding to them), and a running task of a lower class is
  still prefilling: cancel it in its runner (`Preempt`). Its cancelled terminal is not the
  task's end: the worker queues it here again, its message still held (no JetStream verb, so
  no delivery is spent and no takeover fence is needed); it runs again from the start, with
  the seed it was first dispatched with, once a slot frees after the interactive task.
- `pull_to_preempt`: the same runners full and nothing waiting here, but a running task that
  could yield: pull one interactive task (nothing of another class), so a task waiting on the
  interactive subject is seen at all while every slot is busy.

A task whose first token came after the decision (the runner had it on its way) is not queued
again from the start: it is handed back with its output begun, and its redelivery continues
from the stored tokens like any worker loss (fleet.worker.continuation).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.priorities import RANK
from fleet.wire.tasks import Priority
from fleet.worker.priority import Running, yields_to
from fleet.worker.state import CancelOrigin, Place, RunnerView, WorkerState, waiting_summary

WAITING_CLASS: Priority = "interactive"  # the class that may take a running task's slot
_WAITING_RANK = RANK[WAITING_CLASS]


@dataclass(frozen=True)
class Preempt:
    task_id: str
    runner_id: str


def _runners(state: WorkerState, model: str) -> list[RunnerView]:
    return [r for r in state.runners.values()
            if r.model == model and r.takes_tasks and not r.shutting_down]


def _yielding(state: WorkerState, runners: list[RunnerView]) -> int:
    return sum(1 for r in runners for task_id in r.in_flight
               if state.task(task_id).cancel is CancelOrigin.PREEMPTED)


def _may_yield(state: WorkerState, runners: list[RunnerView]) -> list[tuple[Running, str]]:
    """Running tasks that may yield (`_can_yield`), in a stable order."""
    return [
        (Running(task_id, r.classes[task_id][0], False, r.classes[task_id][1]), r.runner_id)
        for r in runners for task_id in sorted(r.prefill) if _can_yield(state, r, task_id)
    ]


def _can_yield(state: WorkerState, runner: RunnerView, task_id: str) -> bool:
    """A task of `runner` still prefilling (`prefill`: nothing sent yet) may yield when its
    class is below WAITING_CLASS and it is not already yielding: `yields_to` chooses among
    no others, and a full runner's tasks of WAITING_CLASS are so left out before a Running
    is made of each, every plan."""
    queued = runner.classes.get(task_id)
    return (queued is not None and RANK[queued[0]] > _WAITING_RANK
            and state.task(task_id).cancel is None)


def _models(state: WorkerState) -> list[str]:
    return sorted({r.model for r in state.runners.values()})


def preempt(state: WorkerState, now: float) -> Preempt | None:
    if state.stopping or not state.pending:  # nothing waits here to take a slot
        return None
    for model in _models(state):
        runners = _runners(state, model)
        if not runners or any(r.free_slots for r in runners):
            continue
        if (model, WAITING_CLASS) not in waiting_summary(state.pending).classes:
            continue  # no interactive task of it waits (none read: a summary kept a plan)
        waiting = sum(1 for task_id, p in state.pending.items()
                      if p.task.model == model and p.task.priority == WAITING_CLASS
                      and state.place_of(task_id) is Place.WAITING_SLOT)
        # No interactive task waits: no runner's tasks need reading (64 a full runner).
        if not waiting or waiting <= _yielding(state, runners):
            continue
        candidates = _may_yield(state, runners)
        victim = yields_to([running for running, _ in candidates], WAITING_CLASS)
        if victim is not None:
            return Preempt(victim, next(rid for r, rid in candidates if r.task_id == victim))
    return None


def pull_to_preempt(state: WorkerState, model: str) -> bool:
    """Whether to pull one interactive task of `model` although no slot is free here."""
    if state.stopping or model in state.pulling:
        return False
    runners = _runners(state, model)
    if not runners or any(r.free_slots for r in runners):
        return False
    if any(p.task.model == model for p in state.pending.values()) or any(
            m == model for m in state.receiving.values()):
        return False
    # Whether `yields_to` would choose one: any task that may yield (no list, no order).
    return any(_can_yield(state, r, task_id) for r in runners for task_id in r.prefill)
