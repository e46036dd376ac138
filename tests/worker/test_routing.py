"""Prefix-aware routing: block hashes of prompts, and the pure choice of a runner (tables)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.runners import RunnerReady
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.node import spare_cores
from fleet.worker.plan import Dispatch, Pull, plan
from fleet.worker.prefix_blocks import BLOCK_CHARS, block_hashes, prompt_blocks
from fleet.worker.routing import Candidate, PrefixHeld, Wait, Weights, choose, choose_runner
from fleet.worker.state import (
    CoresSampled,
    FirstOutput,
    PendingTask,
    RunnerView,
    TaskDispatched,
    TaskEnded,
    TaskQueued,
    WorkerState,
)
from fleet.worker.state import apply as step

SYSTEM = "You are a careful assistant. " * 40  # ~1,100 characters: four blocks


def chat(*turns: tuple[str, str], task_id: str = "t") -> TextGeneration:
    messages = [ChatMessage(role=role, content=text) for role, text in turns]  # type: ignore[arg-type]
    return TextGeneration(task_id=task_id, model="tiny-llm", messages=messages)


def test_a_next_turn_extends_the_previous_turns_blocks() -> None:
    first = prompt_blocks(chat(("system", SYSTEM), ("user", "hello " * 60)))
    second = prompt_blocks(chat(
        ("system", SYSTEM), ("user", "hello " * 60), ("assistant", "hi " * 50),
        ("user", "and then? " * 30),
    ))
    assert len(first) >= 4 and len(second) > len(first)
    assert second[:len(first)] == first  # every whole block of the earlier prompt


def test_equal_blocks_after_a_difference_do_not_match() -> None:
    """Hashes are chained: the same text after a different prefix is a different block."""
    a = block_hashes(b"x" * BLOCK_CHARS + b"y" * BLOCK_CHARS)
    b = block_hashes(b"z" * BLOCK_CHARS + b"y" * BLOCK_CHARS)
    assert a[0] != b[0] and a[1] != b[1]
    assert block_hashes(b"short") == ()


def test_other_system_prompts_share_no_blocks() -> None:
    one = prompt_blocks(chat(("system", SYSTEM), ("user", "q")))
    other = prompt_blocks(chat(("system", SYSTEM.upper()), ("user", "q")))
    assert not set(one) & set(other)


def held(*blocks: int) -> PrefixHeld:
    return PrefixHeld().served(blocks, capacity=100)


PROMPT = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)


@pytest.mark.parametrize(
    ("blocks", "candidates", "chosen"),
    [
        # nothing cached anywhere: the least loaded, then most free slots, then the id
        (PROMPT, [Candidate("a", 4, 0), Candidate("b", 4, 0)], "a"),
        (PROMPT, [Candidate("a", 3, 1), Candidate("b", 4, 0)], "b"),
        # a returning conversation goes home
        (PROMPT, [Candidate("a", 4, 0), Candidate("b", 4, 0, held(1, 2, 3, 4, 5, 6))], "b"),
        # the longest prefix wins, not the most blocks in common
        (PROMPT, [Candidate("a", 4, 0, held(1, 2, 3)),
                  Candidate("b", 4, 0, held(1, 2, 4, 5, 6, 7, 8))], "a"),
        # home is busier, but the prefill it saves (9 blocks) beats 1 task decoding (0.5)
        (PROMPT, [Candidate("a", 4, 0), Candidate("b", 3, 1, held(*PROMPT[:9]))], "b"),
        # home decodes three tasks: a returning conversation still goes home (1 + 1.5 < 10)
        (PROMPT, [Candidate("a", 4, 0), Candidate("b", 1, 3, held(*PROMPT[:9]))], "b"),
        # home has more prefill queued (12 blocks) than it saves: the hot prefix spills over
        (PROMPT, [Candidate("a", 4, 0),
                  Candidate("b", 1, 3, held(*PROMPT[:9]), prefill_blocks=12, prefilling=3)],
         "a"),
        # queued prefill counts whoever it belongs to: the emptier queue wins while a has
        # a core to spare for the 5 blocks b would not need ...
        (PROMPT, [Candidate("a", 4, 0, prefill_blocks=3, prefilling=0),
                  Candidate("b", 3, 1, held(*PROMPT[:5]), prefill_blocks=9, prefilling=1)],
         "a"),
        # ... but with a busy too, those 5 blocks delay a's own task as well: b (5 + 9 < 10
        # + 3 + 2 x 5)
        (PROMPT, [Candidate("a", 3, 1, prefill_blocks=3, prefilling=1),
                  Candidate("b", 3, 1, held(*PROMPT[:5]), prefill_blocks=9, prefilling=1)],
         "b"),
        # a idle, but its node has no core to spare (neighbours): the same as busy
        (PROMPT, [Candidate("a", 4, 0, spare_core=False),
                  Candidate("b", 3, 1, held(*PROMPT[:5]), prefill_blocks=9, prefilling=1)],
         "b"),
        # home has no free slot: never wait for it while another runner is free
        (PROMPT, [Candidate("a", 4, 0), Candidate("b", 0, 4, held(*PROMPT))], "a"),
        # no free slot anywhere: nothing is dispatched
        (PROMPT, [Candidate("a", 0, 4), Candidate("b", 0, 4, held(*PROMPT))], None),
        # a prompt shorter than a block routes by load alone
        ((), [Candidate("a", 2, 2, held(1)), Candidate("b", 4, 0)], "b"),
        ((), [], None),
    ],
)
def test_choose_runner(
    blocks: tuple[int, ...], candidates: list[Candidate], chosen: str | None,
) -> None:
    assert choose_runner(blocks, candidates) == chosen


def test_without_prefix_routing_the_most_free_slots_win() -> None:
    candidates = [Candidate("a", 3, 1, held(*PROMPT)), Candidate("b", 4, 0)]
    assert choose_runner(PROMPT, candidates, Weights(prefix=False)) == "b"
    assert choose_runner(PROMPT, candidates) == "a"


def test_held_blocks_are_lru_by_blocks() -> None:
    h = PrefixHeld().served((1, 2, 3), capacity=4)
    assert h.order == (3, 2, 1)  # a prompt's end is evicted before its start
    h = h.served((4, 5), capacity=4)
    assert h.order == (2, 1, 5, 4) and h.matched((1, 2, 3)) == 2
    h = h.served((1, 2), capacity=4)  # used again: most recent now
    assert h.order == (5, 4, 2, 1)
    assert h.served((6, 7), capacity=4).matched((1, 2)) == 2  # 4 and 5 went first


def test_the_plan_sends_a_returning_conversation_home() -> None:
    """Through WorkerState: a dispatch records the prompt's blocks on its runner, and the
    next turn of that conversation is dispatched to the same runner."""
    def queued(state: WorkerState, task: TextGeneration) -> WorkerState:
        return step(state, TaskQueued(PendingTask(
            task=task, received_at=0.0, inputs={}, blocks=prompt_blocks(task),
        )))

    runners = {
        rid: RunnerView(rid, f"i-{rid}", "tiny-llm", status=RunnerReady(), slots=4)
        for rid in ("run-a", "run-b")
    }
    instances = {
        f"i-{rid}": Instance(
            instance_id=f"i-{rid}", model="tiny-llm", slots=4, created_at=0.0,
            shards=[ShardAssignment(node_id="n", runner_id=rid)],
        )
        for rid in runners
    }
    state = WorkerState(node_id="n", runners=runners, instances=instances)
    turns = [("system", SYSTEM), ("user", "tell me about ships " * 20)]
    state = queued(state, chat(*turns, task_id="turn-1"))
    action = plan(state, 0.0)
    assert isinstance(action, Dispatch)
    home = action.runner_id
    state = step(state, TaskDispatched("turn-1", home))
    assert state.runners[home].held.known  # the index learnt what it sent there
    assert state.runners[home].prefill_blocks == len(prompt_blocks(chat(*turns)))
    state = step(state, FirstOutput("turn-1", home))  # prefilled: it decodes now
    assert state.runners[home].prefill_blocks == 0
    # Home now has a task in flight, the other runner none: the next turn still goes home.
    turns += [("assistant", "ships float " * 20), ("user", "and boats? " * 20)]
    state = queued(state, chat(*turns, task_id="turn-2"))
    assert plan(state, 0.0) == Dispatch("turn-2", home)


SYSTEM_BLOCKS = (1, 2, 3, 4, 5, 6, 7)
NEXT = (*SYSTEM_BLOCKS, 8)  # the same system prompt, another question


def prefilling(runner_id: str, queued: int = 7, free: int = 3) -> Candidate:
    """A runner that has just been sent SYSTEM_BLOCKS and has not answered yet."""
    return Candidate(runner_id, free, 1, held(*SYSTEM_BLOCKS), prefill_blocks=queued,
                     prefilling=1, warming=frozenset(SYSTEM_BLOCKS))


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        # its prefix is being prefilled on b: wait for it (1 + 7) rather than prefill it
        # again on idle a (8 + 7 for the duplicate work)
        ([Candidate("a", 4, 0), prefilling("b")], Wait("b")),
        # one runner: still better to wait than to prefill the same blocks beside it
        ([prefilling("b")], Wait("b")),
        # b has far more queued than the duplicate costs: go to a now
        ([Candidate("a", 4, 0), prefilling("b", queued=30)], "a"),
        # b holds the prefix for real (no prefill on): go there now
        ([Candidate("a", 4, 0), Candidate("b", 3, 1, held(*SYSTEM_BLOCKS))], "b"),
        # b has no free slot: nothing to wait for there; a now
        ([Candidate("a", 4, 0), prefilling("b", free=0)], "a"),
    ],
)
def test_a_prefix_being_prefilled_is_waited_for(
    candidates: list[Candidate], chosen: object,
) -> None:
    best = choose(NEXT, candidates)
    assert (best.runner_id if isinstance(best, Candidate) else best) == chosen


def test_the_plan_holds_a_task_until_its_prefix_is_prefilled() -> None:
    """Through WorkerState: the second conversation on a system prompt waits while the first
    one's prefill runs, then goes to that runner and finds it cached."""
    runners = {
        rid: RunnerView(rid, f"i-{rid}", "tiny-llm", status=RunnerReady(), slots=4)
        for rid in ("run-a", "run-b")
    }
    instances = {
        f"i-{rid}": Instance(
            instance_id=f"i-{rid}", model="tiny-llm", slots=4, created_at=0.0,
            shards=[ShardAssignment(node_id="n", runner_id=rid)],
        )
        for rid in runners
    }
    state = WorkerState(node_id="n", runners=runners, instances=instances)

    def queued(state: WorkerState, task: TextGeneration) -> WorkerState:
        return step(state, TaskQueued(PendingTask(
            task=task, received_at=0.0, inputs={}, blocks=prompt_blocks(task),
        )))

    state = queued(state, chat(("system", SYSTEM), ("user", "first " * 30), task_id="c1"))
    first = plan(state, 0.0)
    assert isinstance(first, Dispatch)
    state = step(state, TaskDispatched("c1", first.runner_id))
    state = queued(state, chat(("system", SYSTEM), ("user", "second " * 30), task_id="c2"))
    assert not isinstance(plan(state, 0.0), Dispatch)  # it waits (a pull may be planned)
    state = step(state, FirstOutput("c1", first.runner_id))
    assert plan(state, 0.0) == Dispatch("c2", first.runner_id)


def full(runner_id: str, *blocks: int, queued: int = 0) -> Candidate:
    """A runner with every slot taken (four tasks decoding), holding `blocks`."""
    return Candidate(runner_id, 0, 4, held(*blocks), prefill_blocks=queued,
                     prefilling=1 if queued else 0)


def busy(runner_id: str, *blocks: int) -> Candidate:
    return Candidate(runner_id, 2, 2, held(*blocks))


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        # every runner busy: wait for the full home's next slot (0 + 2 decoding + 2 for the
        # slot) rather than prefill the whole prompt beside a's tasks (10 + 1 + 3 x 10 extra:
        # for this task and a's two)
        ([busy("a"), full("b", *PROMPT)], Wait("b")),
        # the same on a node with no core to spare, even with a idle
        ([Candidate("a", 4, 0, spare_core=False), full("b", *PROMPT)], Wait("b")),
        # a is idle with a core to spare: it takes the task now (never idle while work waits)
        ([Candidate("a", 4, 0), full("b", *PROMPT)], "a"),
        # home holds only 2 of 10 blocks: the wait saves too little
        ([busy("a"), full("b", 1, 2, queued=8)], "a"),
        # tasks already waiting for home (40 blocks of theirs): prefill elsewhere is cheaper
        ([busy("a"), replace(full("b", *PROMPT), waiting_blocks=40)], "a"),
        # a full runner on another node is never waited for: its node would decline
        ([busy("a"), replace(full("b", *PROMPT), node_id="elsewhere")], "a"),
    ],
)
def test_a_saturated_fleet_waits_for_the_runner_that_holds_the_prefix(
    candidates: list[Candidate], chosen: object,
) -> None:
    best = choose(PROMPT, candidates)
    assert (best.runner_id if isinstance(best, Candidate) else best) == chosen


def warming(runner_id: str, *blocks: int, free: int = 3) -> Candidate:
    """A runner holding PROMPT's first three blocks, prefilling `blocks` for a task now."""
    return Candidate(runner_id, free, 1, held(1, 2, 3, *blocks), prefill_blocks=len(blocks),
                     prefilling=1, warming=frozenset(blocks))


@pytest.mark.parametrize(
    ("blocks", "candidate", "weights", "chosen"),
    [
        # a sole candidate with a free slot is chosen whatever it costs ...
        ((), Candidate("a", 1, 3, prefill_blocks=50, prefilling=3), Weights(), "a"),
        (PROMPT, Candidate("a", 1, 3, held(1, 2), spare_core=False), Weights(), "a"),
        (PROMPT, Candidate("a", 2, 2, node_id="elsewhere"), Weights(), "a"),
        (PROMPT, warming("a", 50, 51), Weights(), "a"),  # its prefill is of other blocks
        (PROMPT, warming("a", 9, 10), Weights(), "a"),  # after the prefix it holds: no help
        ((), warming("a", 4, 5), Weights(), "a"),  # a prompt of no block waits for none
        # ... but when its prefill in progress holds more of the prompt, waiting may be
        # cheaper (the wait is weighed, as among several)
        (PROMPT, warming("a", 4, 5), Weights(), Wait("a")),
        (PROMPT, replace(warming("a", 4, 5), waiting_blocks=20), Weights(), "a"),
        # without a free slot: a runner here is waited for, however long; another's never
        ((), Candidate("a", 0, 4), Weights(), Wait("a")),
        (PROMPT, Candidate("a", 0, 4, held(*PROMPT), waiting_blocks=1e6), Weights(), Wait("a")),
        (PROMPT, Candidate("a", 0, 4, node_id="elsewhere"), Weights(), None),
        # without prefix routing: a free slot here, never another node's, never a wait
        (PROMPT, Candidate("a", 2, 2, held(*PROMPT)), Weights(prefix=False), "a"),
        (PROMPT, Candidate("a", 2, 2, node_id="elsewhere"), Weights(prefix=False), None),
        (PROMPT, Candidate("a", 0, 4, held(*PROMPT)), Weights(prefix=False), None),
    ],
)
def test_a_sole_candidate(
    blocks: tuple[int, ...], candidate: Candidate, weights: Weights, chosen: object,
) -> None:
    best = choose(blocks, [candidate], weights)
    assert (best.runner_id if isinstance(best, Candidate) else best) == chosen
    if isinstance(best, Candidate):
        assert best is candidate


def two_runners(*, spare: float, slots: int = 2) -> WorkerState:
    runners = {
        rid: RunnerView(rid, f"i-{rid}", "tiny-llm", status=RunnerReady(), slots=slots)
        for rid in ("run-a", "run-b")
    }
    instances = {
        f"i-{rid}": Instance(
            instance_id=f"i-{rid}", model="tiny-llm", slots=slots, created_at=0.0,
            shards=[ShardAssignment(node_id="n", runner_id=rid)],
        )
        for rid in runners
    }
    return step(WorkerState(node_id="n", runners=runners, instances=instances),
                CoresSampled(spare))


def queue(state: WorkerState, task: TextGeneration, at: float = 0.0) -> WorkerState:
    return step(state, TaskQueued(PendingTask(task=task, received_at=at, inputs={},
                                              blocks=prompt_blocks(task))))


def serving(state: WorkerState, task: TextGeneration, runner_id: str) -> WorkerState:
    """`task` sent to `runner_id`, prefilled there, decoding."""
    state = step(queue(state, task), TaskDispatched(task.task_id, runner_id))
    return step(state, FirstOutput(task.task_id, runner_id))


HISTORY = chat(("system", SYSTEM), ("user", "tell me about ships " * 20))
NEXT_TURN = chat(("system", SYSTEM), ("user", "tell me about ships " * 20),
                 ("assistant", "ships " * 10), ("user", "more? " * 20), task_id="c1-2")


def home_decoding_two(state: WorkerState) -> WorkerState:
    """run-a serves two turns of the conversation: with two slots, it is full."""
    for task_id in ("c1", "c2"):
        state = serving(state, HISTORY.model_copy(update={"task_id": task_id}), "run-a")
    return state


def test_the_plan_holds_a_returning_turn_for_its_full_home_and_pulls_for_the_other() -> None:
    """Through WorkerState, with no core to spare: home (run-a) is full, run-b is busy with
    one task and has a free slot. The returning turn waits for home; the free slot on run-b
    is still filled by a pull, and the tasks waiting here never outnumber the slots."""
    state = home_decoding_two(two_runners(spare=0.1))
    state = serving(state, chat(("system", SYSTEM.upper()), ("user", "q " * 300),
                                task_id="o1"), "run-b")
    state = queue(state, NEXT_TURN, at=1.0)
    # c1-2 waits for run-a, and run-b's free slot is pulled for all the same.
    assert plan(state, 1.0) == Pull("tiny-llm", 1, 1)
    state = step(state, TaskEnded("c1"))  # a slot of home frees: the turn goes home
    assert plan(state, 1.0) == Dispatch("c1-2", "run-a")


def test_an_idle_runner_with_a_core_to_spare_takes_the_turn_at_once() -> None:
    state = queue(home_decoding_two(two_runners(spare=1.5)), NEXT_TURN, at=1.0)
    assert plan(state, 1.0) == Dispatch("c1-2", "run-b")


def test_tasks_waiting_for_a_full_runner_never_outnumber_the_slots() -> None:
    """run-a is full and holds a long system prompt; run-b has one task and a free slot.
    Turns on that prompt wait for run-a, and run-b's free slot keeps being pulled for, until
    the tasks waiting here are as many as the slots (four): then nothing more is pulled."""
    system = SYSTEM * 3  # twelve blocks: waiting for run-a beats prefilling them on run-b
    state = two_runners(spare=0.0)
    for task_id, runner, prompt in (("x1", "run-a", system), ("x2", "run-a", system),
                                    ("y", "run-b", system.upper())):
        state = serving(state, chat(("system", prompt), ("user", "hi " * 100),
                                    task_id=task_id), runner)
    actions = []
    for n in range(4):
        actions.append(plan(state, 1.0))
        state = queue(state, chat(("system", system), ("user", f"{n} " * 150),
                                  task_id=f"w{n}"), at=1.0 + n)
    assert actions == [Pull("tiny-llm", 1, 1)] * 4
    assert plan(state, 1.0) is None  # four waiting, four slots: no more
    state = step(state, TaskEnded("x1"))
    assert plan(state, 1.0) == Dispatch("w0", "run-a")  # the oldest goes home first


@pytest.mark.parametrize(("busy_percent", "cores", "spare"),
                         [(25.0, 2, 1.5), (100.0, 2, 0.0), (0.0, 4, 4.0), (50.0, 1, 0.5)])
def test_spare_cores_are_the_idle_share_of_all_cores(
    busy_percent: float, cores: int, spare: float,
) -> None:
    assert spare_cores(busy_percent, cores) == spare


def test_tasks_with_nothing_to_prefill_still_queue_behind_each_other() -> None:
    """A hot prefix that run-a holds whole: waiting for run-a's slot costs a slot's turn per
    task already waiting, so a later task goes to run-b (which then holds it too) rather
    than every task piling onto run-a."""
    state = two_runners(spare=0.0)
    hot = chat(("system", SYSTEM), task_id="h")
    for task_id, runner, task in (("x1", "run-a", hot), ("x2", "run-a", hot),
                                  ("y", "run-b", chat(("system", SYSTEM.upper())))):
        state = serving(state, task.model_copy(update={"task_id": task_id}), runner)
    for n in range(6):
        state = queue(state, hot.model_copy(update={"task_id": f"h{n}"}), at=1.0 + n)
    # run-b would prefill the 4 blocks beside its own task (4 + 0.5 + 2 x 4 extra); run-a's
    # wait is 1 (two decoding) + 2 for a slot + 2 per task ahead: h0-h4 wait, h5 goes.
    assert plan(state, 2.0) == Dispatch("h5", "run-b")
