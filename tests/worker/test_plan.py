"""`plan(state, now)`: tables of (state, now, the one action expected), no I/O, no clock."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.events import ErrorReason
from fleet.wire.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
    RunnerWarmingUp,
)
from fleet.wire.tasks import ImageEdits, TextGeneration
from fleet.worker import state as ev
from fleet.worker.plan import (
    AFTER_DISPATCH,
    INTAKE_HOLD_S,
    RESTART_BASE_S,
    RESTART_CAP_S,
    Action,
    AdvanceRunner,
    Dispatch,
    FetchInputs,
    FinishPending,
    HandBack,
    Pull,
    SpawnRunner,
    StopRunner,
    plan,
    pull_held_until,
    pulls_held_until,
)
from fleet.worker.state import (
    Failure,
    PendingTask,
    RunnerView,
    WorkerState,
    apply,
    group_layout,
    peer_nodes,
    ranks_of,
)

HERE = "node-a"
THERE = "node-b"
TINY = "tiny-llm"
SMOL = "smollm2-135m"
SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
T0 = 1_000.0


def instance(
    instance_id: str = "inst-1", model: str = TINY, node: str = HERE, slots: int = 4
) -> Instance:
    shard = ShardAssignment(node_id=node, runner_id=f"run-{instance_id}")
    return Instance(
        instance_id=instance_id, model=model, shards=[shard], slots=slots, created_at=0.0
    )


def runner(
    runner_id: str = "run-1",
    instance_id: str = "inst-1",
    model: str = TINY,
    status: RunnerStatus | None = None,
    slots: int = 4,
    in_flight: Iterable[str] = (),
    command_sent: str | None = None,
) -> RunnerView:
    return RunnerView(
        runner_id=runner_id, instance_id=instance_id, model=model,
        status=status or RunnerReady(), slots=slots, in_flight=frozenset(in_flight),
        command_sent=command_sent,
    )


def pending(
    task_id: str = "t-1",
    model: str = TINY,
    received_at: float = T0,
    inputs: dict[str, str] | None = None,
    fetching: bool = False,
    deadline: float | None = None,
    images: tuple[str, ...] = (),
) -> PendingTask:
    when = datetime.fromtimestamp(deadline, UTC) if deadline is not None else None
    task: TextGeneration | ImageEdits
    if images:
        task = ImageEdits(
            task_id=task_id, model=model, prompt="night", input_images=list(images),
            deadline=when,
        )
    else:
        task = TextGeneration(task_id=task_id, model=model, prompt="hi", deadline=when)
    if inputs is None and not images and not fetching:
        inputs = {}  # as intake does: a task without images has all its inputs at once
    return PendingTask(task=task, received_at=received_at, inputs=inputs, fetching=fetching)


def world(
    instances: Iterable[Instance] = (),
    runners: Iterable[RunnerView] = (),
    tasks: Iterable[PendingTask] = (),
    failures: dict[str, Failure] | None = None,
    pulling: Iterable[str] = (),
    starting: Iterable[str] = (),
    stopping: bool = False,
) -> WorkerState:
    return WorkerState(
        node_id=HERE,
        instances={i.instance_id: i for i in instances},
        runners={r.runner_id: r for r in runners},
        pending={p.task.task_id: p for p in tasks},
        failures=failures or {},
        pulling=frozenset(pulling),
        starting=frozenset(starting),
        stopping=stopping,
    )


# The instance every "hosted here, runner up" row shares.
INST = instance()
READY = runner()


def two_shards(rank_1_on: str, generation: int = 0) -> Instance:
    """inst-s: rank 0 here, rank 1 on `rank_1_on`."""
    shards = [ShardAssignment(node_id=node, runner_id=f"run-s{rank}", rank=rank, world_size=2,
                              start_layer=rank * 15, end_layer=rank * 15 + 15,
                              ring_address=f"{node}:5000")
              for rank, node in enumerate((HERE, rank_1_on))]
    return Instance(instance_id="inst-s", model=SMOL, shards=shards, created_at=0.0,
                    generation=generation)


SHARDED = two_shards(THERE)
# Its rank 1 moved to a spare after the dead node's rank took this node's runner down.
MOVED = two_shards("node-spare", generation=1)

ROWS = [
    # ---- spawning ----------------------------------------------------------------------
    pytest.param(world([INST]), T0, SpawnRunner(INST), id="spawn-for-hosted-instance"),
    pytest.param(world([instance(node=THERE)]), T0, None, id="nothing-for-another-nodes-instance"),
    pytest.param(world([INST], starting=["inst-1"]), T0, None, id="no-second-spawn-while-starting"),
    pytest.param(world([INST], [runner(status=RunnerIdle(), command_sent="connect_to_group")]),
                 T0, None, id="no-spawn-when-the-runner-exists"),
    pytest.param(world([INST], failures={"inst-1": Failure(1, T0)}), T0 + RESTART_BASE_S - 0.01,
                 None, id="backoff-1st-crash-too-early"),
    pytest.param(world([INST], failures={"inst-1": Failure(1, T0)}), T0 + RESTART_BASE_S,
                 SpawnRunner(INST), id="backoff-1st-crash-over"),
    pytest.param(world([INST], failures={"inst-1": Failure(3, T0)}), T0 + 4 * RESTART_BASE_S - 0.01,
                 None, id="backoff-3rd-crash-doubles-twice"),
    pytest.param(world([INST], failures={"inst-1": Failure(3, T0)}), T0 + 4 * RESTART_BASE_S,
                 SpawnRunner(INST), id="backoff-3rd-crash-over"),
    pytest.param(world([INST], failures={"inst-1": Failure(50, T0)}), T0 + RESTART_CAP_S - 0.01,
                 None, id="backoff-capped-too-early"),
    pytest.param(world([INST], failures={"inst-1": Failure(50, T0)}), T0 + RESTART_CAP_S,
                 SpawnRunner(INST), id="backoff-capped-over"),
    pytest.param(world([INST, instance("inst-2")], failures={"inst-1": Failure(1, T0)}), T0,
                 SpawnRunner(instance("inst-2")), id="backoff-of-one-instance-not-another"),
    pytest.param(world([INST], stopping=True), T0, None, id="no-spawn-while-stopping"),
    pytest.param(world([MOVED], failures={"inst-s": Failure(1, T0, ranks_of(
        group_layout(SHARDED)))}), T0, SpawnRunner(MOVED),
                 id="a-rank-moved-since-the-crash-restarts-at-once"),
    pytest.param(world([MOVED], failures={"inst-s": Failure(1, T0, ranks_of(
        group_layout(MOVED)))}), T0, None, id="a-crash-in-the-moved-group-backs-off"),
    pytest.param(world([two_shards(THERE, generation=1)], failures={"inst-s": Failure(
        1, T0, ranks_of(group_layout(SHARDED)))}), T0, None,
                 id="a-generation-bump-alone-backs-off"),
    # A peer rank's worker is gone (GroupPeerGone): no restart into the same ranks, past the
    # backoff, until its move or the hold's end; a moved group starts at once.
    pytest.param(world([two_shards(THERE, generation=1)], failures={"inst-s": Failure(
        1, T0, ranks_of(group_layout(SHARDED)), held_until=T0 + 15)}), T0 + 14.99, None,
                 id="a-gone-peer-holds-the-restart-into-the-same-ranks"),
    pytest.param(world([two_shards(THERE, generation=1)], failures={"inst-s": Failure(
        1, T0, ranks_of(group_layout(SHARDED)), held_until=T0 + 15)}), T0 + 15,
                 SpawnRunner(two_shards(THERE, generation=1)), id="the-hold-is-bounded"),
    pytest.param(world([MOVED], failures={"inst-s": Failure(1, T0, ranks_of(
        group_layout(SHARDED)), held_until=T0 + 15)}), T0 + 0.1, SpawnRunner(MOVED),
                 id="the-gone-peers-rank-moved-restarts-at-once"),
    # ---- lifecycle -----------------------------------------------------------------------
    pytest.param(world([INST], [runner(status=RunnerIdle())]), T0,
                 AdvanceRunner("run-1", "connect_to_group"), id="idle-connects-to-group"),
    pytest.param(world([INST], [runner(status=RunnerConnected(), command_sent="connect_to_group")]),
                 T0, AdvanceRunner("run-1", "load_model"), id="connected-loads-model"),
    pytest.param(world([INST], [runner(status=RunnerLoaded(), command_sent="load_model")]), T0,
                 AdvanceRunner("run-1", "warm_up"), id="loaded-warms-up"),
    pytest.param(world([INST], [runner(status=RunnerLoaded(), command_sent="warm_up")]), T0, None,
                 id="warm-up-is-sent-once"),
    pytest.param(world([INST], [runner(status=RunnerIdle(), command_sent="connect_to_group")]), T0,
                 None, id="connect-is-sent-once"),
    pytest.param(world([INST], [runner(status=RunnerConnecting(),
                                       command_sent="connect_to_group")]),
                 T0, None, id="nothing-while-connecting"),
    pytest.param(world([INST], [runner(status=RunnerLoading(layers_done=1, layers_total=2),
                                       command_sent="load_model")]),
                 T0, None, id="nothing-while-loading"),
    pytest.param(world([INST], [runner(status=RunnerWarmingUp(), command_sent="warm_up")]), T0,
                 None, id="nothing-while-warming-up"),
    # ---- stopping runners ------------------------------------------------------------------
    pytest.param(world([], [READY]), T0, StopRunner("run-1", "instance removed"),
                 id="stop-runner-whose-instance-is-gone"),
    pytest.param(world([instance(node=THERE)], [READY]), T0,
                 StopRunner("run-1", "instance removed"), id="stop-runner-whose-instance-moved"),
    pytest.param(world([], [runner(command_sent="shutdown")]), T0, None,
                 id="shutdown-is-sent-once"),
    pytest.param(world([INST], [READY], stopping=True), T0, StopRunner("run-1", "instance removed"),
                 id="stopping-stops-every-runner"),
    pytest.param(world([INST], [runner(command_sent="shutdown")], stopping=True), T0, None,
                 id="no-pull-while-stopping"),
    pytest.param(world([instance("inst-2")], [READY]), T0, StopRunner("run-1", "instance removed"),
                 id="stop-comes-before-spawn"),
    # ---- pending tasks: expiry, inputs -----------------------------------------------------
    pytest.param(world([INST], [READY], [pending(deadline=T0)]), T0,
                 FinishPending("t-1", ErrorReason.DEADLINE, "the task's deadline passed"),
                 id="expire-pending-task-at-its-deadline"),
    pytest.param(world([INST], [READY], [pending(deadline=T0 - 60)]), T0,
                 FinishPending("t-1", ErrorReason.DEADLINE, "the task's deadline passed"),
                 id="expire-pending-task-past-its-deadline"),
    pytest.param(world([INST], [READY], [pending(deadline=T0 + 1)]), T0, Dispatch("t-1", "run-1"),
                 id="task-before-its-deadline-is-dispatched"),
    pytest.param(world([INST], [READY], [pending(images=(SHA,))]), T0, FetchInputs("t-1", (SHA,)),
                 id="fetch-inputs-for-task-with-images"),
    pytest.param(world([INST], [READY], [pending(images=(SHA,), fetching=True)]), T0,
                 Pull(TINY, 3, 1), id="no-second-fetch-while-fetching"),
    pytest.param(world([INST], [READY], [pending(images=(SHA,), inputs={SHA: "/img/x"})]), T0,
                 Dispatch("t-1", "run-1"), id="dispatch-once-inputs-are-local"),
    # ---- dispatch ----------------------------------------------------------------------------
    pytest.param(world([INST], [READY], [pending()]), T0, Dispatch("t-1", "run-1"),
                 id="dispatch-to-ready-runner"),
    pytest.param(
        world([INST, instance("inst-2")],
              [runner("run-1", in_flight=["a", "b", "c"]),
               runner("run-2", "inst-2", in_flight=["d"])],
              [pending()]),
        T0, Dispatch("t-1", "run-2"), id="dispatch-to-runner-with-most-free-slots",
    ),
    pytest.param(world([INST], [runner(status=RunnerRunning(active_tasks=1), in_flight=["a"])],
                       [pending()]),
                 T0, Dispatch("t-1", "run-1"), id="dispatch-to-running-runner-with-a-free-slot"),
    pytest.param(world([INST], [runner(slots=2, in_flight=["a", "b"])], [pending()]), T0, None,
                 id="never-dispatch-to-a-full-runner"),
    pytest.param(world([INST], [runner(status=RunnerWarmingUp(), command_sent="warm_up")],
                       [pending()]),
                 T0, None, id="never-dispatch-to-a-runner-not-ready"),
    pytest.param(world([INST], [runner(status=RunnerFailed(error="oom"))], [pending()]), T0, None,
                 id="never-dispatch-to-a-failed-runner"),
    pytest.param(world([INST], [READY], [pending(model=SMOL)]), T0, HandBack("t-1"),
                 id="never-dispatch-to-another-models-runner-hand-it-back"),
    pytest.param(world([INST], [READY], [pending("late", received_at=T0 + 5),
                                          pending("early", received_at=T0)]),
                 T0 + 10, Dispatch("early", "run-1"), id="oldest-pending-task-first"),
    # ---- pulling -----------------------------------------------------------------------------
    pytest.param(world([INST], [READY]), T0, Pull(TINY, 4, 1),
                 id="pull-when-ready-with-free-slots"),
    pytest.param(world([INST], [runner(slots=1)]), T0, Pull(TINY, 1, 0),
                 id="a-single-slot-keeps-no-reserve-from-batch"),
    pytest.param(world([INST], [runner(in_flight=["a", "b", "c"])]), T0, Pull(TINY, 1, 1),
                 id="the-last-free-slot-is-reserved-from-batch"),
    pytest.param(world([INST], [runner(in_flight=["a"])]), T0, Pull(TINY, 3, 1),
                 id="pull-batch-is-free-slots"),
    pytest.param(world([INST], [READY], [pending("x", images=(SHA,), fetching=True),
                                          pending("y", images=(SHA,), fetching=True)]),
                 T0, Pull(TINY, 2, 1), id="pull-batch-is-free-slots-minus-pending"),
    pytest.param(world([INST], [runner(slots=2, in_flight=["a"])],
                       [pending(images=(SHA,), fetching=True)]),
                 T0, None, id="no-pull-when-pending-fills-the-free-slots"),
    pytest.param(world([INST], [READY], pulling=[TINY]), T0, None,
                 id="never-pull-while-a-pull-is-outstanding"),
    pytest.param(replace(world([INST], [READY]), receiving={"intake-7": TINY, "intake-8": SMOL}),
                 T0, Pull(TINY, 3, 1), id="messages-being-taken-in-count-as-waiting"),
    pytest.param(replace(world([INST], [runner(slots=2, in_flight=["a"])]),
                         receiving={"intake-7": TINY}),
                 T0, None, id="no-pull-when-intakes-fill-the-free-slots"),
    pytest.param(world([INST], [runner(slots=2, in_flight=["a", "b"])]), T0, None,
                 id="no-pull-when-runner-is-full"),
    pytest.param(world([INST], [runner(status=RunnerLoading(), command_sent="load_model")]), T0,
                 None, id="no-pull-before-runner-is-ready"),
    pytest.param(world([INST, instance("inst-2", SMOL)],
                       [READY, runner("run-2", "inst-2", SMOL, slots=2)], pulling=[SMOL]),
                 T0, Pull(TINY, 4, 1), id="outstanding-pull-of-one-model-does-not-block-another"),
    pytest.param(world([INST, instance("inst-2")],
                       [runner(slots=2), runner("run-2", "inst-2", slots=3, in_flight=["a"])]),
                 T0, Pull(TINY, 4, 1), id="pull-batch-sums-runners-of-a-model"),
    pytest.param(world([INST], [runner(command_sent="shutdown")]), T0, None,
                 id="no-pull-for-a-runner-shutting-down"),
    pytest.param(world(), T0, None, id="idle-node-does-nothing"),
]


@pytest.mark.parametrize(("state", "now", "expected"), ROWS)
def test_plan(state: WorkerState, now: float, expected: Action | None) -> None:
    assert plan(state, now) == expected


def _dispatched(state: WorkerState, now: float) -> WorkerState | None:
    """The state after the Dispatch `plan` gives, or None when it gives none."""
    action = plan(state, now)
    if not isinstance(action, Dispatch):
        return None
    return apply(state, ev.TaskDispatched(action.task_id, action.runner_id))


@pytest.mark.parametrize(("state", "now", "expected"), [
    row for row in ROWS if isinstance(row.values[2], Dispatch)
] + [
    pytest.param(world([INST], [READY], [pending("t-1"), pending("t-2", received_at=2.0)]),
                 T0, None, id="two-waiting-then-one"),
    pytest.param(world([INST], [replace(READY, slots=1)],
                       [pending("t-1"), pending("t-2", received_at=2.0)]),
                 T0, None, id="two-waiting-one-slot"),
    pytest.param(world([INST], [READY], [pending("t-1"), pending("t-2", images=(SHA,),
                                                                fetching=True)]),
                 T0, None, id="one-ready-one-fetching-its-inputs"),
])
def test_after_a_dispatch_the_rules_from_dispatch_on_plan_what_all_would(
    state: WorkerState, now: float, expected: object
) -> None:
    after = _dispatched(state, now)
    assert after is not None
    assert plan(after, now, AFTER_DISPATCH) == plan(after, now)


def test_plan_is_pure_the_same_inputs_give_the_same_action() -> None:
    state = world([INST], [READY], [pending(images=(SHA,))])
    assert plan(state, T0) == plan(state, T0) == FetchInputs("t-1", (SHA,))


# ---- whole scenarios: fold events with apply, ask plan at each step ----------------------

def test_from_placement_to_dispatch_each_step_plans_the_next() -> None:
    state = apply(world(), ev.InstancesChanged({"inst-1": INST}))
    steps: list[tuple[object, Action | None]] = [
        (ev.RunnerStarting("inst-1"), None),
        (ev.RunnerSpawned(runner(status=RunnerIdle())), AdvanceRunner("run-1", "connect_to_group")),
        (ev.CommandSent("run-1", "connect_to_group"), None),
        (ev.RunnerStatusSeen("run-1", RunnerConnecting()), None),
        (ev.RunnerStatusSeen("run-1", RunnerConnected()), AdvanceRunner("run-1", "load_model")),
        (ev.CommandSent("run-1", "load_model"), None),
        (ev.RunnerStatusSeen("run-1", RunnerLoaded()), AdvanceRunner("run-1", "warm_up")),
        (ev.CommandSent("run-1", "warm_up"), None),
        (ev.RunnerStatusSeen("run-1", RunnerReady()), Pull(TINY, 4, 1)),
        (ev.PullStarted(TINY), None),
        (ev.TaskQueued(pending()), Dispatch("t-1", "run-1")),
        (ev.PullEnded(TINY), Dispatch("t-1", "run-1")),
        (ev.TaskDispatched("t-1", "run-1"), Pull(TINY, 3, 1)),
        (ev.TaskEnded("t-1"), Pull(TINY, 4, 1)),
    ]
    assert plan(state, T0) == SpawnRunner(INST)
    seen = []
    for event, _ in steps:
        state = apply(state, event)
        seen.append(plan(state, T0))
    assert seen == [expected for _, expected in steps]


def test_a_crashing_runner_is_restarted_with_growing_backoff() -> None:
    state = world([INST], [runner(status=RunnerReady())])
    state = apply(state, ev.RunnerGone("run-1", crashed=True, at=T0))
    assert plan(state, T0 + 0.5) is None
    assert plan(state, T0 + 1.0) == SpawnRunner(INST)

    state = apply(state, ev.RunnerSpawned(runner(status=RunnerIdle())))
    state = apply(state, ev.RunnerGone("run-1", crashed=True, at=T0 + 2))
    assert plan(state, T0 + 3.5) is None  # second crash: 2 s
    assert plan(state, T0 + 4.0) == SpawnRunner(INST)

    state = apply(
        state, ev.RunnerSpawned(runner(status=RunnerWarmingUp(), command_sent="warm_up"))
    )
    state = apply(state, ev.RunnerStatusSeen("run-1", RunnerReady()))
    state = apply(state, ev.RunnerGone("run-1", crashed=True, at=T0 + 10))
    assert plan(state, T0 + 11.0) == SpawnRunner(INST)  # ready once: the count starts again


def test_a_gone_peer_holds_only_the_failure_of_its_ranks() -> None:
    """GroupPeerGone marks the crash's failure of the same ranks; one of other ranks (moved
    since) or none (the runner got ready since) is left alone."""
    ranks = ranks_of(group_layout(SHARDED))
    failed = world([SHARDED], failures={"inst-s": Failure(1, T0, ranks)})
    held = apply(failed, ev.GroupPeerGone("inst-s", ranks, until=T0 + 15))
    assert held.failures["inst-s"] == Failure(1, T0, ranks, held_until=T0 + 15)
    moved = ranks_of(group_layout(MOVED))
    assert apply(failed, ev.GroupPeerGone("inst-s", moved, until=T0 + 15)) == failed
    ready = world([SHARDED])
    assert apply(ready, ev.GroupPeerGone("inst-s", ranks, until=T0 + 15)) == ready


def test_peer_nodes_are_the_other_ranks_nodes() -> None:
    assert peer_nodes(group_layout(SHARDED), HERE) == [THERE]
    assert peer_nodes(group_layout(SHARDED), THERE) == [HERE]
    assert peer_nodes((), HERE) == []


def test_a_clean_exit_is_respawned_without_backoff() -> None:
    state = world([INST], [READY])
    state = apply(state, ev.RunnerGone("run-1", crashed=False, at=T0))
    assert plan(state, T0) == SpawnRunner(INST)


def test_stopping_the_worker_stops_runners_then_plans_nothing() -> None:
    state = apply(world([INST], [READY]), ev.Stopping())
    assert plan(state, T0) == StopRunner("run-1", "instance removed")
    state = apply(state, ev.CommandSent("run-1", "shutdown"))
    assert plan(state, T0) is None
    state = apply(state, ev.RunnerGone("run-1", crashed=False, at=T0))
    assert plan(state, T0) is None  # no respawn, no pull


# ---- the place-then-remove livelock --------------------------------------------------------

LIVELOCK_ROWS = [
    # (runner status when the instance vanished, the command already sent to it)
    pytest.param(RunnerIdle(), None, id="removed-before-connect"),
    pytest.param(RunnerIdle(), "connect_to_group", id="removed-while-connecting"),
    pytest.param(RunnerConnected(), "connect_to_group", id="removed-when-connected"),
    pytest.param(RunnerLoading(), "load_model", id="removed-while-loading"),
    pytest.param(RunnerLoaded(), "load_model", id="removed-when-loaded"),
    pytest.param(RunnerWarmingUp(), "warm_up", id="removed-while-warming-up"),
]


@pytest.mark.parametrize(("status", "sent"), LIVELOCK_ROWS)
def test_a_runner_whose_instance_is_removed_while_starting_is_stopped_once(
    status: RunnerStatus, sent: str | None
) -> None:
    """`instances place` then an immediate `instances remove`: the orphan runner is stopped
    once and never advanced; the planner then has nothing to do (no 100 % CPU loop)."""
    state = world([], [runner(status=status, command_sent=sent)])
    actions: list[Action] = []
    while (action := plan(state, T0)) is not None and len(actions) < 10:
        actions.append(action)
        match action:
            case StopRunner(runner_id=rid):
                state = apply(state, ev.CommandSent(rid, "shutdown"))
            case AdvanceRunner(runner_id=rid, command=command):
                state = apply(state, ev.CommandSent(rid, command))
    assert actions == [StopRunner("run-1", "instance removed")]
    # The runner's next status report (it kept loading) changes nothing.
    state = apply(state, ev.RunnerStatusSeen("run-1", RunnerLoaded()))
    assert plan(state, T0) is None


def test_a_shutdown_is_final_even_if_a_lifecycle_command_is_applied_after_it() -> None:
    state = world([INST], [runner(status=RunnerIdle())])
    state = apply(state, ev.CommandSent("run-1", "shutdown"))
    state = apply(state, ev.CommandSent("run-1", "connect_to_group"))
    assert state.runners["run-1"].shutting_down
    assert plan(state, T0) is None


HAND_BACK_ROWS = [
    pytest.param(world([], [], [pending(inputs={})]), HandBack("t-1"),
                 id="model-no-longer-hosted-here"),
    pytest.param(world([instance(node=THERE)], [], [pending(inputs={})]), HandBack("t-1"),
                 id="instance-moved-to-another-node"),
    pytest.param(world([], [], [pending(fetching=True)]), None, id="not-while-inputs-download"),
    pytest.param(world([], [], [pending(inputs={})], stopping=True), None,
                 id="not-when-stopping-the-shutdown-naks-it"),
    pytest.param(world([INST], [runner(status=RunnerLoading(), command_sent="load_model")],
                       [pending(inputs={})]), None, id="kept-while-its-runner-loads"),
]


@pytest.mark.parametrize(("state", "expected"), HAND_BACK_ROWS)
def test_hand_back(state: WorkerState, expected: Action | None) -> None:
    assert plan(state, T0) == expected


def sharded(ring_b: str = "10.0.0.2:7000") -> Instance:
    shards = [
        ShardAssignment(node_id=THERE, runner_id="p", rank=0, world_size=2, start_layer=0,
                        end_layer=1, ring_address="10.0.0.1:7000"),
        ShardAssignment(node_id=HERE, runner_id="p", rank=1, world_size=2, start_layer=1,
                        end_layer=2, ring_address=ring_b),
    ]
    return Instance(instance_id="inst-1", model=TINY, shards=shards, created_at=0.0)


def test_rank_1_of_a_sharded_instance_takes_no_tasks_and_restarts_when_its_group_moves() -> None:
    from dataclasses import replace

    from fleet.worker.runners import group_spec
    from fleet.worker.state import group_layout

    inst = sharded()
    assert group_spec(inst, HERE).rank == 1 and group_spec(inst, HERE).ring[1] == "10.0.0.2:7000"
    assert group_spec(instance(), HERE) is None
    follower = replace(runner(), rank=1, layout=group_layout(inst))
    state = world([inst], [follower], [pending()])
    assert follower.free_slots == 0
    assert plan(state, T0) is None  # no dispatch to rank 1, no pull for it
    moved = sharded(ring_b="10.0.0.3:7000")  # rank 1 re-placed: a new ring
    assert plan(world([moved], [follower]), T0) == StopRunner(
        "run-1", "its group changed", now=True
    )


# ---- a drained model's next pull waits for its young intakes (issue 23) -----------------

def taking_in(began: float, *, drained: bool = True, model: str = TINY) -> WorkerState:
    """A ready 4-slot runner, one message of `model` being taken in since `began`."""
    state = world([INST], [READY])
    return replace(state, receiving={"intake-1": model}, intake_began={"intake-1": began},
                   drained=frozenset({TINY}) if drained else frozenset())


@pytest.mark.parametrize(("state", "now", "held_until", "expected"), [
    pytest.param(taking_in(T0), T0 + 0.01, T0 + INTAKE_HOLD_S, None,
                 id="drained-and-a-young-intake-holds-the-pull"),
    pytest.param(taking_in(T0), T0 + INTAKE_HOLD_S, None, Pull(TINY, 3, 1),
                 id="an-intake-older-than-the-hold-holds-nothing"),
    pytest.param(taking_in(T0, drained=False), T0 + 0.01, None, Pull(TINY, 3, 1),
                 id="after-a-full-fetch-more-may-be-queued-pulled-at-once"),
    pytest.param(taking_in(T0, model="other-llm"), T0 + 0.01, None, Pull(TINY, 4, 1),
                 id="another-models-intake-holds-nothing"),
    pytest.param(replace(world([INST], [READY]), drained=frozenset({TINY})), T0, None,
                 Pull(TINY, 4, 1), id="drained-with-no-intake-pulls"),
    pytest.param(replace(taking_in(T0), receiving={"intake-1": TINY, "intake-2": "other-llm"},
                         intake_began={"intake-1": T0, "intake-2": T0 + 0.03}),
                 T0 + 0.01, T0 + INTAKE_HOLD_S, None, id="only-the-models-own-intakes-hold-it"),
    pytest.param(replace(taking_in(T0), receiving={"intake-1": TINY, "intake-2": TINY},
                         intake_began={"intake-1": T0, "intake-2": T0 + 0.03}),
                 T0 + 0.06, T0 + 0.03 + INTAKE_HOLD_S, None,
                 id="the-youngest-of-several-intakes-holds-it"),
    pytest.param(replace(taking_in(T0), intake_began={"intake-1": T0, "gone": T0 + 0.03}),
                 T0 + 0.06, None, Pull(TINY, 3, 1),
                 id="a-began-time-without-its-intake-holds-nothing"),
])
def test_a_drained_models_pull_waits_for_its_young_intakes(
    state: WorkerState, now: float, held_until: float | None, expected: Action | None
) -> None:
    assert pull_held_until(state, TINY, now) == held_until
    assert pulls_held_until(state, now) == held_until
    assert plan(state, now) == expected


def test_the_hold_ends_at_the_youngest_intakes_bound() -> None:
    state = replace(taking_in(T0), receiving={"intake-1": TINY, "intake-2": TINY},
                    intake_began={"intake-1": T0, "intake-2": T0 + 0.02})
    assert pull_held_until(state, TINY, T0 + INTAKE_HOLD_S) == T0 + 0.02 + INTAKE_HOLD_S
    state = apply(state, ev.IntakeEnded("intake-2"))
    assert plan(state, T0 + INTAKE_HOLD_S) == Pull(TINY, 3, 1)
