"""The node's view of its work, and `apply(state, event) -> state`: the only place it changes.

Per-token traffic never comes through here; only lifecycle events do, so copying is cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar, get_type_hints

from fleet.wire.cluster import Instance, ModelCard
from fleet.wire.runners import ACCEPTS_TASKS, RunnerIdle, RunnerStatus
from fleet.wire.tasks import Priority, Task
from fleet.worker.routing import PrefixHeld, Weights

# runner id -> (a `warming` map of it, the blocks in it): RunnerView.warming_blocks' last.
_WARMING_MEMO: dict[str, tuple[Mapping[str, frozenset[int]], frozenset[int]]] = {}
_WARMING_KEPT = 64


@dataclass(frozen=True)
class RunnerView:
    runner_id: str
    instance_id: str
    model: str
    status: RunnerStatus = field(default_factory=RunnerIdle)
    slots: int = 1
    in_flight: frozenset[str] = frozenset()
    command_sent: str | None = None  # the last lifecycle command, so it is sent once
    held: PrefixHeld = field(default_factory=PrefixHeld)  # blocks sent here: its cache
    rank: int = 0  # its shard's rank; only rank 0 of a sharded instance takes tasks
    layout: tuple[object, ...] = ()  # the group it joined (`group_layout`); () for one node
    # task -> blocks it had to prefill here (uncached when dispatched), until its first output
    prefill: Mapping[str, int] = field(default_factory=dict)
    # task -> blocks it brought here that were new (not yet cached), until its first output
    warming: Mapping[str, frozenset[int]] = field(default_factory=dict)
    # task -> (its class, when it was queued here): what preemption chooses by
    classes: Mapping[str, tuple[Priority, float]] = field(default_factory=dict)

    @property
    def prefill_blocks(self) -> int:
        return sum(self.prefill.values())

    @property
    def warming_blocks(self) -> frozenset[int]:
        """Every block its tasks are prefilling now. Read for each routing candidate made of
        it, several a plan (a union over up to `slots` sets), so found once for each
        `warming` map: every change of it is a new map (`apply`), never one changed in place."""
        warming = self.warming
        if not warming:
            return frozenset()
        kept = _WARMING_MEMO.get(self.runner_id)
        if kept is not None and kept[0] is warming:
            return kept[1]
        blocks = frozenset().union(*warming.values())
        if len(_WARMING_MEMO) >= _WARMING_KEPT:  # runners come and go: keep the recent ones
            _WARMING_MEMO.clear()
        _WARMING_MEMO[self.runner_id] = (warming, blocks)
        return blocks

    @property
    def shutting_down(self) -> bool:
        return self.command_sent == "shutdown"

    @property
    def takes_tasks(self) -> bool:
        return self.status.state in ACCEPTS_TASKS and self.rank == 0

    @property
    def free_slots(self) -> int:
        # takes_tasks written out: read for each runner several times a plan (issue 23)
        if self.rank != 0 or self.status.state not in ACCEPTS_TASKS:
            return 0
        free = self.slots - len(self.in_flight)
        return free if free > 0 else 0


@dataclass(frozen=True)
class RemoteRunner:
    """A runner on another node, as its worker last advertised it (FLEET_PREFIXES)."""

    runner_id: str
    node_id: str
    model: str
    slots: int
    in_flight: int
    held: PrefixHeld
    at: float  # when its worker wrote the summary (unix seconds)
    prefill_blocks: int = 0
    prefilling: int = 0
    spare_cores: float | None = None  # its node's idle CPU in cores (None: not said)


@dataclass(frozen=True)
class PendingTask:
    """A fetched, decoded task waiting for its inputs and a free runner slot."""

    task: Task
    received_at: float
    delivery: int = 1
    inputs: dict[str, str] | None = None  # None until every input image is on local disk
    fetching: bool = False
    blocks: tuple[int, ...] = ()  # the prompt's block hashes (prefix_blocks), for routing
    handing_off: str | None = None  # the node it is being passed to, until it answers
    local_only: bool = False  # handed in from another node, or declined there: run it here


class CancelOrigin(StrEnum):
    """Why a task was cancelled while it was not in this node's queue."""

    WHILE_RUNNING = "while_running"  # a user's cancel, sent to the runner that runs it
    WHILE_OFFERED = "while_offered"  # heard while it was offered to another node
    FENCED = "fenced"  # another attempt took it over: its runner stops, nothing more is written
    # a waiting higher class took its slot before its first token (fleet.worker.preemption):
    # its runner stops it, and it waits here again, its message still held
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class TaskRecord:
    """What the node keeps of a task beside its place (queued, or on a runner), from its
    intake to its release: the input images it holds in the node's cache, a cancel that must
    shape its end, and whether its runner's terminal already came and waits behind an image
    upload (fleet.worker.image_outputs). Its ack stage is derived from it (`ack_stage`)."""

    pinned: tuple[str, ...] = ()  # input image hashes pinned in the node's cache
    cancel: CancelOrigin | None = None
    # The runner ended it; its terminal is queued behind its images: a runner exit now must
    # neither restart nor crash it (it ends once, after its images), and it is still held.
    ending: bool = False


NO_RECORD = TaskRecord()


class Place(StrEnum):
    """Where a task is on this node, derived from the state (`WorkerState.place_of`): what
    its held message's ack stage, a cancel and a runner's exit are decided by."""

    RECEIVING = "receiving"  # its message is being taken in (by its intake key)
    WAITING_INPUTS = "waiting_inputs"
    WAITING_SLOT = "waiting_slot"
    OFFERED = "offered"  # being handed to another node, until it answers
    RUNNING = "running"
    ENDING = "ending"  # its terminal came and waits behind an image upload (TaskRecord)
    NOT_HERE = "not_here"  # not taken in, released, or off a dead runner until its read-back


@dataclass(frozen=True)
class Failure:
    attempts: int
    last_at: float
    # Where a sharded instance's ranks were when it failed (`ranks_of`): a restart into ranks
    # placed otherwise since (a dead node's shard moved) is no crash loop, and waits for no
    # backoff. () for a one-node instance.
    ranks: tuple[object, ...] = ()
    # No restart into the same ranks before this (unix seconds): a peer rank's worker is gone
    # (`GroupPeerGone`), so failover moves its shard within seconds, and a runner started
    # meanwhile listens on this node's ring address, where the moved rank's new runner may
    # connect to it, not to ours: that ring never forms (the bench's 120 s sharded hangs).
    held_until: float = 0.0


@dataclass(frozen=True)
class _Hosted:
    """What the planner reads of the instances hosted here, found once a table (`_hosted`)."""

    instances: tuple[Instance, ...]
    layouts: Mapping[str, tuple[object, ...]]  # instance id -> its group (`group_layout`)
    models: frozenset[str]


# The last table _hosted read, and what it found there: (table, node, _Hosted).
_HOSTED_MEMO: list[tuple[dict[str, Instance], str, _Hosted]] = []


@dataclass(frozen=True)
class WorkerState:
    node_id: str
    cards: dict[str, ModelCard] = field(default_factory=dict)
    instances: dict[str, Instance] = field(default_factory=dict)
    runners: dict[str, RunnerView] = field(default_factory=dict)
    pending: dict[str, PendingTask] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)  # by instance id, for backoff
    pulling: frozenset[str] = frozenset()  # models with a fetch outstanding
    # of those, models whose fetch is a preemption probe not yet told to end (a freed slot
    # ends it: fleet.worker.plan.pull)
    probing: frozenset[str] = frozenset()
    # task messages being taken in (claim, checks) by a child: their key -> the model. They
    # count as waiting tasks (pull sizes, hand-offs) and their messages are kept alive.
    receiving: Mapping[str, str] = field(default_factory=dict)
    intake_began: Mapping[str, float] = field(default_factory=dict)  # key -> when (time.time)
    # models whose last fetch came back with fewer tasks than it asked for: none queued then
    drained: frozenset[str] = frozenset()
    starting: frozenset[str] = frozenset()  # instances whose runner is being prepared
    stopping: bool = False
    routing: Weights = field(default_factory=Weights)
    prefix_capacity: int = 4096  # blocks remembered per runner
    remote: dict[str, RemoteRunner] = field(default_factory=dict)  # other nodes' runners
    # node -> when a hand-off to it went unanswered: its runners are no candidates until it
    # advertises again after that (a dead node's summaries outlive it by up to the TTL)
    silent: dict[str, float] = field(default_factory=dict)
    spare_cores: float | None = None  # this node's idle CPU in cores, measured (None: not yet)
    tasks: Mapping[str, TaskRecord] = field(default_factory=dict)  # by task id, until released

    def task(self, task_id: str) -> TaskRecord:
        return self.tasks.get(task_id, NO_RECORD)

    def place_of(self, key: str) -> Place:
        """Where the task (or the message being taken in) under `key` is now."""
        if key in self.receiving:
            return Place.RECEIVING
        if (pending := self.pending.get(key)) is not None:
            if pending.handing_off is not None:
                return Place.OFFERED
            return Place.WAITING_INPUTS if pending.inputs is None else Place.WAITING_SLOT
        if self.runner_of(key) is not None:
            return Place.ENDING if self.task(key).ending else Place.RUNNING
        return Place.NOT_HERE

    def runner_of(self, task_id: str) -> RunnerView | None:
        """The runner that has the task in flight, if one here has."""
        return next((r for r in self.runners.values() if task_id in r.in_flight), None)

    def hosted_instances(self) -> tuple[Instance, ...]:
        """The instances with a shard on this node."""
        return self._hosted().instances

    def hosted_layouts(self) -> Mapping[str, tuple[object, ...]]:
        """Each hosted instance's group (`group_layout`), by instance id: what a runner here
        must have joined (fleet.worker.plan._orphaned, every plan). Not to be changed."""
        return self._hosted().layouts

    def hosted_models(self) -> frozenset[str]:
        """The models of the instances hosted here."""
        return self._hosted().models

    def _hosted(self) -> _Hosted:
        """Read several times a plan, many plans a second, over the whole fleet's table
        (1,000 instances: 4 % of a core idle in `fleet bench --only scale`), so kept for as
        long as the table is the same object: every change of it is a new dict
        (`InstancesChanged`), never one changed in place."""
        memo = _HOSTED_MEMO
        if memo and memo[0][0] is self.instances and memo[0][1] == self.node_id:
            return memo[0][2]
        instances = tuple(inst for inst in self.instances.values()
                          if any(s.node_id == self.node_id for s in inst.shards))
        hosted = _Hosted(instances, {inst.instance_id: group_layout(inst) for inst in instances},
                         frozenset(inst.model for inst in instances))
        memo[:] = [(self.instances, self.node_id, hosted)]
        return hosted

    def runner_for(self, instance_id: str) -> RunnerView | None:
        return next((r for r in self.runners.values() if r.instance_id == instance_id), None)


def group_layout(instance: Instance) -> tuple[object, ...]:
    """What a sharded instance's runners are joined by: its generation and each rank's node,
    layers and ring address. A runner started for another layout (a shard moved, a rank's
    runner died) must be restarted. Pure."""
    if not instance.sharded:
        return ()
    return (instance.generation, *(
        (s.rank, s.node_id, s.start_layer, s.end_layer, s.ring_address)
        for s in sorted(instance.shards, key=lambda shard: shard.rank)
    ))


def regrouped(instance: Instance, layout: tuple[object, ...]) -> Instance | None:
    """A rank of the group joined by `layout` died: the instance with its generation bumped,
    so every rank's worker restarts its runner into a fresh ring; None when the instance has
    moved on from that layout already (moved, or bumped by another rank's worker). Pure."""
    if group_layout(instance) != layout:
        return None
    return instance.model_copy(update={"generation": instance.generation + 1})


@dataclass(frozen=True)
class WaitingSummary:
    """What the planner's rules that read every waiting task could find (`waiting_summary`)."""

    deadlines: bool  # a task not being handed off has a deadline (expire_pending)
    unfetched: bool  # a task's inputs are neither here nor being fetched (fetch_inputs)
    models: frozenset[str]  # the models of the tasks hand_back may give back
    classes: frozenset[tuple[str, Priority]]  # (model, class) of each (fleet.worker.preemption)


_Found = TypeVar("_Found")


class OfTheLast(Generic[_Found]):
    """What was found for the last waiting tasks read, given again for later ones that are
    some of those (each an equal record) while at least half of them are left: under batches
    a plan's waiting tasks are those of the plan before less the ones dispatched (issue 23).
    A cache: what its user answers from it is what reading the tasks afresh gives (the
    table tests of waiting_summary and fleet.worker.routes compare them)."""

    def __init__(self) -> None:
        self.last: tuple[Mapping[str, PendingTask], _Found] | None = None

    def get(self, pending: Mapping[str, PendingTask]) -> _Found | None:
        if (last := self.last) is None:
            return None
        read, found = last
        # Read afresh once fewer than half are left, so reading past those gone stays short.
        if read is pending or (2 * len(pending) >= len(read) and pending.items() <= read.items()):
            return found
        return None

    def keep(self, pending: Mapping[str, PendingTask], found: _Found) -> None:
        self.last = (pending, found)


# The last waiting tasks read through, and what they hold (`waiting_summary`).
_WAITING_MEMO: OfTheLast[WaitingSummary] = OfTheLast()


def waiting_summary(pending: Mapping[str, PendingTask]) -> WaitingSummary:
    """What fleet.worker.plan's expire_pending, hand_back and fetch_inputs, and preemption's
    count of waiting interactive tasks, could find among `pending`: where none can find a
    thing, each returns at once. Pure (what it keeps is a cache). Read through once for the
    tasks last read and for some of those (equal records, at least half of them): under
    batches a full plan's waiting tasks are those of the plan before less the ones
    dispatched, and three rules reading 64 each were half of such a plan (issue 23). For
    some of those tasks it says "maybe" where it was so for all; the rule then reads them
    as before."""
    if (kept := _WAITING_MEMO.get(pending)) is not None:
        return kept
    deadlines = unfetched = False
    models: set[str] = set()
    classes: set[tuple[str, Priority]] = set()
    for task in pending.values():
        if task.task.deadline is not None and task.handing_off is None:
            deadlines = True
        if task.inputs is None and not task.fetching:
            unfetched = True
        if not (task.fetching or task.handing_off):
            models.add(task.task.model)
        classes.add((task.task.model, task.task.priority))
    found = WaitingSummary(deadlines, unfetched, frozenset(models), frozenset(classes))
    _WAITING_MEMO.keep(pending, found)
    return found


_Record = TypeVar("_Record")


def evolve(record: _Record, **changes: object) -> _Record:
    """`dataclasses.replace` for this module's frozen records, without their generated
    `__init__`, which sets each field with `object.__setattr__` (WorkerState has 19): apply
    copies the state several times a task, and replace was 2.5 % of `fleet up`'s busy loop
    (issue 23). These records have no `__post_init__` and no InitVar, so their fields
    copied with `changes` over them are the object replace builds; an unknown name fails
    as it does there."""
    fields = record.__dict__
    merged = fields | changes  # one C-level merge; a name it added is no field
    if len(merged) != len(fields):
        raise TypeError(f"{type(record).__name__} has no field {set(changes) - set(fields)}")
    copy = object.__new__(type(record))
    # The merged dict is the copy's own (a frozen record's __setattr__ refuses every name):
    # not a fresh dict updated twice, 0.9 -> 0.55 us a WorkerState copy (timeit, loaded).
    object.__setattr__(copy, "__dict__", merged)
    return copy


_Value = TypeVar("_Value")


def _without(mapping: Mapping[str, _Value], key: str) -> dict[str, _Value]:
    """A copy of `mapping` less `key`: a C-level dict copy, not a comprehension over every
    entry (64 a runner at 64 slots, several an event). A dict without `key` is itself: the
    state's maps are never changed in place, so it is shared, not copied for nothing."""
    if key not in mapping and isinstance(mapping, dict):
        return mapping
    copy = dict(mapping)
    copy.pop(key, None)
    return copy


# ---- events -----------------------------------------------------------------------------

@dataclass(frozen=True)
class InstancesChanged:
    instances: dict[str, Instance]


@dataclass(frozen=True)
class CardsChanged:
    """The fleet's model cards as the cluster link holds them now (a card came or changed):
    the state's own snapshot, replaced whole."""

    cards: dict[str, ModelCard]


@dataclass(frozen=True)
class RunnerStarting:
    instance_id: str


@dataclass(frozen=True)
class RunnerSpawned:
    runner: RunnerView


@dataclass(frozen=True)
class RunnerStartFailed:
    instance_id: str
    at: float


@dataclass(frozen=True)
class CommandSent:
    runner_id: str
    command: str


@dataclass(frozen=True)
class RunnerStatusSeen:
    runner_id: str
    status: RunnerStatus


@dataclass(frozen=True)
class RunnerGone:
    runner_id: str
    crashed: bool
    at: float


@dataclass(frozen=True)
class GroupPeerGone:
    """After this node's rank crashed with its ring: a peer rank's worker is gone (no
    responders on its alive subject), so the group's restart into `ranks` waits `until` its
    move (or that bound)."""

    instance_id: str
    ranks: tuple[object, ...]
    until: float


@dataclass(frozen=True)
class PullStarted:
    model: str
    probe: bool = False  # a full worker's one-class pull for a task to preempt for


@dataclass(frozen=True)
class PullEnded:
    model: str
    drained: bool = False  # fewer came back than it asked for: the queue had no more


@dataclass(frozen=True)
class ProbeEnding:
    """A probe's fetch was told to end (a slot freed): its PullEnded follows."""

    model: str


@dataclass(frozen=True)
class IntakeStarted:
    """A fetched (or handed-in) message went to a child to be taken in."""

    key: str  # the message's intake key (fleet.worker.acks.intake_key)
    model: str
    at: float = 0.0  # when (time.time()): a young intake holds a drained model's pull


@dataclass(frozen=True)
class IntakeEnded:
    """Its intake answered: queued (a TaskQueued follows) or settled without a runner."""

    key: str


@dataclass(frozen=True)
class TaskQueued:
    pending: PendingTask


@dataclass(frozen=True)
class InputsFetching:
    task_id: str


@dataclass(frozen=True)
class InputsReady:
    task_id: str
    inputs: dict[str, str]


@dataclass(frozen=True)
class TaskDispatched:
    task_id: str
    runner_id: str


@dataclass(frozen=True)
class FirstOutput:
    """A task's first token (or tool call, or image) came: its prefill is done."""

    task_id: str
    runner_id: str


@dataclass(frozen=True)
class TaskEnded:
    """Terminal: the task left this node (finished, failed before dispatch, or handed back)."""

    task_id: str


@dataclass(frozen=True)
class InputsPinned:
    """The task's input images are on local disk, pinned for it until it is released."""

    task_id: str
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class CancelNoted:
    """A cancel that must shape the task's end (None: the note is spent)."""

    task_id: str
    origin: CancelOrigin | None


@dataclass(frozen=True)
class TerminalQueued:
    """A running task's terminal report came while an image of it is still uploading: it
    waits there, in order, and the task is ending (TaskRecord.ending) until it is released."""

    task_id: str


@dataclass(frozen=True)
class TaskReleased:
    """The task left this node for good (ended, handed back or handed off): its record goes
    (the caller unpins its inputs)."""

    task_id: str


@dataclass(frozen=True)
class Stopping:
    pass


@dataclass(frozen=True)
class RemoteRunnersSeen:
    """Other nodes' runners, as FLEET_PREFIXES says now (this node's own are left out)."""

    runners: dict[str, RemoteRunner]


@dataclass(frozen=True)
class CoresSampled:
    """This node's idle CPU over the last sample, in cores (fleet.worker.node)."""

    spare_cores: float


@dataclass(frozen=True)
class HandOffStarted:
    task_id: str
    node_id: str


@dataclass(frozen=True)
class HandOffEnded:
    """The receiving node answered: `taken` True (it holds the message now), False
    (declined: run it here), None (no answer: the message is left to AckWait)."""

    task_id: str
    node_id: str
    runner_id: str
    taken: bool | None
    at: float  # when the answer came, or the wait for it ended (unix seconds)


StateEvent = (
    InstancesChanged | CardsChanged | RunnerStarting | RunnerSpawned | RunnerStartFailed
    | CommandSent
    | RunnerStatusSeen | RunnerGone | GroupPeerGone | PullStarted | PullEnded | ProbeEnding
    | IntakeStarted
    | IntakeEnded
    | TaskQueued | InputsFetching
    | InputsReady | TaskDispatched | TaskEnded | InputsPinned | CancelNoted | TerminalQueued
    | TaskReleased
    | Stopping | RemoteRunnersSeen | HandOffStarted
    | HandOffEnded | FirstOutput | CoresSampled
)


def apply(state: WorkerState, event: object) -> WorkerState:
    """The next state after `event`; one small rule per event type below."""
    rule = _RULES.get(type(event))
    if rule is None:
        raise TypeError(f"no apply rule for {type(event).__name__}")
    return rule(event, state)


_Rule = Callable[[Any, "WorkerState"], "WorkerState"]
# Event type -> its rule. A dict by exact type, not functools.singledispatch: events are
# final classes, and its dispatch (a weak-keyed cache behind a wrapper) doubled the cost of
# an apply, eleven a task (issue 23).
_RULES: dict[type, _Rule] = {}


def _rule(rule: _Rule) -> _Rule:
    """Register `rule` for the type its `event` parameter is annotated with."""
    event_type = get_type_hints(rule)["event"]
    if event_type in _RULES:
        raise TypeError(f"two apply rules for {event_type.__name__}")
    _RULES[event_type] = rule
    return rule


def _with_runner(state: WorkerState, runner_id: str, **changes: object) -> WorkerState:
    runner = state.runners.get(runner_id)
    if runner is None:
        return state
    return evolve(state, runners={**state.runners, runner_id: evolve(runner, **changes)})


@_rule
def _(event: InstancesChanged, state: WorkerState) -> WorkerState:
    return evolve(state, instances=dict(event.instances))


@_rule
def _(event: CardsChanged, state: WorkerState) -> WorkerState:
    return evolve(state, cards=dict(event.cards))


@_rule
def _(event: RunnerStarting, state: WorkerState) -> WorkerState:
    return evolve(state, starting=state.starting | {event.instance_id})


@_rule
def _(event: RunnerSpawned, state: WorkerState) -> WorkerState:
    runners = {**state.runners, event.runner.runner_id: event.runner}
    return evolve(state, runners=runners, starting=state.starting - {event.runner.instance_id})


def ranks_of(layout: tuple[object, ...]) -> tuple[object, ...]:
    """A group layout less its generation: where the ranks are. Pure."""
    return layout[1:]


def peer_nodes(layout: tuple[object, ...], node_id: str) -> list[str]:
    """The nodes of a group layout's other ranks. Pure."""
    return [str(rank[1]) for rank in ranks_of(layout)
            if isinstance(rank, tuple) and rank[1] != node_id]


def _count_failure(
    state: WorkerState, instance_id: str, at: float, ranks: tuple[object, ...] | None = None,
) -> dict[str, Failure]:
    """`ranks`: where the failed runner's group was (None: where the instance is now)."""
    if ranks is None:
        instance = state.instances.get(instance_id)
        ranks = ranks_of(group_layout(instance)) if instance else ()
    previous = state.failures.get(instance_id)
    attempts = previous.attempts if previous and previous.ranks == ranks else 0
    return {**state.failures, instance_id: Failure(attempts + 1, at, ranks)}


@_rule
def _(event: RunnerStartFailed, state: WorkerState) -> WorkerState:
    failures = _count_failure(state, event.instance_id, event.at)
    return evolve(state, failures=failures, starting=state.starting - {event.instance_id})


@_rule
def _(event: CommandSent, state: WorkerState) -> WorkerState:
    runner = state.runners.get(event.runner_id)
    if runner is not None and runner.shutting_down:
        return state  # a shutdown is final: no later command replaces it
    return _with_runner(state, event.runner_id, command_sent=event.command)


@_rule
def _(event: RunnerStatusSeen, state: WorkerState) -> WorkerState:
    state = _with_runner(state, event.runner_id, status=event.status)
    runner = state.runners.get(event.runner_id)
    if runner and event.status.state == "ready" and runner.instance_id in state.failures:
        failures = _without(state.failures, runner.instance_id)
        state = evolve(state, failures=failures)
    return state


@_rule
def _(event: RunnerGone, state: WorkerState) -> WorkerState:
    runner = state.runners.get(event.runner_id)
    if runner is None:
        return state
    runners = _without(state.runners, event.runner_id)
    failures = state.failures
    if event.crashed:
        failures = _count_failure(state, runner.instance_id, event.at, ranks_of(runner.layout))
    return evolve(state, runners=runners, failures=failures)


@_rule
def _(event: GroupPeerGone, state: WorkerState) -> WorkerState:
    failure = state.failures.get(event.instance_id)
    if failure is None or failure.ranks != event.ranks:
        return state  # restarted (ready), or its ranks moved already: nothing to hold
    held = evolve(failure, held_until=max(failure.held_until, event.until))
    return evolve(state, failures={**state.failures, event.instance_id: held})


@_rule
def _(event: PullStarted, state: WorkerState) -> WorkerState:
    probing = state.probing | {event.model} if event.probe else state.probing
    return evolve(state, pulling=state.pulling | {event.model}, probing=probing)


@_rule
def _(event: PullEnded, state: WorkerState) -> WorkerState:
    drained = state.drained | {event.model} if event.drained else state.drained - {event.model}
    return evolve(state, pulling=state.pulling - {event.model},
                   probing=state.probing - {event.model}, drained=drained)


@_rule
def _(event: ProbeEnding, state: WorkerState) -> WorkerState:
    return evolve(state, probing=state.probing - {event.model})


def _with_record(state: WorkerState, task_id: str, **changes: object) -> WorkerState:
    record = evolve(state.task(task_id), **changes)
    return evolve(state, tasks={**state.tasks, task_id: record})


@_rule
def _(event: InputsPinned, state: WorkerState) -> WorkerState:
    return _with_record(state, event.task_id, pinned=event.hashes)


@_rule
def _(event: CancelNoted, state: WorkerState) -> WorkerState:
    if event.origin is None and event.task_id not in state.tasks:
        return state
    return _with_record(state, event.task_id, cancel=event.origin)


@_rule
def _(event: TerminalQueued, state: WorkerState) -> WorkerState:
    if not any(event.task_id in r.in_flight for r in state.runners.values()):
        return state  # not running here (given up, or already ended): nothing waits for it
    return _with_record(state, event.task_id, ending=True)


@_rule
def _(event: TaskReleased, state: WorkerState) -> WorkerState:
    if event.task_id not in state.tasks:
        return state
    return evolve(state, tasks=_without(state.tasks, event.task_id))


@_rule
def _(event: IntakeStarted, state: WorkerState) -> WorkerState:
    return evolve(state, receiving={**state.receiving, event.key: event.model},
                   intake_began={**state.intake_began, event.key: event.at})


@_rule
def _(event: IntakeEnded, state: WorkerState) -> WorkerState:
    return evolve(
        state, receiving=_without(state.receiving, event.key),
        intake_began=_without(state.intake_began, event.key),
    )


@_rule
def _(event: TaskQueued, state: WorkerState) -> WorkerState:
    task_id = event.pending.task.task_id
    return evolve(state, pending={**state.pending, task_id: event.pending})


@_rule
def _(event: InputsFetching, state: WorkerState) -> WorkerState:
    pending = state.pending.get(event.task_id)
    if pending is None:
        return state
    return evolve(state, pending={**state.pending, event.task_id: evolve(pending, fetching=True)})


@_rule
def _(event: InputsReady, state: WorkerState) -> WorkerState:
    pending = state.pending.get(event.task_id)
    if pending is None:
        return state
    ready = evolve(pending, inputs=dict(event.inputs), fetching=False)
    return evolve(state, pending={**state.pending, event.task_id: ready})


@_rule
def _(event: TaskDispatched, state: WorkerState) -> WorkerState:
    task_id = event.task_id
    runner = state.runners[event.runner_id]
    task = state.pending.get(task_id)
    changes: dict[str, object] = {"in_flight": runner.in_flight | {task_id}}
    uncached = 0
    if task is not None:
        if blocks := task.blocks:  # a prompt of no whole block leaves held and warming as is
            changes["held"] = runner.held.served(blocks, state.prefix_capacity)
            uncached = len(blocks) - runner.held.matched(blocks, runner.warming_blocks)
            if new := frozenset(b for b in blocks if b not in runner.held.known):
                changes["warming"] = {**runner.warming, task_id: new}
        changes["classes"] = {**runner.classes, task_id: (task.task.priority, task.received_at)}
    changes["prefill"] = {**runner.prefill, task_id: uncached}
    # One copy of the state, not one for the queue and one for the runner (a task each).
    return evolve(state, pending=_without(state.pending, task_id),
                  runners={**state.runners, event.runner_id: evolve(runner, **changes)})


@_rule
def _(event: FirstOutput, state: WorkerState) -> WorkerState:
    runner = state.runners.get(event.runner_id)
    if runner is None or event.task_id not in runner.prefill:
        return state
    prefill = _without(runner.prefill, event.task_id)
    warming = _without(runner.warming, event.task_id)
    return _with_runner(state, event.runner_id, prefill=prefill, warming=warming)


@_rule
def _(event: TaskEnded, state: WorkerState) -> WorkerState:
    task_id = event.task_id
    pending = _without(state.pending, task_id)
    runners = state.runners
    for rid, r in state.runners.items():
        if task_id in r.in_flight:  # one runner has it, or none (it was waiting, or gone)
            runners = {**runners, rid: evolve(
                r, in_flight=r.in_flight - {task_id}, prefill=_without(r.prefill, task_id),
                warming=_without(r.warming, task_id), classes=_without(r.classes, task_id))}
    if pending is state.pending and runners is state.runners:
        return state  # neither waiting nor running here
    return evolve(state, pending=pending, runners=runners)


@_rule
def _(event: Stopping, state: WorkerState) -> WorkerState:
    return evolve(state, stopping=True)


@_rule
def _(event: RemoteRunnersSeen, state: WorkerState) -> WorkerState:
    mine = state.node_id
    return evolve(state, remote={k: r for k, r in event.runners.items() if r.node_id != mine})


@_rule
def _(event: HandOffStarted, state: WorkerState) -> WorkerState:
    pending = state.pending.get(event.task_id)
    if pending is None:
        return state
    passing = evolve(pending, handing_off=event.node_id)
    return evolve(state, pending={**state.pending, event.task_id: passing})


@_rule
def _(event: HandOffEnded, state: WorkerState) -> WorkerState:
    pending = state.pending.get(event.task_id)
    if pending is None:
        return state
    if event.taken is False:
        kept = evolve(pending, handing_off=None, local_only=True)
        return evolve(state, pending={**state.pending, event.task_id: kept})
    rest = _without(state.pending, event.task_id)
    if event.taken is None:
        silent = {**state.silent, event.node_id: event.at}
        return evolve(state, pending=rest, silent=silent)
    remote = state.remote
    if (there := remote.get(event.runner_id)) is not None:
        # Until its worker's next summary: that runner holds this prompt too. Its load is
        # not guessed (a guess outlives the task when no summary follows): the receiver
        # declines when it has no free slot, which is exact.
        there = evolve(there, held=there.held.served(pending.blocks, state.prefix_capacity))
        remote = {**remote, event.runner_id: there}
    return evolve(state, pending=rest, remote=remote)


@_rule
def _(event: CoresSampled, state: WorkerState) -> WorkerState:
    return evolve(state, spare_cores=event.spare_cores)
