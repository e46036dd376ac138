"""The planner's shortcuts give what reading everything afresh gives (issue 23): `routes`
makes a model's local candidates once a call (not once a task), each without the dataclass's
`__init__`; a runner's warming blocks are kept for its `warming` map; `pull` counts tasks of
one model by len. Tables of states, each against an answer worked out the long way."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

import pytest

from fleet.priorities import RANK
from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.runners import RunnerLoading, RunnerReady
from fleet.wire.tasks import Priority, TextGeneration
from fleet.worker import plan as rules
from fleet.worker.routes import (
    _candidate,
    _queued_cost,
    first_to_a_sole_runner,
    has_spare_core,
    hosted,
    remote_candidates,
    routes,
)
from fleet.worker.routing import Candidate, PrefixHeld, Wait, choose
from fleet.worker.state import (
    FirstOutput,
    PendingTask,
    RemoteRunner,
    RunnerView,
    TaskDispatched,
    TaskEnded,
    TaskQueued,
    WorkerState,
    apply,
)

NOW = 1_000.0
PROMPT = tuple(range(1, 11))


def held(*blocks: int) -> PrefixHeld:
    return PrefixHeld().served(blocks, capacity=100)


def waiting(task_id: str, blocks: tuple[int, ...] = PROMPT, at: float = 0.0,
            model: str = "m", priority: Priority = "default", **changes: object) -> PendingTask:
    task = TextGeneration(task_id=task_id, model=model, prompt="hi", priority=priority)
    return replace(PendingTask(task, NOW + at, inputs={}, blocks=blocks),
                   **changes)  # type: ignore[arg-type]


def runner(runner_id: str, model: str = "m", slots: int = 2, busy: int = 0,
           blocks: tuple[int, ...] = (), **changes: object) -> RunnerView:
    view = RunnerView(runner_id, f"i-{runner_id}", model, status=RunnerReady(), slots=slots,
                      in_flight=frozenset(f"{runner_id}-busy-{i}" for i in range(busy)),
                      held=held(*blocks))
    return replace(view, **changes)  # type: ignore[arg-type]


def world(runners: list[RunnerView], tasks: list[PendingTask],
          remotes: Iterable[RemoteRunner] = (), spare: float | None = None) -> WorkerState:
    instances = {
        f"i-{r.runner_id}": Instance(instance_id=f"i-{r.runner_id}", model=r.model, slots=r.slots,
                                     created_at=0.0,
                                     shards=[ShardAssignment(node_id="n", runner_id=r.runner_id)])
        for r in runners
    }
    instances["i-there"] = Instance(instance_id="i-there", model="m", slots=4, created_at=0.0,
                                    shards=[ShardAssignment(node_id="n2", runner_id="far")])
    return WorkerState(node_id="n", instances=instances,
                       runners={r.runner_id: r for r in runners},
                       pending={p.task.task_id: p for p in tasks},
                       remote={r.runner_id: r for r in remotes}, spare_cores=spare)


def prefilling(state: WorkerState, task: PendingTask, runner_id: str) -> WorkerState:
    """`task` sent to `runner_id`, no first output yet: its new blocks are warming there."""
    return apply(apply(state, TaskQueued(task)), TaskDispatched(task.task.task_id, runner_id))


def routes_afresh(state: WorkerState, now: float) -> list[tuple[str, object]]:
    """`routes` the long way: sorted afresh, every candidate made anew for each task."""
    waits: dict[str, float] = {}
    found: list[tuple[str, object]] = []
    hosts = hosted(state.instances)
    order = sorted(state.pending.items(),
                   key=lambda kv: (RANK[kv[1].task.priority], kv[1].received_at))
    for task_id, pending in order:
        if pending.inputs is None or pending.handing_off is not None:
            continue
        made = [
            Candidate(r.runner_id, r.free_slots, len(r.in_flight), r.held, None,
                      sum(r.prefill.values()), len(r.prefill),
                      frozenset().union(*r.warming.values()),
                      spare_core=has_spare_core(state.spare_cores))
            for r in state.runners.values()
            if r.model == pending.task.model and not r.shutting_down and r.takes_tasks
        ]
        candidates = [replace(c, waiting_blocks=waits[c.runner_id]) if c.runner_id in waits
                      else c for c in made]
        candidates += remote_candidates(state, pending, now, hosts)
        decision = choose(pending.blocks, candidates, state.routing)
        if isinstance(decision, Wait):
            waits[decision.runner_id] = (waits.get(decision.runner_id, 0.0)
                                         + _queued_cost(state, pending, decision))
        found.append((task_id, decision))
    return found


FULL_HOME = world([runner("a", busy=2, blocks=PROMPT), runner("b", busy=1)],
                  [waiting(f"t{i}", at=i) for i in range(4)], spare=0.1)
TWO_MODELS = world(
    [runner("a", busy=1), runner("b", "other", busy=0), runner("c", busy=2, blocks=PROMPT[:4])],
    [waiting("t1", at=1), waiting("o1", model="other", at=2), waiting("t2", PROMPT[:3], at=3),
     waiting("i1", (), at=4, priority="interactive"), waiting("o2", (), model="other", at=5)],
)
WARMING = prefilling(world([runner("a", slots=4), runner("b", slots=4, busy=1)], []),
                     waiting("first", at=0), "a")
WARMING_WAITS = replace(WARMING, pending={
    p.task.task_id: p for p in (waiting("second", at=1), waiting("third", (11, 12), at=2),
                                waiting("fourth", at=3))})
SKIPPED = world(
    [runner("a", busy=2, blocks=PROMPT), runner("b", command_sent="shutdown"),
     runner("c", status=RunnerLoading(), command_sent="load_model"), runner("d", busy=1)],
    [waiting("t1", at=1), waiting("fetching", at=0, inputs=None, fetching=True),
     waiting("offered", at=0.5, handing_off="n2"), waiting("t2", (), at=2)], spare=0.0)
WITH_REMOTE = world(
    [runner("a", busy=2)],
    [waiting("t1", at=1), waiting("t2", (), at=2), waiting("t3", at=3, local_only=True)],
    [RemoteRunner("far", "n2", "m", 4, 1, held(*PROMPT), NOW - 1)])


@pytest.mark.parametrize("state", [
    pytest.param(FULL_HOME, id="saturated-tasks-queue-for-the-full-home"),
    pytest.param(TWO_MODELS, id="two-models-candidates-of-each"),
    pytest.param(WARMING_WAITS, id="a-prefill-in-progress-waited-for"),
    pytest.param(SKIPPED, id="shutting-down-not-ready-fetching-offered"),
    pytest.param(WITH_REMOTE, id="another-nodes-runner"),
    pytest.param(replace(FULL_HOME, pending={}), id="none-waiting"),
])
def test_routes_decide_as_when_every_candidate_is_made_afresh(state: WorkerState) -> None:
    found = [(task_id, decision) for task_id, _, decision in routes(state, NOW)]
    assert found == routes_afresh(state, NOW)
    assert found or not state.pending


def test_the_tables_states_route_as_their_names_say() -> None:
    """The rows above exercise what they are for (waits, a prefill waited for, a hand-off)."""
    assert any(isinstance(d, Wait) for _, _, d in routes(FULL_HOME, NOW))
    assert isinstance(dict((t, d) for t, _, d in routes(WARMING_WAITS, NOW))["second"], Wait)
    assert any(isinstance(d, Candidate) and d.node_id == "n2"
               for _, _, d in routes(WITH_REMOTE, NOW))


@pytest.mark.parametrize("view", [
    pytest.param(runner("a"), id="idle"),
    pytest.param(runner("a", busy=2, blocks=PROMPT), id="full"),
    pytest.param(WARMING.runners["a"], id="prefilling"),
    pytest.param(runner("a", status=RunnerLoading()), id="not-ready"),
])
@pytest.mark.parametrize("spare", [True, False])
def test_a_candidate_is_made_as_its_init_makes_it(view: RunnerView, spare: bool) -> None:
    made = _candidate(view, spare)
    expected = Candidate(view.runner_id, view.free_slots, len(view.in_flight), view.held, None,
                         view.prefill_blocks, len(view.prefill), view.warming_blocks,
                         spare_core=spare)
    assert made == expected and repr(made) == repr(expected)
    assert type(made) is Candidate and made.__dict__ == expected.__dict__


def test_warming_blocks_follow_each_change_of_the_runners_map() -> None:
    """Kept for the map they were found for: each apply that changes it is read afresh."""
    state = world([runner("a", slots=4)], [])
    seen = []
    for event in (TaskQueued(waiting("x", (1, 2, 3))), TaskDispatched("x", "a"),
                  TaskQueued(waiting("y", (1, 2, 3, 4, 5))), TaskDispatched("y", "a"),
                  FirstOutput("x", "a"), TaskEnded("y")):
        state = apply(state, event)
        view = state.runners["a"]
        assert view.warming_blocks == view.warming_blocks == frozenset().union(
            *view.warming.values())
        seen.append(view.warming_blocks)
    assert seen == [frozenset(), {1, 2, 3}, {1, 2, 3}, {1, 2, 3, 4, 5}, {4, 5}, frozenset()]
    # Another view of the same id with another map (a restarted runner) reads its own.
    other = replace(runner("a"), warming={"z": frozenset({9})})
    assert other.warming_blocks == {9}


@pytest.mark.parametrize("models", [
    [], ["m"], ["m", "m", "m"], ["m", "n", "m"], ["n", "m"],
])
def test_models_are_counted_as_a_counter_counts_them(models: list[str]) -> None:
    assert rules._by_model(models) == Counter(models)
    receiving = {f"k{i}": model for i, model in enumerate(models)}
    assert rules._by_model(receiving.values()) == Counter(models)


POOL = {p.task.task_id: p for p in (waiting("a", model="m"), waiting("b", model="n"),
                                     waiting("c", model="m"), waiting("d", model="m"))}


@pytest.mark.parametrize("steps", [
    # read afresh, then some of those (two models kept: counted one by one), then fewer than
    # half (read afresh: one model)
    pytest.param(["abcd", "acd", "cd", "b"], id="two-models-then-some-then-one"),
    pytest.param(["acd", "cd", "c", ""], id="one-model-throughout"),
    pytest.param(["cd", "cdb", "db", "d"], id="a-task-of-another-model-arrives"),
])
def test_waiting_tasks_are_counted_by_model_as_read_one_by_one(steps: list[str]) -> None:
    for ids in steps:
        state = WorkerState(node_id="n", pending={task_id: POOL[task_id] for task_id in ids})
        assert rules._waiting_by_model(state) == Counter(
            p.task.model for p in state.pending.values())


ONE_FREE = world([runner("a", slots=4, busy=1)], [waiting("t1", at=1), waiting("t2", at=2)])
# One runner here, prefilling PROMPT for a task sent to it (its blocks are warming there).
ALONE_WARMING = prefilling(world([runner("a", slots=4)], []), waiting("first", at=0), "a")


@pytest.mark.parametrize(("state", "first"), [
    pytest.param(ONE_FREE, ("t1", "a"), id="a-sole-runner-with-a-free-slot"),
    pytest.param(replace(ONE_FREE, routing=replace(ONE_FREE.routing, prefix=False)), ("t1", "a"),
                 id="without-prefix-routing"),
    pytest.param(world([runner("a", busy=2)], [waiting("t1")]), None, id="its-runner-full"),
    pytest.param(world([runner("a"), runner("b")], [waiting("t1")]), None, id="two-runners"),
    pytest.param(replace(ONE_FREE, remote=WITH_REMOTE.remote), None, id="another-nodes-runner"),
    pytest.param(world([runner("a", "other")], [waiting("t1"), waiting("o", model="other")]),
                 None, id="the-first-tasks-model-has-no-runner"),
    pytest.param(world([runner("a"), runner("b", command_sent="shutdown"),
                        runner("c", status=RunnerLoading(), command_sent="load_model")],
                       [waiting("t1")]), ("t1", "a"), id="others-stopping-or-not-ready"),
    pytest.param(world([runner("a")], [waiting("f", at=0, inputs=None, fetching=True),
                                       waiting("o", at=0.5, handing_off="n2"), waiting("t1")]),
                 ("t1", "a"), id="tasks-not-ready-to-route-skipped"),
    pytest.param(replace(ALONE_WARMING, pending={"second": waiting("second", at=1)}), None,
                 id="its-prefill-in-progress-holds-more-of-the-prompt"),
    pytest.param(replace(ALONE_WARMING, pending={"third": waiting("third", (11, 12), at=1)}),
                 ("third", "a"), id="its-prefill-in-progress-is-of-other-blocks"),
    pytest.param(replace(ALONE_WARMING, pending={"short": waiting("short", (), at=1)}),
                 ("short", "a"), id="a-prompt-of-no-block"),
    pytest.param(replace(WARMING, pending={"short": waiting("short", (), at=1)}), None,
                 id="two-runners-one-prefilling"),
])
def test_the_first_task_to_a_sole_runner_is_routes_first_choice(
        state: WorkerState, first: tuple[str, str] | None) -> None:
    """Given, it is what `routes` decides first (None: routes is asked)."""
    assert first_to_a_sole_runner(state) == first
    if first is not None:
        task_id, _, decision = next(iter(routes(state, NOW)))
        assert isinstance(decision, Candidate) and decision.node_id is None
        assert (task_id, decision.runner_id) == first
