"""`plan(state, now) -> Action | None`: a chain of small pure rules in priority order.

No I/O and no clock reads: `now` is passed in, so each rule is tested with a table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from fleet.wire.cluster import Instance
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import is_past
from fleet.worker.routing import Candidate, Wait, choose
from fleet.worker.state import PendingTask, WorkerState, group_layout
from fleet.worker.supervisor import compute_backoff

RESTART_BASE_S = 1.0
RESTART_CAP_S = 60.0
ADVERT_STALE_S = 45.0  # a runner summary older than this is ignored (refreshed every 20 s)
LIFECYCLE = {"idle": "connect_to_group", "connected": "load_model", "loaded": "warm_up"}


@dataclass(frozen=True)
class StopRunner:
    runner_id: str
    reason: str
    # Kill at once: a shard whose group changed is usually stuck in a ring receive from a
    # peer that left, and cannot read a Shutdown.
    now: bool = False


@dataclass(frozen=True)
class SpawnRunner:
    instance: Instance


@dataclass(frozen=True)
class AdvanceRunner:
    runner_id: str
    command: str  # one of LIFECYCLE's values


@dataclass(frozen=True)
class FinishPending:
    task_id: str
    reason: ErrorReason
    message: str


@dataclass(frozen=True)
class FetchInputs:
    task_id: str
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class Dispatch:
    task_id: str
    runner_id: str


@dataclass(frozen=True)
class HandOff:
    """Pass a waiting task to another node, whose runner `runner_id` should run it."""

    task_id: str
    node_id: str
    runner_id: str


@dataclass(frozen=True)
class HandBack:
    """A waiting task whose model this node no longer serves: give it back to JetStream."""

    task_id: str


@dataclass(frozen=True)
class Pull:
    model: str
    batch: int


Action = (
    StopRunner | SpawnRunner | AdvanceRunner | FinishPending | FetchInputs | Dispatch | HandOff
    | HandBack | Pull
)


def _orphaned(state: WorkerState) -> set[str]:
    """Runners to stop: their instance is no longer hosted here, its group changed (a shard
    moved: every rank restarts into the new ring), or the worker is stopping."""
    wanted = {inst.instance_id: group_layout(inst) for inst in state.hosted_instances()}
    return {
        r.runner_id for r in state.runners.values()
        if state.stopping or r.instance_id not in wanted or wanted[r.instance_id] != r.layout
    }


def stop_orphan_runner(state: WorkerState, now: float) -> Action | None:
    hosted = {inst.instance_id for inst in state.hosted_instances()}
    for runner_id in sorted(_orphaned(state)):
        runner = state.runners[runner_id]
        if runner.shutting_down:
            continue
        if runner.instance_id in hosted and not state.stopping:
            return StopRunner(runner_id, "its group changed", now=True)
        return StopRunner(runner_id, "instance removed")
    return None


def spawn_runner(state: WorkerState, now: float) -> Action | None:
    if state.stopping:
        return None
    for instance in state.hosted_instances():
        if instance.instance_id in state.starting or state.runner_for(instance.instance_id):
            continue
        failure = state.failures.get(instance.instance_id)
        wait = compute_backoff(failure.attempts, RESTART_BASE_S, RESTART_CAP_S) if failure else 0
        if failure and now < failure.last_at + wait:
            continue
        return SpawnRunner(instance)
    return None


def advance_runner(state: WorkerState, now: float) -> Action | None:
    """Move a runner one lifecycle step on. Never one being stopped (or about to be): a
    shutdown is final, and advancing it would undo it (the place-then-remove livelock)."""
    orphaned = _orphaned(state)
    for runner in state.runners.values():
        if runner.shutting_down or runner.runner_id in orphaned:
            continue
        command = LIFECYCLE.get(runner.status.state)
        if command and runner.command_sent != command:
            return AdvanceRunner(runner.runner_id, command)
    return None


def expire_pending(state: WorkerState, now: float) -> Action | None:
    moment = datetime.fromtimestamp(now, UTC)
    for task_id, pending in state.pending.items():
        if pending.handing_off is None and is_past(pending.task.deadline, moment):
            return FinishPending(task_id, ErrorReason.DEADLINE, "the task's deadline passed")
    return None


def fetch_inputs(state: WorkerState, now: float) -> Action | None:
    for task_id, pending in state.pending.items():
        if pending.inputs is None and not pending.fetching:
            return FetchInputs(task_id, tuple(pending.task.image_hashes()))
    return None


def hand_back(state: WorkerState, now: float) -> Action | None:
    """A task waits here only while an instance of its model is hosted here; once none is
    (removed, moved away), another node's worker should have it."""
    if state.stopping:
        return None  # the shutdown gives every waiting task back at once
    served = {inst.model for inst in state.hosted_instances()}
    for task_id, pending in state.pending.items():
        if pending.task.model not in served and not (pending.fetching or pending.handing_off):
            return HandBack(task_id)
    return None


def dispatch(state: WorkerState, now: float) -> Action | None:
    """The oldest waiting task goes to the cheapest runner (fleet.worker.routing): one of this
    node's, or another node's, which gets it by a hand-off."""
    for task_id, pending in sorted(state.pending.items(), key=lambda kv: kv[1].received_at):
        if pending.inputs is None or pending.handing_off is not None:
            continue
        candidates = [
            Candidate(r.runner_id, r.free_slots, len(r.in_flight), r.held, None,
                      r.prefill_blocks, len(r.prefill), r.warming_blocks)
            for r in state.runners.values()
            if r.model == pending.task.model and r.free_slots > 0 and not r.shutting_down
        ] + remote_candidates(state, pending, now)
        chosen = choose(pending.blocks, candidates, state.routing)
        if chosen is None or isinstance(chosen, Wait):  # a prefill of its prefix is on
            continue
        if chosen.node_id is None:
            return Dispatch(task_id, chosen.runner_id)
        return HandOff(task_id, chosen.node_id, chosen.runner_id)
    return None


def remote_candidates(state: WorkerState, pending: PendingTask, now: float) -> list[Candidate]:
    """Other nodes' runners of the task's model with room, by their fresh summaries. None for
    a task that must stay (handed in, or declined once), carries input images (fetched here
    already), has no whole prompt block to route by, or while this node is stopping."""
    if (pending.local_only or pending.inputs or not pending.blocks or state.stopping
            or not state.routing.prefix):
        return []
    return [
        Candidate(r.runner_id, r.slots - r.in_flight, r.in_flight, r.held, r.node_id,
                  r.prefill_blocks, r.prefilling)
        for r in state.remote.values()
        if r.model == pending.task.model and r.in_flight < r.slots
        and now - r.at <= ADVERT_STALE_S and r.at > state.silent.get(r.node_id, 0.0)
    ]


def declines_hand_off(state: WorkerState, model: str) -> str | None:
    """Why this node will not take a task handed to it for `model` now, or None to take it:
    it takes one only into a free slot (its waiting tasks count as taken slots), so a task
    never queues behind a node whose summary looked better than it is."""
    if state.stopping:
        return "stopping"
    free = sum(
        r.free_slots for r in state.runners.values() if r.model == model and not r.shutting_down
    )
    waiting = sum(1 for p in state.pending.values() if p.task.model == model)
    if free - waiting <= 0:
        return "no free slot"
    return None


def pull(state: WorkerState, now: float) -> Action | None:
    if state.stopping:
        return None
    free: dict[str, int] = {}
    for runner in state.runners.values():
        if not runner.shutting_down:
            free[runner.model] = free.get(runner.model, 0) + runner.free_slots
    for pending in state.pending.values():
        free[pending.task.model] = free.get(pending.task.model, 0) - 1
    for model, slots in sorted(free.items()):
        if slots > 0 and model not in state.pulling:
            return Pull(model, slots)
    return None


RULES = (
    stop_orphan_runner, spawn_runner, advance_runner, expire_pending, hand_back, fetch_inputs,
    dispatch, pull,
)


def plan(state: WorkerState, now: float) -> Action | None:
    for rule in RULES:
        if action := rule(state, now):
            return action
    return None
