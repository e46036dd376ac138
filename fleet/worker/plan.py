"""`plan(state, now) -> Action | None`: a chain of small pure rules in priority order.

No I/O and no clock reads: `now` is passed in, so each rule is tested with a table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from fleet.wire.cluster import Instance
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import Priority, is_past
from fleet.worker.preemption import Preempt, preempt, pull_to_preempt
from fleet.worker.priority import reserve_for
from fleet.worker.routes import first_to_a_sole_runner, routes, waits_for_a_full_runner
from fleet.worker.routing import Wait
from fleet.worker.state import WorkerState, group_layout, ranks_of, waiting_summary

RESTART_BASE_S = 1.0
RESTART_CAP_S = 60.0
# A drained model's next pull waits up to this long for the intakes its last fetch started
# (`pull_held_until`); an intake is a claim and a listing, a few ms.
INTAKE_HOLD_S = 0.05
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
    reserve: int = 0  # slots batch-class work must leave free (fleet.worker.priority)
    only: Priority | None = None  # pull this class only (fleet.worker.preemption)


@dataclass(frozen=True)
class EndProbe:
    """A slot of the model freed while its preemption probe waits for an interactive task:
    end the probe, so the slot gets a regular pull now (the probe holds the model's pull)."""

    model: str


Action = (
    StopRunner | SpawnRunner | AdvanceRunner | FinishPending | FetchInputs | Dispatch | HandOff
    | HandBack | Pull | EndProbe | Preempt
)
Rule = Callable[[WorkerState, float], Action | None]


def _orphaned(state: WorkerState) -> set[str]:
    """Runners to stop: their instance is no longer hosted here, its group changed (a shard
    moved: every rank restarts into the new ring), or the worker is stopping."""
    wanted = state.hosted_layouts()
    return {
        r.runner_id for r in state.runners.values()
        if state.stopping or r.instance_id not in wanted or wanted[r.instance_id] != r.layout
    }


def compute_backoff(attempts: int, base: float, cap: float) -> float:
    """Seconds to wait before restart number `attempts`: 0 for the first start, then
    base, 2·base, 4·base … up to cap. Pure: the caller adds it to its own `now`."""
    if attempts <= 0:
        return 0.0
    return min(cap, base * 2.0 ** min(attempts - 1, 64))


def stop_orphan_runner(state: WorkerState, now: float) -> Action | None:
    hosted = state.hosted_layouts()
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
        if failure and failure.ranks != ranks_of(group_layout(instance)):
            failure = None  # its group broke because a rank moved: restart into it at once
        wait = compute_backoff(failure.attempts, RESTART_BASE_S, RESTART_CAP_S) if failure else 0
        if failure and now < max(failure.last_at + wait, failure.held_until):
            continue  # backing off, or held for a gone peer's move (state.Failure)
        return SpawnRunner(instance)
    return None


def advance_runner(state: WorkerState, now: float) -> Action | None:
    """Move a runner one lifecycle step on. Never one being stopped (or about to be): a
    shutdown is final, and advancing it would undo it (the place-then-remove livelock)."""
    orphaned: set[str] | None = None  # found only for a runner with a step to take
    for runner in state.runners.values():
        command = LIFECYCLE.get(runner.status.state)
        if runner.shutting_down or not command or runner.command_sent == command:
            continue
        if orphaned is None:
            orphaned = _orphaned(state)
        if runner.runner_id not in orphaned:
            return AdvanceRunner(runner.runner_id, command)
    return None


def expire_pending(state: WorkerState, now: float) -> Action | None:
    if not state.pending or not waiting_summary(state.pending).deadlines:
        return None
    moment = datetime.fromtimestamp(now, UTC)
    for task_id, pending in state.pending.items():
        deadline = pending.task.deadline
        if deadline is not None and pending.handing_off is None and is_past(deadline, moment):
            return FinishPending(task_id, ErrorReason.DEADLINE, "the task's deadline passed")
    return None


def fetch_inputs(state: WorkerState, now: float) -> Action | None:
    if not state.pending or not waiting_summary(state.pending).unfetched:
        return None
    for task_id, pending in state.pending.items():
        if pending.inputs is None and not pending.fetching:
            return FetchInputs(task_id, tuple(pending.task.image_hashes()))
    return None


def hand_back(state: WorkerState, now: float) -> Action | None:
    """A task waits here only while an instance of its model is hosted here; once none is
    (removed, moved away), another node's worker should have it."""
    if state.stopping:
        return None  # the shutdown gives every waiting task back at once
    if not state.pending:
        return None
    served = state.hosted_models()
    if waiting_summary(state.pending).models <= served:
        return None
    for task_id, pending in state.pending.items():
        if pending.task.model not in served and not (pending.fetching or pending.handing_off):
            return HandBack(task_id)
    return None


def dispatch(state: WorkerState, now: float) -> Action | None:
    """The oldest waiting task that can go goes to the cheapest runner (fleet.worker.routing):
    one of this node's, or another node's, which gets it by a hand-off."""
    if not state.pending or not _slot_anywhere(state):
        return None
    if (sole := first_to_a_sole_runner(state)) is not None:
        return Dispatch(*sole)
    for task_id, _, decision in routes(state, now):
        if decision is None or isinstance(decision, Wait):  # its runner is busy with it
            continue
        if decision.node_id is None:
            return Dispatch(task_id, decision.runner_id)
        return HandOff(task_id, decision.node_id, decision.runner_id)
    return None


def _slot_anywhere(state: WorkerState) -> bool:
    """Whether a waiting task could be routed to a runner now: one here with a free slot,
    or another node's (routes offers those only when they have room). Without either every
    route is a wait or none, and `routes` (candidates and a choice for each waiting task:
    1.5 ms a plan at 64 waiting for a full runner) need not say so."""
    if state.remote and state.routing.prefix and not state.stopping:
        return True
    # A list, not any() over a generator: every plan, and one runner a model is usual.
    return bool([r for r in state.runners.values() if r.free_slots > 0 and not r.shutting_down])


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
    waiting += sum(1 for taking in state.receiving.values() if taking == model)
    if free - waiting <= 0:
        return "no free slot"
    return None


def pull(state: WorkerState, now: float) -> Action | None:
    """Fetch as many tasks of a model as its runners have free slots, less the tasks already
    waiting here for them; batch-class tasks leave one slot free when there are several. A
    task waiting for a runner with no free slot (its prefix is there) leaves the others'
    slots free, but the tasks waiting here never outnumber the slots."""
    if state.stopping:
        return None
    free: dict[str, int] = {}
    room: dict[str, int] = {}
    capacity: dict[str, int] = {}  # every slot of the model's runners, busy or not
    for runner in state.runners.values():
        if not runner.shutting_down:
            capacity[runner.model] = capacity.get(runner.model, 0) + runner.slots
            free[runner.model] = free.get(runner.model, 0) + runner.free_slots
            room[runner.model] = room.get(runner.model, 0) + (
                runner.slots if runner.takes_tasks else 0)
    if not any(slots > 0 for slots in free.values()):
        # Every count below only lowers `free`, and a pull or a probe's end needs some left:
        # a full node asks only pull_to_preempt (not 64 waiting tasks read a plan).
        return _pull_to_preempt_any(state, capacity)
    for model, taking in _by_model(state.receiving.values()).items():  # waiting soon
        room[model] = room.get(model, 0) - taking
        free[model] = free.get(model, 0) - taking
    for model, waiting in _waiting_by_model(state).items():
        room[model] = room.get(model, 0) - waiting
    # A waiting task takes a free slot unless it waits for a full runner. Which do is a
    # route for each (`routes`): asked only when a model could have a slot to pull for
    # even if none of its waiting tasks took one (a pull needs free and room both).
    if any(min(slots, room.get(model, 0)) > 0 for model, slots in free.items()):
        behind_full = {task_id for task_id, _, decision in routes(state, now)
                       if waits_for_a_full_runner(state, decision)}
        for task_id, pending in state.pending.items():
            if task_id not in behind_full:
                free[pending.task.model] = free.get(pending.task.model, 0) - 1
    for model, slots in sorted(free.items()):
        slots = min(slots, room.get(model, 0))
        if (slots > 0 and model not in state.pulling
                and pull_held_until(state, model, now) is None):
            return Pull(model, slots, reserve_for(capacity.get(model, 0)))
        if slots > 0 and model in state.probing:
            return EndProbe(model)
    return _pull_to_preempt_any(state, capacity)


def _waiting_by_model(state: WorkerState) -> Mapping[str, int]:
    """How many tasks of each model wait here. The waiting tasks' models are kept a plan
    (`waiting_summary`): tasks of one model are counted by len, not read one by one."""
    if not state.pending:
        return {}
    models = {model for model, _ in waiting_summary(state.pending).classes}
    if len(models) == 1:  # every waiting task is of it (the summary's are a superset)
        return {models.pop(): len(state.pending)}
    return Counter(pending.task.model for pending in state.pending.values())


def _by_model(models: Collection[str]) -> Mapping[str, int]:
    """How many times each model is in `models`: by a set and len for one model (C
    calls), by a Counter for several."""
    if len(one := set(models)) == 1:
        return {one.pop(): len(models)}
    return Counter(models)


def _pull_to_preempt_any(state: WorkerState, capacity: dict[str, int]) -> Action | None:
    for model in sorted(capacity):
        if pull_to_preempt(state, model):
            return Pull(model, 1, only="interactive")
    return None


def pull_held_until(state: WorkerState, model: str, now: float) -> float | None:
    """When the hold on `model`'s next pull ends, or None when it is not held. A fetch
    that came back with fewer tasks than it asked for found the queue empty: the next pull
    waits while the intakes that fetch started are younger than INTAKE_HOLD_S, so the tasks
    already here reach their runner first. Pulled at once, its round trips (a pull for each
    class, the tenant lanes' counts and pulls, the long wait) shared the loop and the broker
    with each intake's claim and listing, at light load on every task (issue 23). After a
    full fetch more may be queued: pulled at once."""
    if model not in state.drained:
        return None
    began, receiving = state.intake_began, state.receiving
    if began.keys() <= receiving.keys() and set(receiving.values()) == {model}:
        # Every intake is of this model (one model a node, the usual): the youngest by a max
        # in C, not a Python read of each (64 a plan under batches, and twice a drive).
        youngest = max(began.values(), default=None)
        until = None if youngest is None else youngest + INTAKE_HOLD_S
    else:
        until = max((at + INTAKE_HOLD_S for key, at in began.items()
                     if receiving.get(key) == model), default=None)
    return until if until is not None and until > now else None


def pulls_held_until(state: WorkerState, now: float) -> float | None:
    """The earliest end of a hold on any model's pull (`pull_held_until`): when to plan
    again if no intake has answered by then."""
    return min((until for model in state.drained
                if (until := pull_held_until(state, model, now)) is not None), default=None)


RULES = (
    stop_orphan_runner, spawn_runner, advance_runner, expire_pending, hand_back, fetch_inputs,
    dispatch, preempt, pull,
)
# What the loop plans by right after a Dispatch (Worker._drive): its TaskDispatched only takes
# a task off `pending` into a runner's flight, and no rule before `dispatch` can find work in
# that (they read runners' instances, statuses and commands, or act on a waiting task, of
# which there is one fewer). Their clock's work (a deadline, a restart's backoff) waits for
# the loop's next plan, as it waits for a tick. A fetched batch's dispatches so cost one
# pass of the rules that read every waiting task (issue 23), not one each.
AFTER_DISPATCH = RULES[RULES.index(dispatch):]


def plan(state: WorkerState, now: float, rules: tuple[Rule, ...] = RULES) -> Action | None:
    for rule in rules:
        if action := rule(state, now):
            return action
    return None
