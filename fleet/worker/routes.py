"""Every waiting task's routing decision at once, oldest first: pure, `routes(state, now)`.

Tasks are decided by class (interactive first), then in the order they came, and a task that
waits for a runner adds what it will cost there to that runner's `waiting_blocks`, so the next
task sees the queue forming in front of it (fleet.worker.routing). `dispatch` acts on the first
task that can go; `pull` counts the tasks waiting for a runner without a free slot, since they
do not take the free slots of others.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from operator import attrgetter

from fleet.priorities import RANK
from fleet.wire.cluster import Instance
from fleet.worker.routing import Candidate, Wait, choose
from fleet.worker.state import (
    OfTheLast,
    PendingTask,
    RemoteRunner,
    RunnerView,
    WorkerState,
    waiting_summary,
)

# A node that left a hand-off unanswered is tried again once it advertises again, or after
# this long (adverts are written on change only: an idle node's may never come).
SILENT_S = 45.0
SPARE_CORE = 0.5  # idle CPU, in cores, from which a node counts as having one to spare

Decision = Candidate | Wait | None


def routes(state: WorkerState, now: float) -> Iterator[tuple[str, PendingTask, Decision]]:
    """(task id, task, decision) for each task ready to be routed, oldest first."""
    waiting: dict[str, float] = {}
    # Read once per call, and only when another node's runner could be chosen.
    hosts = hosted(state.instances) if state.remote and state.pending else frozenset()
    # This node's runners of a model as candidates, made once per call for all its tasks
    # (they read the runners only; up to 64 tasks a call in `pull`, each a Candidate a runner).
    local: dict[str, list[Candidate]] = {}
    for task_id, pending in _in_order(state.pending):
        if pending.inputs is None or pending.handing_off is not None:
            continue
        if (candidates := local.get(pending.task.model)) is None:
            candidates = local[pending.task.model] = local_candidates(state, pending)
        if waiting:  # a runner no earlier task waits for keeps its candidate as made
            candidates = [replace(c, waiting_blocks=waiting[c.runner_id])
                          if c.runner_id in waiting else c for c in candidates]
        if remote := remote_candidates(state, pending, now, hosts):
            candidates = candidates + remote
        decision = choose(pending.blocks, candidates, state.routing)
        if isinstance(decision, Wait):
            waiting[decision.runner_id] = (waiting.get(decision.runner_id, 0.0)
                                           + _queued_cost(state, pending, decision))
        yield task_id, pending, decision


def first_to_a_sole_runner(state: WorkerState) -> tuple[str, str] | None:
    """(task id, runner id): the first task `routes` decides and the runner it chooses, when
    that choice needs no costs: no other node's runner is known, and the task's model has one
    runner here that takes tasks, with a free slot and no prefill in progress that holds more
    of the prompt (`choose`'s sole candidate). None when it needs more: ask `routes`. The
    common case (one runner a model, a plan a dispatch: issue 23) without a candidate made."""
    if state.remote:
        return None
    for task_id, pending in _in_order(state.pending):
        if pending.inputs is None or pending.handing_off is not None:
            continue
        model = pending.task.model
        sole: RunnerView | None = None
        for runner in state.runners.values():
            if runner.model == model and not runner.shutting_down and runner.takes_tasks:
                if sole is not None:
                    return None  # several: their costs decide
                sole = runner
        if sole is None or sole.free_slots <= 0:
            return None  # routes goes on to the next task (a wait, or none here)
        blocks = pending.blocks
        if blocks and (warming := sole.warming_blocks) and (
                sole.held.matched(blocks) != sole.held.matched(blocks, warming)):
            return None  # waiting for its prefill in progress may be cheaper
        return task_id, sole.runner_id
    return None


# The last waiting tasks sorted whose order had no tie: (their dict, that order). A drive
# dispatches a fetched batch one task a plan, each plan's waiting tasks those of the one
# before less the one dispatched, so each is read in the order already found.
_ORDER_MEMO: OfTheLast[list[tuple[str, PendingTask]]] = OfTheLast()


def _in_order(pending: Mapping[str, PendingTask]) -> Iterator[tuple[str, PendingTask]]:
    """The waiting tasks, highest class first (a preempted task must not take back the slot
    it yielded), then oldest first. Sorting them was a Python key a task each plan (8 us at
    64 waiting, a plan a dispatch: issue 23). Tasks that are some of those last sorted, each
    an equal record, are in the order already found, as a sort of them would put them: that
    order has no two tasks of one class that came at the same moment, so no tie that the
    dicts' orders could break otherwise."""
    if (kept := _ORDER_MEMO.get(pending)) is not None:
        return ((task_id, pending[task_id]) for task_id, _ in kept if task_id in pending)
    items = list(pending.items())
    keys: list[float] | list[tuple[int, float]]
    if len({priority for _, priority in waiting_summary(pending).classes}) == 1:
        # One class, the usual: by arrival alone, each read in C (a fetched batch's arrivals
        # sort 64 tasks afresh: 15 -> 8 us).
        keys = list(map(_RECEIVED, pending.values()))
    else:
        keys = [(RANK[task.task.priority], task.received_at) for _, task in items]
    indices = sorted(range(len(items)), key=keys.__getitem__)
    order = list(map(items.__getitem__, indices))
    if len(set(keys)) == len(keys):  # no two tasks tie
        _ORDER_MEMO.keep(pending, order)
    return iter(order)


_RECEIVED = attrgetter("received_at")


def _queued_cost(state: WorkerState, pending: PendingTask, wait: Wait) -> float:
    """What a task waiting for a runner adds to the wait of those behind it: the blocks it
    will prefill there, and a turn of a slot (a full runner) or a sequence decoding beside
    theirs (a runner with room). Even a task with nothing to prefill delays the next one."""
    runner = state.runners[wait.runner_id]
    weights = state.routing
    turn = weights.slot_wait_blocks if runner.free_slots == 0 else weights.decode_blocks
    return len(pending.blocks) - runner.held.matched(pending.blocks) + turn


def has_spare_core(spare_cores: float | None) -> bool:
    """Whether a node's measured idle CPU leaves a core to spare (not measured: assume so)."""
    return spare_cores is None or spare_cores >= SPARE_CORE


def local_candidates(state: WorkerState, pending: PendingTask) -> list[Candidate]:
    """This node's runners of the task's model that take tasks, full ones too (a task may
    wait for one that holds its prefix)."""
    spare = has_spare_core(state.spare_cores)
    model = pending.task.model
    return [_candidate(r, spare) for r in state.runners.values()
            if r.model == model and not r.shutting_down and r.takes_tasks]


_new = object.__new__
_set = object.__setattr__


def _candidate(r: RunnerView, spare_core: bool) -> Candidate:
    """`Candidate(r.runner_id, r.free_slots, ...)` for a runner here, made without the frozen
    dataclass's `__init__`, which sets each of its ten fields by `object.__setattr__`
    (1.3 -> 0.8 us; one a dispatch, issue 23): the fields as that sets them (a test
    compares the two), the dict the candidate's own."""
    candidate = _new(Candidate)
    _set(candidate, "__dict__", {
        "runner_id": r.runner_id, "free_slots": r.free_slots, "in_flight": len(r.in_flight),
        "held": r.held, "node_id": None, "prefill_blocks": r.prefill_blocks,
        "prefilling": len(r.prefill), "warming": r.warming_blocks, "spare_core": spare_core,
        "waiting_blocks": 0.0,
    })
    return candidate


def hosted(instances: Mapping[str, Instance]) -> frozenset[tuple[str, str]]:
    """Pure: (model, node) for each node that takes an instance's tasks (its rank 0)."""
    return frozenset((i.model, s.node_id) for i in instances.values()
                     for s in i.shards if s.rank == 0)


def advert_live(runner: RemoteRunner, hosts: frozenset[tuple[str, str]],
                silent_at: float | None, now: float) -> bool:
    """Pure: whether another node's advertised runner may be offered a task. An advert is
    written on change only and never expires by age (an idle runner's stays as written), so
    its age says nothing: its node must hold an instance of its model in the instance table
    (the sweeper moves a dead node's instances elsewhere), and a node that left a hand-off
    unanswered is left out until it advertises again or SILENT_S has passed."""
    if (runner.model, runner.node_id) not in hosts:
        return False
    return silent_at is None or runner.at > silent_at or now - silent_at >= SILENT_S


def remote_candidates(state: WorkerState, pending: PendingTask, now: float,
                      hosts: frozenset[tuple[str, str]] | None = None) -> list[Candidate]:
    """Other nodes' runners of the task's model with room, by their live adverts. None for
    a task that must stay (handed in, or declined once), carries input images (fetched here
    already), or while this node is stopping; and for a task with no whole prompt block to
    route by while a runner here has a free slot. Such a task (a short prompt, a preempted
    one) that would wait here for a full runner goes to a free slot elsewhere."""
    if (not state.remote or pending.local_only or pending.inputs or state.stopping
            or not state.routing.prefix):
        return []
    if not pending.blocks and _room_here(state, pending.task.model):
        return []
    hosts = hosted(state.instances) if hosts is None else hosts
    return [
        Candidate(r.runner_id, r.slots - r.in_flight, r.in_flight, r.held, r.node_id,
                  r.prefill_blocks, r.prefilling,
                  spare_core=has_spare_core(r.spare_cores))
        for r in state.remote.values()
        if r.model == pending.task.model and r.in_flight < r.slots
        and advert_live(r, hosts, state.silent.get(r.node_id), now)
    ]


def _room_here(state: WorkerState, model: str) -> bool:
    return any(r.model == model and r.free_slots > 0 and not r.shutting_down
               for r in state.runners.values())


def waits_for_a_full_runner(state: WorkerState, decision: Decision) -> bool:
    return (isinstance(decision, Wait)
            and state.runners[decision.runner_id].free_slots == 0)
