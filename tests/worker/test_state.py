"""`apply(state, event)`: a table of (state, event, expected state); the input is never changed."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest

from fleet.wire.cluster import Instance, ModelCard, ShardAssignment
from fleet.wire.runners import RunnerConnected, RunnerFailed, RunnerLoading, RunnerReady
from fleet.wire.tasks import ImageEdits, TextGeneration
from fleet.worker import state as ev
from fleet.worker.state import (
    CancelOrigin,
    Failure,
    PendingTask,
    Place,
    RunnerView,
    TaskRecord,
    WorkerState,
    apply,
    evolve,
    group_layout,
)

HERE = "node-a"
SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

INST = Instance(
    instance_id="inst-1", model="tiny-llm", created_at=0.0,
    shards=[ShardAssignment(node_id=HERE, runner_id="run-1")],
)
INST_2 = Instance(
    instance_id="inst-2", model="tiny-llm", created_at=0.0,
    shards=[ShardAssignment(node_id="node-b", runner_id="run-2")],
)
RUNNER = RunnerView(runner_id="run-1", instance_id="inst-1", model="tiny-llm", slots=4)
BUSY = replace(RUNNER, status=RunnerReady(), in_flight=frozenset({"t-0", "t-1"}))
TEXT = PendingTask(
    task=TextGeneration(task_id="t-1", model="tiny-llm", prompt="hi"), received_at=5.0, inputs={}
)
EDIT = PendingTask(
    task=ImageEdits(task_id="t-2", model="tiny-flux2", prompt="night", input_images=[SHA]),
    received_at=6.0,
)

CARD = ModelCard(id="tiny-llm", name="tiny", tasks=["text_generation"], family="mlx_lm",
                 source="built-in")
CARD_B = CARD.model_copy(update={"id": "b"})

EMPTY = WorkerState(node_id=HERE)
WITH_RUNNER = replace(EMPTY, instances={"inst-1": INST}, runners={"run-1": RUNNER})


def given(**changes: object) -> WorkerState:
    return replace(EMPTY, **changes)  # type: ignore[arg-type]


ROWS = [
    # ---- instances and runners -------------------------------------------------------------
    pytest.param(given(instances={"inst-1": INST}), ev.InstancesChanged({"inst-2": INST_2}),
                 given(instances={"inst-2": INST_2}), id="instances-are-replaced-whole"),
    pytest.param(given(cards={"tiny-llm": CARD}),
                 ev.CardsChanged({"tiny-llm": CARD, "b": CARD_B}),
                 given(cards={"tiny-llm": CARD, "b": CARD_B}),
                 id="cards-are-a-snapshot-replaced-whole"),
    pytest.param(EMPTY, ev.RunnerStarting("inst-1"), given(starting=frozenset({"inst-1"})),
                 id="starting-is-recorded"),
    pytest.param(given(starting=frozenset({"inst-1"})), ev.RunnerSpawned(RUNNER),
                 given(runners={"run-1": RUNNER}), id="spawned-runner-replaces-starting"),
    pytest.param(given(starting=frozenset({"inst-1"})), ev.RunnerStartFailed("inst-1", at=9.0),
                 given(failures={"inst-1": Failure(1, 9.0)}), id="start-failure-is-counted"),
    pytest.param(given(failures={"inst-1": Failure(2, 3.0)}), ev.RunnerStartFailed("inst-1", 9.0),
                 given(failures={"inst-1": Failure(3, 9.0)}), id="start-failures-add-up"),
    pytest.param(WITH_RUNNER, ev.CommandSent("run-1", "load_model"),
                 replace(WITH_RUNNER,
                         runners={"run-1": replace(RUNNER, command_sent="load_model")}),
                 id="command-sent-is-remembered"),
    pytest.param(WITH_RUNNER, ev.CommandSent("run-9", "load_model"), WITH_RUNNER,
                 id="command-to-unknown-runner-changes-nothing"),
    pytest.param(WITH_RUNNER, ev.RunnerStatusSeen("run-1", RunnerLoading(layers_done=1)),
                 replace(WITH_RUNNER,
                         runners={"run-1": replace(RUNNER, status=RunnerLoading(layers_done=1))}),
                 id="status-is-recorded"),
    pytest.param(replace(WITH_RUNNER, failures={"inst-1": Failure(2, 1.0)}),
                 ev.RunnerStatusSeen("run-1", RunnerReady()),
                 replace(WITH_RUNNER, runners={"run-1": replace(RUNNER, status=RunnerReady())}),
                 id="ready-forgets-past-failures"),
    pytest.param(replace(WITH_RUNNER, failures={"inst-1": Failure(2, 1.0)}),
                 ev.RunnerStatusSeen("run-1", RunnerConnected()),
                 replace(WITH_RUNNER, runners={"run-1": replace(RUNNER, status=RunnerConnected())},
                         failures={"inst-1": Failure(2, 1.0)}),
                 id="not-ready-keeps-failures"),
    pytest.param(WITH_RUNNER, ev.RunnerStatusSeen("run-9", RunnerReady()), WITH_RUNNER,
                 id="status-of-unknown-runner-changes-nothing"),
    pytest.param(WITH_RUNNER, ev.RunnerGone("run-1", crashed=True, at=7.0),
                 given(instances={"inst-1": INST}, failures={"inst-1": Failure(1, 7.0)}),
                 id="crashed-runner-is-removed-and-counted"),
    pytest.param(replace(WITH_RUNNER, runners={"run-1": replace(RUNNER, layout=(1, "old"))},
                         failures={"inst-1": Failure(4, 3.0, ("older",))}),
                 ev.RunnerGone("run-1", crashed=True, at=7.0),
                 given(instances={"inst-1": INST},
                       failures={"inst-1": Failure(1, 7.0, ("old",))}),
                 id="a-crash-in-a-group-placed-otherwise-counts-from-one"),
    pytest.param(WITH_RUNNER, ev.RunnerGone("run-1", crashed=False, at=7.0),
                 given(instances={"inst-1": INST}), id="clean-exit-is-removed-not-counted"),
    pytest.param(WITH_RUNNER, ev.RunnerGone("run-9", crashed=True, at=7.0), WITH_RUNNER,
                 id="unknown-runner-gone-changes-nothing"),
    # ---- pulls -----------------------------------------------------------------------------
    pytest.param(EMPTY, ev.PullStarted("tiny-llm"), given(pulling=frozenset({"tiny-llm"})),
                 id="pull-started"),
    pytest.param(given(pulling=frozenset({"tiny-llm", "tiny-flux2"})), ev.PullEnded("tiny-llm"),
                 given(pulling=frozenset({"tiny-flux2"})), id="pull-ended-for-that-model-only"),
    pytest.param(given(pulling=frozenset({"tiny-llm"})), ev.PullEnded("tiny-llm", drained=True),
                 given(drained=frozenset({"tiny-llm"})), id="a-short-pull-marks-its-model-drained"),
    pytest.param(given(pulling=frozenset({"tiny-llm"}), drained=frozenset({"tiny-llm"})),
                 ev.PullEnded("tiny-llm"), EMPTY, id="a-full-pull-clears-the-mark"),
    # ---- a task's record: pins, cancels, its ending, until it is released ------------------
    pytest.param(EMPTY, ev.InputsPinned("t-2", (SHA,)),
                 given(tasks={"t-2": TaskRecord(pinned=(SHA,))}), id="inputs-pinned"),
    pytest.param(given(tasks={"t-2": TaskRecord(pinned=(SHA,))}),
                 ev.CancelNoted("t-2", CancelOrigin.WHILE_RUNNING),
                 given(tasks={"t-2": TaskRecord((SHA,), CancelOrigin.WHILE_RUNNING)}),
                 id="a-cancel-joins-the-pins"),
    pytest.param(EMPTY, ev.CancelNoted("t-1", CancelOrigin.WHILE_OFFERED),
                 given(tasks={"t-1": TaskRecord(cancel=CancelOrigin.WHILE_OFFERED)}),
                 id="cancel-while-offered-noted"),
    pytest.param(given(tasks={"t-1": TaskRecord(cancel=CancelOrigin.WHILE_OFFERED)}),
                 ev.CancelNoted("t-1", None), given(tasks={"t-1": TaskRecord()}),
                 id="a-spent-cancel-is-cleared"),
    pytest.param(EMPTY, ev.CancelNoted("t-9", None), EMPTY, id="clearing-no-note-adds-none"),
    pytest.param(given(tasks={"t-1": TaskRecord(cancel=CancelOrigin.WHILE_RUNNING),
                              "t-2": TaskRecord(pinned=(SHA,))}),
                 ev.TaskReleased("t-1"), given(tasks={"t-2": TaskRecord(pinned=(SHA,))}),
                 id="released-drops-that-tasks-record-only"),
    pytest.param(EMPTY, ev.TaskReleased("t-9"), EMPTY, id="releasing-unknown-task-is-harmless"),
    # A terminal queued behind an image upload: the task is ending, still on its runner's
    # books (its slot and its held message) until its images are stored and it is released.
    pytest.param(replace(WITH_RUNNER, runners={"run-1": BUSY}), ev.TerminalQueued("t-1"),
                 replace(WITH_RUNNER, runners={"run-1": BUSY},
                         tasks={"t-1": TaskRecord(ending=True)}),
                 id="terminal-queued-behind-an-upload-makes-a-running-task-ending"),
    pytest.param(replace(WITH_RUNNER, runners={"run-1": BUSY},
                         tasks={"t-1": TaskRecord(cancel=CancelOrigin.WHILE_RUNNING)}),
                 ev.TerminalQueued("t-1"),
                 replace(WITH_RUNNER, runners={"run-1": BUSY},
                         tasks={"t-1": TaskRecord(cancel=CancelOrigin.WHILE_RUNNING,
                                                  ending=True)}),
                 id="ending-keeps-the-cancel-that-shapes-the-terminal"),
    pytest.param(given(pending={"t-1": TEXT}), ev.TerminalQueued("t-1"),
                 given(pending={"t-1": TEXT}), id="a-queued-task-cannot-be-ending"),
    pytest.param(WITH_RUNNER, ev.TerminalQueued("t-9"), WITH_RUNNER,
                 id="terminal-of-a-task-not-running-here-changes-nothing"),
    pytest.param(replace(WITH_RUNNER, runners={"run-1": BUSY},
                         tasks={"t-1": TaskRecord(ending=True)}),
                 ev.TaskEnded("t-1"),
                 replace(WITH_RUNNER,
                         runners={"run-1": replace(BUSY, in_flight=frozenset({"t-0"}))},
                         tasks={"t-1": TaskRecord(ending=True)}),
                 id="an-ending-task-frees-its-slot-and-keeps-its-record-to-release"),
    pytest.param(given(tasks={"t-1": TaskRecord(ending=True)}), ev.TaskReleased("t-1"), EMPTY,
                 id="an-ended-task-is-released-once-its-terminal-went"),
    # ---- intakes ---------------------------------------------------------------------------
    pytest.param(EMPTY, ev.IntakeStarted("intake-7", "tiny-llm", 5.0),
                 given(receiving={"intake-7": "tiny-llm"}, intake_began={"intake-7": 5.0}),
                 id="intake-started"),
    pytest.param(given(receiving={"intake-7": "tiny-llm", "intake-8": "tiny-llm"},
                       intake_began={"intake-7": 5.0, "intake-8": 6.0}),
                 ev.IntakeEnded("intake-7"),
                 given(receiving={"intake-8": "tiny-llm"}, intake_began={"intake-8": 6.0}),
                 id="intake-ended-for-that-message-only"),
    pytest.param(EMPTY, ev.IntakeEnded("intake-9"), EMPTY, id="unknown-intake-ended-is-harmless"),
    # ---- tasks -----------------------------------------------------------------------------
    pytest.param(EMPTY, ev.TaskQueued(TEXT), given(pending={"t-1": TEXT}), id="task-queued"),
    pytest.param(given(pending={"t-2": EDIT}), ev.InputsFetching("t-2"),
                 given(pending={"t-2": replace(EDIT, fetching=True)}), id="inputs-fetching"),
    pytest.param(given(pending={"t-2": replace(EDIT, fetching=True)}),
                 ev.InputsReady("t-2", {SHA: "/images/x"}),
                 given(pending={"t-2": replace(EDIT, inputs={SHA: "/images/x"})}),
                 id="inputs-ready-ends-fetching"),
    pytest.param(EMPTY, ev.InputsFetching("t-9"), EMPTY, id="fetching-unknown-task-is-harmless"),
    pytest.param(EMPTY, ev.InputsReady("t-9", {}), EMPTY, id="inputs-of-unknown-task-are-harmless"),
    pytest.param(replace(WITH_RUNNER, pending={"t-1": TEXT}), ev.TaskDispatched("t-1", "run-1"),
                 replace(WITH_RUNNER,
                         runners={"run-1": replace(
                             RUNNER, in_flight=frozenset({"t-1"}), prefill={"t-1": 0},
                             classes={"t-1": (TEXT.task.priority, TEXT.received_at)})}),
                 id="dispatch-moves-task-from-pending-to-runner"),
    pytest.param(replace(WITH_RUNNER, runners={"run-1": BUSY}), ev.TaskEnded("t-1"),
                 replace(WITH_RUNNER,
                         runners={"run-1": replace(BUSY, in_flight=frozenset({"t-0"}))}),
                 id="ended-task-frees-its-slot"),
    pytest.param(given(pending={"t-1": TEXT, "t-2": EDIT}), ev.TaskEnded("t-1"),
                 given(pending={"t-2": EDIT}), id="ended-pending-task-leaves-the-queue"),
    pytest.param(WITH_RUNNER, ev.TaskEnded("t-9"), WITH_RUNNER, id="unknown-task-end-is-harmless"),
    # ---- the worker itself -------------------------------------------------------------------
    pytest.param(WITH_RUNNER, ev.Stopping(), replace(WITH_RUNNER, stopping=True), id="stopping"),
]


@pytest.mark.parametrize(("before", "event", "after"), ROWS)
def test_apply(before: WorkerState, event: object, after: WorkerState) -> None:
    assert apply(before, event) == after


@pytest.mark.parametrize(("before", "event", "after"), ROWS)
def test_apply_never_changes_the_state_it_was_given(
    before: WorkerState, event: object, after: WorkerState
) -> None:
    snapshot = repr(before)
    apply(before, event)
    assert repr(before) == snapshot


@pytest.mark.parametrize(("record", "changes"), [
    pytest.param(WITH_RUNNER, {"stopping": True, "pending": {"t-1": TEXT}}, id="state"),
    pytest.param(BUSY, {"in_flight": frozenset(), "command_sent": "shutdown"}, id="runner"),
    pytest.param(TEXT, {"fetching": True}, id="pending"),
    pytest.param(TaskRecord(), {"cancel": CancelOrigin.FENCED}, id="record"),
])
def test_evolve_builds_what_replace_builds(record: object, changes: dict[str, object]) -> None:
    made = evolve(record, **changes)
    assert made == replace(record, **changes)  # type: ignore[arg-type]
    assert type(made) is type(record) and made is not record
    assert made.__dict__ is not record.__dict__  # never shares (so changes) the original's
    assert repr(made) == repr(replace(record, **changes))  # type: ignore[arg-type]


def test_evolve_refuses_a_field_the_record_has_not() -> None:
    with pytest.raises(TypeError, match="has no field"):
        evolve(EMPTY, stoping=True)


def test_every_state_event_has_exactly_its_own_rule() -> None:
    assert set(get_args(ev.StateEvent)) == set(ev._RULES)


def test_an_unknown_event_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="no apply rule for str"):
        apply(EMPTY, "runner went for lunch")


def test_hosted_instances_are_those_with_a_shard_on_this_node() -> None:
    state = given(instances={"inst-1": INST, "inst-2": INST_2})
    assert state.hosted_instances() == (INST,)
    assert state.hosted_layouts() == {"inst-1": group_layout(INST)}
    assert state.hosted_models() == {INST.model}


def test_runner_for_finds_the_runner_of_an_instance() -> None:
    assert WITH_RUNNER.runner_for("inst-1") == RUNNER
    assert WITH_RUNNER.runner_for("inst-2") is None


@pytest.mark.parametrize(
    ("runner", "free"),
    [
        (replace(RUNNER, status=RunnerReady()), 4),
        (BUSY, 2),
        (replace(BUSY, slots=2), 0),
        (replace(BUSY, slots=1), 0),  # never negative
        (replace(RUNNER, status=RunnerLoading()), 0),
        (replace(RUNNER, status=RunnerFailed(error="oom")), 0),
    ],
)
def test_free_slots_count_only_runners_that_accept_tasks(runner: RunnerView, free: int) -> None:
    assert runner.free_slots == free


def test_a_card_snapshot_is_not_the_dict_it_came_from() -> None:
    """The cluster link keeps changing its own dict; the state sees only what apply gave it."""
    source = {"tiny-llm": CARD}
    state = apply(EMPTY, ev.CardsChanged(source))
    source["b"] = CARD_B
    assert set(state.cards) == {"tiny-llm"}


OFFERED = replace(TEXT, handing_off="node-b")
ON_RUNNER = replace(WITH_RUNNER, runners={"run-1": BUSY})


@pytest.mark.parametrize(
    ("state", "key", "place"),
    [
        (given(receiving={"intake-7": "tiny-llm"}), "intake-7", Place.RECEIVING),
        (given(pending={"t-2": EDIT}), "t-2", Place.WAITING_INPUTS),
        (given(pending={"t-1": TEXT}), "t-1", Place.WAITING_SLOT),
        (given(pending={"t-1": OFFERED}), "t-1", Place.OFFERED),
        (ON_RUNNER, "t-1", Place.RUNNING),
        (replace(ON_RUNNER, tasks={"t-1": TaskRecord(ending=True)}), "t-1", Place.ENDING),
        # Off a dead runner (its record kept until its read-back decides), or never here.
        (given(tasks={"t-1": TaskRecord(ending=True)}), "t-1", Place.NOT_HERE),
        (EMPTY, "t-9", Place.NOT_HERE),
    ],
)
def test_where_a_task_is_comes_from_the_state(state: WorkerState, key: str, place: Place) -> None:
    assert state.place_of(key) is place
