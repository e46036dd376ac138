"""Routing across nodes, pure parts: other nodes' runners as candidates, the hand-off action,
the receiver's rule for taking one, and the state a hand-off's answer leaves (tables)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.prefixes import PrefixSummary
from fleet.wire.runners import RunnerLoading, RunnerReady
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.handoff import remote_runner
from fleet.worker.plan import (
    Dispatch,
    HandOff,
    Pull,
    declines_hand_off,
    plan,
)
from fleet.worker.routes import SILENT_S, advert_live, hosted
from fleet.worker.routing import Candidate, PrefixHeld, Weights, choose
from fleet.worker.state import (
    HandOffEnded,
    HandOffStarted,
    PendingTask,
    RemoteRunner,
    RemoteRunnersSeen,
    RunnerView,
    TaskQueued,
    WorkerState,
    apply,
)

HERE, THERE = "node-a", "node-b"
T0 = 1_000.0
PROMPT = tuple(range(1, 11))  # ten blocks


def held(*blocks: int) -> PrefixHeld:
    return PrefixHeld().served(blocks, capacity=100)


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        # equal cost: this node wins (the hand-off costs 1 block)
        ([Candidate("a", 4, 0), Candidate("b", 4, 0, node_id=THERE)], "a"),
        # the remote runner holds the prompt: 10 blocks saved beat the hop
        ([Candidate("a", 4, 0), Candidate("b", 4, 0, held(*PROMPT), THERE)], "b"),
        # it holds one block only: 1 saved = 1 for the hop, a tie: this node
        ([Candidate("a", 4, 0), Candidate("b", 4, 0, held(1), THERE)], "a"),
        # two blocks saved: worth the hop
        ([Candidate("a", 4, 0), Candidate("b", 4, 0, held(1, 2), THERE)], "b"),
        # both hold it: no hop
        ([Candidate("a", 4, 0, held(*PROMPT)), Candidate("b", 4, 0, held(*PROMPT), THERE)], "a"),
        # the remote home has more prefill queued than it saves
        ([Candidate("a", 4, 0),
          Candidate("b", 1, 3, held(*PROMPT), THERE, prefill_blocks=12, prefilling=3)], "a"),
        # ... but merely decoding there is no reason to stay
        ([Candidate("a", 4, 0), Candidate("b", 1, 3, held(*PROMPT), THERE)], "b"),
        # no free slot here: a free remote runner takes it rather than let it wait
        ([Candidate("a", 0, 4), Candidate("b", 4, 0, node_id=THERE)], "b"),
        # no free slot anywhere
        ([Candidate("a", 0, 4), Candidate("b", 0, 4, held(*PROMPT), THERE)], None),
    ],
)
def test_choose_weighs_a_hand_off(candidates: list[Candidate], chosen: str | None) -> None:
    best = choose(PROMPT, candidates)
    assert (best.runner_id if isinstance(best, Candidate) else None) == chosen


def test_without_prefix_routing_only_this_node_is_chosen() -> None:
    candidates = [Candidate("a", 1, 3), Candidate("b", 4, 0, held(*PROMPT), THERE)]
    best = choose(PROMPT, candidates, Weights(prefix=False))
    assert best is not None and best.runner_id == "a"


# ---- the plan ------------------------------------------------------------------------------

def chat_task(task_id: str = "t-1") -> TextGeneration:
    return TextGeneration(task_id=task_id, model="tiny-llm",
                          messages=[ChatMessage(role="user", content="hi")])


def pending(**changes: object) -> PendingTask:
    base = PendingTask(task=chat_task(), received_at=T0, inputs={}, blocks=PROMPT)
    return replace(base, **changes)  # type: ignore[arg-type]


def remote(runner_id: str = "run-b", *, blocks: tuple[int, ...] = PROMPT, in_flight: int = 0,
           slots: int = 4, at: float = T0, model: str = "tiny-llm",
           node: str = THERE) -> RemoteRunner:
    return RemoteRunner(runner_id, node, model, slots, in_flight, held(*blocks), at)


def world(tasks: list[PendingTask], remotes: list[RemoteRunner], *, local_busy: int = 0,
          prefix: bool = True, stopping: bool = False, placed_there: bool = True) -> WorkerState:
    instance = Instance(instance_id="inst-a", model="tiny-llm", slots=4, created_at=0.0,
                        shards=[ShardAssignment(node_id=HERE, runner_id="run-a")])
    there = Instance(instance_id="inst-b", model="tiny-llm", slots=4, created_at=0.0,
                     shards=[ShardAssignment(node_id=THERE, runner_id="pending")])
    local = RunnerView("run-a", "inst-a", "tiny-llm", status=RunnerReady(), slots=4,
                       in_flight=frozenset(f"busy-{i}" for i in range(local_busy)))
    return WorkerState(
        node_id=HERE, instances={"inst-a": instance, **({"inst-b": there} if placed_there else {})},
        runners={"run-a": local},
        pending={p.task.task_id: p for p in tasks},
        remote={r.runner_id: r for r in remotes}, routing=Weights(prefix=prefix),
        stopping=stopping,
    )


def replace_deadline(task: TextGeneration) -> TextGeneration:
    return task.model_copy(update={"deadline": datetime.fromtimestamp(T0 + 1, UTC)})


HAND_OFF = HandOff("t-1", THERE, "run-b")
HERE_NOW = Dispatch("t-1", "run-a")


@pytest.mark.parametrize(
    ("state", "now", "expected"),
    [
        pytest.param(world([pending()], [remote()]), T0, HAND_OFF,
                     id="the-node-holding-the-prompt-gets-it"),
        pytest.param(world([pending()], [remote(blocks=())]), T0, HERE_NOW,
                     id="nothing-held-there-runs-here"),
        pytest.param(world([pending()], [remote(in_flight=4)]), T0, HERE_NOW,
                     id="a-full-remote-runner-is-no-candidate"),
        pytest.param(world([pending()], [remote(slots=0)]), T0, HERE_NOW,
                     id="a-summary-without-slots-is-no-candidate"),
        pytest.param(world([pending()], [remote(at=T0 - 3600)]), T0, HAND_OFF,
                     id="an-old-summary-of-a-placed-node-counts-adverts-change-only"),
        pytest.param(world([pending()], [remote()], placed_there=False), T0, HERE_NOW,
                     id="a-runner-whose-node-holds-no-instance-of-its-model-is-ignored"),
        pytest.param(world([pending()], [remote(model="smollm2-135m")]), T0, HERE_NOW,
                     id="another-models-runner-is-no-candidate"),
        pytest.param(world([pending(local_only=True)], [remote()]), T0, HERE_NOW,
                     id="a-handed-in-or-declined-task-stays"),
        pytest.param(world([pending(inputs={"sha": "/p"})], [remote()]), T0, HERE_NOW,
                     id="a-task-with-input-images-stays"),
        pytest.param(world([pending(blocks=())], [remote()]), T0, HERE_NOW,
                     id="a-prompt-without-whole-blocks-stays"),
        pytest.param(world([pending(blocks=())], [remote(blocks=())], local_busy=4), T0,
                     HAND_OFF, id="a-prompt-without-whole-blocks-moves-to-a-free-slot-there"),
        pytest.param(world([pending(blocks=())], [remote(in_flight=4)], local_busy=4), T0,
                     None, id="a-prompt-without-whole-blocks-waits-when-no-slot-is-free"),
        pytest.param(world([pending()], [remote()], prefix=False), T0, HERE_NOW,
                     id="prefix-routing-off-stays"),
        pytest.param(world([pending(handing_off=THERE)], [remote()]), T0, Pull("tiny-llm", 3, 1),
                     id="a-task-being-handed-off-is-not-planned-again-and-keeps-its-slot"),
        pytest.param(world([pending()], [remote(blocks=())], local_busy=4), T0, HAND_OFF,
                     id="no-slot-here-a-free-one-there-takes-it"),
        pytest.param(world([pending(task=replace_deadline(chat_task()), handing_off=THERE)],
                           []), T0 + 10, Pull("tiny-llm", 3, 1),
                     id="the-deadline-waits-for-the-answer"),
    ],
)
def test_plan_across_nodes(state: WorkerState, now: float, expected: object) -> None:
    assert plan(state, now) == expected


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (world([], []), None),
        (world([], [], local_busy=3), None),
        (world([], [], local_busy=4), "no free slot"),
        (world([pending(local_only=True)], [], local_busy=3), "no free slot"),
        (replace(world([], [], local_busy=3), receiving={"intake-1": "tiny-llm"}),
         "no free slot"),  # an offer being taken in holds the last slot
        (world([], [], stopping=True), "stopping"),
    ],
)
def test_a_hand_off_is_taken_only_into_a_free_slot(state: WorkerState, reason: str | None) -> None:
    assert declines_hand_off(state, "tiny-llm") == reason


def _shard(node: str, rank: int = 0) -> ShardAssignment:
    return ShardAssignment(node_id=node, runner_id="pending", rank=rank, world_size=2)


@pytest.mark.parametrize(("instances", "hosts"), [
    ({}, frozenset()),
    ({"i": Instance(instance_id="i", model="m", slots=1, created_at=0.0,
                    shards=[_shard("a"), _shard("b", 1)])},
     frozenset({("m", "a")})),  # rank 1 takes no tasks: not a host
    ({"i": Instance(instance_id="i", model="m", slots=1, created_at=0.0, shards=[_shard("a")]),
      "j": Instance(instance_id="j", model="n", slots=1, created_at=0.0, shards=[_shard("a")])},
     frozenset({("m", "a"), ("n", "a")})),
])
def test_hosts_are_the_rank_0_nodes_of_each_model(
    instances: dict[str, Instance], hosts: frozenset[tuple[str, str]]
) -> None:
    assert hosted(instances) == hosts


HOSTS = frozenset({("tiny-llm", THERE)})


@pytest.mark.parametrize(("runner", "hosts", "silent_at", "now", "live"), [
    (remote(), HOSTS, None, T0, True),
    (remote(at=T0 - 86_400), HOSTS, None, T0, True),  # idle a day: its advert still holds
    (remote(), frozenset(), None, T0, False),  # its node's instance moved (dead, or removed)
    (remote(model="other"), HOSTS, None, T0, False),  # its node serves another model now
    (remote(at=T0), HOSTS, T0 + 1, T0 + 2, False),  # silent since, no advert after
    (remote(at=T0 + 3), HOSTS, T0 + 1, T0 + 4, True),  # it advertised again
    (remote(at=T0), HOSTS, T0 + 1, T0 + 1 + SILENT_S, True),  # silent long enough: try again
])
def test_an_advert_is_live_while_its_node_holds_its_model(
    runner: RemoteRunner, hosts: frozenset[tuple[str, str]], silent_at: float | None,
    now: float, live: bool
) -> None:
    assert advert_live(runner, hosts, silent_at, now) is live


def test_a_runner_not_ready_declines() -> None:
    state = world([], [])
    loading = replace(state.runners["run-a"], status=RunnerLoading(layers_done=0, layers_total=1))
    state = replace(state, runners={"run-a": loading})
    assert declines_hand_off(state, "tiny-llm") == "no free slot"
    assert declines_hand_off(state, "smollm2-135m") == "no free slot"


# ---- the state a hand-off leaves ------------------------------------------------------------

def test_taken_removes_the_task_and_notes_the_prompt_there() -> None:
    state = apply(world([pending()], [remote(blocks=(), in_flight=1)]),
                  HandOffStarted("t-1", THERE))
    assert state.pending["t-1"].handing_off == THERE
    state = apply(state, HandOffEnded("t-1", THERE, "run-b", True, T0))
    assert "t-1" not in state.pending
    assert state.remote["run-b"].in_flight == 1  # its load comes from its own summaries
    assert state.remote["run-b"].held.matched(PROMPT) == len(PROMPT)


def test_declined_keeps_the_task_here_for_good() -> None:
    state = apply(world([pending()], [remote()]), HandOffStarted("t-1", THERE))
    state = apply(state, HandOffEnded("t-1", THERE, "run-b", False, T0))
    assert state.pending["t-1"].handing_off is None and state.pending["t-1"].local_only
    assert plan(state, T0) == HERE_NOW


def test_unanswered_forgets_the_task_and_assumes_nothing_there() -> None:
    state = apply(world([pending()], [remote(in_flight=1)]), HandOffStarted("t-1", THERE))
    state = apply(state, HandOffEnded("t-1", THERE, "run-b", None, T0 + 1))
    assert "t-1" not in state.pending and state.remote["run-b"].in_flight == 1
    # That node is silent: its runners are no candidates until it advertises again.
    state = apply(state, ev_queued(pending(task=chat_task("t-2"))))
    assert plan(state, T0 + 2) == Dispatch("t-2", "run-a")
    state = apply(state, RemoteRunnersSeen({"run-b": remote(at=T0 + 1.5)}))
    assert plan(state, T0 + 2) == HandOff("t-2", THERE, "run-b")


def ev_queued(task: PendingTask) -> TaskQueued:
    return TaskQueued(task)


def test_this_nodes_own_summaries_are_not_remote() -> None:
    state = apply(world([], []), RemoteRunnersSeen({
        "run-b": remote(), "run-a": remote("run-a", node=HERE),
    }))
    assert set(state.remote) == {"run-b"}


def test_a_summary_becomes_a_remote_runner() -> None:
    summary = PrefixSummary(runner_id="run-b", node_id=THERE, model="tiny-llm", block_chars=256,
                            blocks=[f"{b:016x}" for b in (1, 2, 3)], in_flight=1, slots=4, at=T0)
    seen = remote_runner(summary)
    assert seen.held.matched((1, 2, 3, 4)) == 3 and seen.slots == 4 and seen.in_flight == 1
