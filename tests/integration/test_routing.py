"""Prefix-aware dispatch with two real tiny-llm runners (real worker, nats-server, mlx-lm)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.models.catalog import get_card
from fleet.placement_replicas import place_replicas
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import decode_event, decode_model, decode_task, encode
from fleet.wire.events import OutputEvent, TaskAccepted, token_indexes
from fleet.wire.handoff import HandOffAnswer, TaskHandOff
from fleet.wire.prefixes import PrefixSummary
from fleet.wire.tasks import CancelTask, ChatMessage, TextGeneration
from fleet.worker.prefix_blocks import prompt_blocks
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import runner_pid
from tests.integration.harness import (
    client,
    events_of,
    finished,
    run_task,
    submit,
    until_queue_empty,
    wait_node,
)

SYSTEMS = [f"You are assistant number {i}. Answer briefly and kindly. " * 12 for i in range(4)]


async def ready_runners(
    nc: Client, node_id: str, count: int, timeout: float = 120.0, slots: int = 2,
) -> set[str]:
    """Place `count` tiny-llm replicas on `node_id`; their runner ids once all are ready."""
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    await place_replicas(nc.jetstream(), get_card("tiny-llm"), count, node_id=node_id,
                         slots=slots)
    ready: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(ready) < count:
            entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            if entry is not None and entry.value:
                record = decode_model(RunnerRecord, entry.value)
                if (record.model == "tiny-llm" and record.node_id == node_id
                        and record.status.state == "ready"):
                    ready.add(record.runner_id)
    finally:
        await watcher.stop()
    return ready


def turn(conversation: int, messages: list[ChatMessage], n: int) -> TextGeneration:
    return TextGeneration(
        task_id=f"conv{conversation}-turn{n}", model="tiny-llm", max_tokens=4,
        temperature=0.0, messages=messages,
    )


def hot_turn(conversation: int, system: str) -> TextGeneration:
    """A first turn under a shared system prompt that keeps its slot a while: a spread test's
    tasks must fill both runners' slots, so that which runner takes the next one is decided by
    its free slot and the prefix it holds. Four-token answers ran the 32 tasks in half a
    second, and beside a CPU hog the spread was which runner process the scheduler ran in that
    half second (25/7 once; no routing decision among them was wrong)."""
    return TextGeneration(
        task_id=f"conv{conversation}-turn1", model="tiny-llm", max_tokens=160, temperature=0.0,
        logit_bias={t: -100.0 for t in range(3)},  # no early end-of-sequence
        messages=[ChatMessage(role="system", content=system),
                  ChatMessage(role="user", content=f"question {conversation}")],
    )


async def test_a_returning_conversation_lands_where_it_was_served(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    worker = start_worker("w1")
    nc = await client(nats_url)
    runners = await ready_runners(nc, await wait_node(nc, worker.data_dir), 2)
    chats = [
        [ChatMessage(role="system", content=system), ChatMessage(role="user", content="hi " * 40)]
        for system in SYSTEMS
    ]
    # First turns at once: two slots per runner, so they spread over both runners.
    firsts = await asyncio.gather(*(run_task(nc, turn(i, c, 1)) for i, c in enumerate(chats)))
    home = {i: finished(events).runner_id for i, events in enumerate(firsts)}
    assert set(home.values()) == runners
    # Second turns one by one: with every runner idle, only the prefix tells them apart.
    for i, messages in enumerate(chats):
        messages += [
            ChatMessage(role="assistant", content="hello"),
            ChatMessage(role="user", content="tell me more " * 10),
        ]
        result = finished(await run_task(nc, turn(i, messages, 2)))
        assert result.status == "completed"
        assert result.runner_id == home[i], f"conversation {i} left its runner"
        assert result.usage is not None and result.usage.cached_tokens > 0
    # The fleet sees the same: each runner's summary in FLEET_PREFIXES holds the blocks of
    # the conversations it served.
    served = {
        i: {f"{b:016x}" for b in prompt_blocks(turn(i, messages, 2))}
        for i, messages in enumerate(chats)
    }

    def holds_all(found: dict[str, PrefixSummary]) -> bool:
        return all(blocks & set(found[home[i]].blocks) for i, blocks in served.items())

    summaries = await advertised(nc, runners, until=holds_all)
    for i, blocks in served.items():
        assert blocks & set(summaries[home[i]].blocks), f"conversation {i} not advertised"
    await nc.close()


def with_load(whole: PrefixSummary | None, summary: PrefixSummary) -> PrefixSummary:
    """A runner's view as a worker merges it: a load update (no blocks) changes the load of
    its last whole summary (fleet/worker/prefix_adverts.py)."""
    if not summary.load_only:
        return summary
    if whole is None:
        return summary.model_copy(update={"load_only": False})
    return whole.model_copy(update={name: getattr(summary, name) for name in (
        "in_flight", "slots", "prefilling", "prefill_blocks", "spare_cores", "at")})


async def advertised(
    nc: Client, runners: set[str], until: Callable[[dict[str, PrefixSummary]], bool],
    timeout: float = 10.0,
) -> dict[str, PrefixSummary]:
    """Each runner's PrefixSummary once every one of `runners` has one with blocks and no
    task in flight and `until` holds of them; what was last seen if `timeout` passes first.
    The watcher's first values can be ones written mid-task (the worker writes a new one
    within a quarter second of a change), and a settled load update can still carry blocks
    of a whole summary from before the last task: a whole one goes at most once a second
    (prefix_adverts.BLOCKS_EVERY_S), so a loaded run saw a settled summary one task behind."""
    kv = await nc.jetstream().key_value(subjects.PREFIXES_BUCKET)
    watcher = await kv.watchall()
    found: dict[str, PrefixSummary] = {}

    def done() -> bool:
        return (set(found) >= runners and all(settled(found[r]) for r in runners)
                and until(found))

    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not done():
                    entry = await watcher.updates(timeout=timeout)
                    if entry is not None and entry.value:
                        summary = decode_model(PrefixSummary, entry.value)
                        runner = summary.runner_id
                        found[runner] = with_load(found.get(runner), summary)
    finally:
        await watcher.stop()
    return found


def settled(summary: PrefixSummary) -> bool:
    return bool(summary.blocks) and summary.in_flight == 0 and summary.prefilling == 0


async def test_one_hot_prefix_spreads_over_both_runners(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    worker = start_worker("w1")
    nc = await client(nats_url)
    runners = await ready_runners(nc, await wait_node(nc, worker.data_dir), 2)
    tasks = [hot_turn(i, SYSTEMS[0]) for i in range(32)]
    results = [finished(e) for e in await asyncio.gather(*(run_task(nc, t) for t in tasks))]
    assert all(r.status == "completed" for r in results)
    spread = Counter(r.runner_id for r in results)
    assert set(spread) == runners and min(spread.values()) >= 8, spread
    await nc.close()


async def test_tasks_held_by_a_killed_worker_complete_elsewhere_once(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """Routing hands a task to a runner only inside the worker that holds its message, so a
    SIGKILLed worker's tasks are redelivered after AckWait and end once on the survivor."""
    env = {"FLEET_ACK_WAIT_S": "2", "OPENBLAS_NUM_THREADS": "1"}
    doomed, survivor = start_worker("a", **env), start_worker("b", **env)
    nc = await client(nats_url)
    doomed_node = await wait_node(nc, doomed.data_dir)
    survivor_node = await wait_node(nc, survivor.data_dir)
    await ready_runners(nc, doomed_node, 2)
    await ready_runners(nc, survivor_node, 1)
    tasks = [
        TextGeneration(
            task_id=f"held-{i}", model="tiny-llm", max_tokens=400, temperature=0.0,
            logit_bias={t: -100.0 for t in range(3)},  # no early end-of-sequence
            messages=[ChatMessage(role="system", content=SYSTEMS[i % 2]),
                      ChatMessage(role="user", content=f"go on {i}")],
        )
        for i in range(8)
    ]
    collectors = [asyncio.create_task(events_of(nc, t.task_id, 180)) for t in tasks]
    on_doomed = asyncio.Event()

    async def watch(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted) and event.node_id == doomed_node:
            on_doomed.set()

    sub = await nc.subscribe(subjects.out("*"), cb=watch)
    for task in tasks:
        await submit(nc, task)
    await asyncio.wait_for(on_doomed.wait(), 60)  # the doomed node's runners hold tasks
    doomed.kill()
    await sub.unsubscribe()
    moved = 0
    for events in await asyncio.gather(*collectors):
        result = finished(events)  # exactly one terminal each
        assert result.status == "completed", result
        assert result.usage is not None and result.usage.completion_tokens == 400
        # A task may end on the doomed node before the kill lands (beside a CPU hog the kill
        # came after one had made its 400 tokens); every task it still held ends on the
        # survivor.
        assert result.node_id in (doomed_node, survivor_node), result
        held = any(isinstance(e, TaskAccepted) and e.node_id == doomed_node for e in events)
        moved += held and result.node_id == survivor_node
    assert moved >= 1
    await nc.close()


# ---- across nodes: two workers, one runner each, tasks passed by hand-off ---------------------

class HandOffs:
    """The hand-offs between workers as the bus carries them: every request on
    `fleet.handoff.<node>` and its answer (a test client sees both), by task id."""

    def __init__(self) -> None:
        self.asked: dict[str, tuple[str, str]] = {}  # reply subject -> (node, task id)
        self.taken: dict[str, str] = {}  # task id -> node it was taken by
        self.changed = asyncio.Event()

    async def watch(self, nc: Client) -> None:
        await nc.subscribe("fleet.handoff.*", cb=self._asked)
        await nc.subscribe("_INBOX.>", cb=self._answered)
        await nc.flush()

    async def _asked(self, msg: Msg) -> None:
        offer = decode_model(TaskHandOff, msg.data)
        task_id = decode_task(offer.data.encode()).task_id
        self.asked[msg.reply] = (msg.subject.rsplit(".", 1)[-1], task_id)

    async def _answered(self, msg: Msg) -> None:
        if (asked := self.asked.get(msg.subject)) is None:
            return
        if decode_model(HandOffAnswer, msg.data).taken:
            node, task_id = asked
            self.taken[task_id] = node
            self.changed.set()


async def two_nodes(
    nats_url: str, start_worker: WorkerFactory, slots: int = 2, **env: str,
) -> tuple[Client, list[str], list[str]]:
    """Two workers (two nodes), one tiny-llm runner each: (client, node ids, runner ids)."""
    workers = [start_worker(name, OPENBLAS_NUM_THREADS="1", **env) for name in ("w1", "w2")]
    nc = await client(nats_url)
    nodes = [await wait_node(nc, w.data_dir) for w in workers]
    runners = [(await ready_runners(nc, node, 1, slots=slots)).pop() for node in nodes]
    return nc, nodes, runners


async def advertising(nc: Client, prompts: list[tuple[int, ...]], timeout: float = 15.0) -> None:
    """Until FLEET_PREFIXES, all runners together, holds every block of every prompt, and
    says every runner is idle (a summary follows its runner's load within a second)."""
    kv = await nc.jetstream().key_value(subjects.PREFIXES_BUCKET)
    watcher = await kv.watchall()
    wanted = {f"{b:016x}" for blocks in prompts for b in blocks}
    seen: dict[str, PrefixSummary] = {}

    def done() -> bool:
        held = {b for summary in seen.values() for b in summary.blocks}
        return wanted <= held and all(s.in_flight == 0 for s in seen.values())

    current = False  # the watch's current values are all in (its None marker came)
    try:
        async with asyncio.timeout(timeout):
            while not (current and done()):
                entry = await watcher.updates(timeout=timeout)
                if entry is None:
                    current = True
                elif entry.value:
                    summary = decode_model(PrefixSummary, entry.value)
                    seen[summary.runner_id] = with_load(seen.get(summary.runner_id), summary)
    finally:
        await watcher.stop()


async def test_a_returning_conversation_finds_its_runner_on_another_node(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """Whichever worker pulls a next turn, it reaches the runner that served the first one:
    when that runner is on the other node, the task is handed over."""
    nc, _, runners = await two_nodes(nats_url, start_worker)
    hand_offs = HandOffs()
    await hand_offs.watch(nc)
    chats = [  # twelve system prompts: nothing in common between conversations
        [ChatMessage(role="system", content=f"You are assistant number {i}. Be brief. " * 16),
         ChatMessage(role="user", content="hi " * 40)]
        for i in range(12)
    ]
    firsts = await asyncio.gather(*(run_task(nc, turn(i, c, 1)) for i, c in enumerate(chats)))
    home = {i: finished(events).runner_id for i, events in enumerate(firsts)}
    assert set(home.values()) == set(runners)
    await advertising(nc, [prompt_blocks(turn(i, c, 1)) for i, c in enumerate(chats)])
    # One at a time (every runner idle, the prefix decides), each runner's conversations
    # together: which worker's pull gets a message follows the order the pulls reached the
    # server, and that order tracks who ran the last task; in home order A,B,A,B it can put
    # every next turn on its home node, while a run of one home makes the other node pull.
    for i in sorted(home, key=lambda i: (home[i], i)):
        messages = chats[i]
        messages += [
            ChatMessage(role="assistant", content="hello"),
            ChatMessage(role="user", content="tell me more " * 10),
        ]
        await advertising(nc, [])  # the last turn's runner says it is idle again
        result = finished(await run_task(nc, turn(i, messages, 2)))
        assert result.status == "completed"
        assert result.runner_id == home[i], f"conversation {i} left its runner"
        assert result.usage is not None and result.usage.cached_tokens > 0
    # The pulls are shared, so some next turns were pulled on the other node and offered to
    # their home. (Whether an offer is taken, or declined and the task pulled again by its
    # home, depends on the load: beside a CPU hog 8 turns were offered and none taken, and
    # every one still ended on its home runner, as asserted above.)
    assert {t for _, t in hand_offs.asked.values() if t.endswith("-turn2")}, (
        f"no next turn was offered to its home (offers: {sorted(hand_offs.asked.values())})")
    # The receivers acked the messages handed to them (well inside AckWait, 30 s).
    await until_queue_empty(nc.jetstream(), timeout=10)
    await nc.close()


async def test_one_hot_prefix_spreads_over_runners_on_two_nodes(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    nc, _, runners = await two_nodes(nats_url, start_worker, slots=4)
    tasks = [hot_turn(i, SYSTEMS[0] * 2) for i in range(32)]
    results = [finished(e) for e in await asyncio.gather(*(run_task(nc, t) for t in tasks))]
    assert all(r.status == "completed" for r in results)
    spread = Counter(r.runner_id for r in results)
    assert set(spread) == set(runners) and min(spread.values()) >= 8, spread
    await nc.close()


async def test_tasks_handed_to_a_killed_worker_complete_elsewhere_once(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """A task handed over is held by the receiver alone: when it is SIGKILLed, AckWait hands
    the message to the survivor, which continues it, once."""
    env = {"FLEET_ACK_WAIT_S": "2", "OPENBLAS_NUM_THREADS": "1"}
    doomed = start_worker("doomed", **env)
    nc = await client(nats_url)
    doomed_node = await wait_node(nc, doomed.data_dir)
    home = (await ready_runners(nc, doomed_node, 1, slots=4)).pop()
    hot = SYSTEMS[0] * 3  # ~7 blocks: worth a hand-off while the home runner is idle

    def hot_task(task_id: str, max_tokens: int) -> TextGeneration:
        return TextGeneration(
            task_id=task_id, model="tiny-llm", max_tokens=max_tokens, temperature=0.0,
            logit_bias={t: -100.0 for t in range(3)},  # no early end-of-sequence
            messages=[ChatMessage(role="system", content=hot),
                      ChatMessage(role="user", content=f"go on {task_id}")],
        )

    warm = finished(await run_task(nc, hot_task("warm", 2)))
    assert warm.runner_id == home
    survivor = start_worker("survivor", **env)
    survivor_node = await wait_node(nc, survivor.data_dir)
    await ready_runners(nc, survivor_node, 1, slots=4)
    await advertising(nc, [prompt_blocks(hot_task("warm", 2))])
    # The doomed runner is held (stopped) while each task is published: the handed one is
    # still unread in its pipe when the node dies, however late this test gets to the kill
    # (300 tokens take tiny-llm under a second: beside a CPU hog, a handed task once ended on
    # the doomed node before the kill, and was never the survivor's to continue).
    collectors, handed = await hand_one_over(
        nc, doomed_node, lambda i: hot_task(f"hot-{i}", 300), hold=runner_pid(home))
    doomed.kill()
    more = [hot_task(f"more-{i}", 300) for i in range(4)]  # more on their way meanwhile
    for task in more:
        collectors[task.task_id] = asyncio.create_task(events_of(nc, task.task_id, 180))
        await submit(nc, task)
    for task_id, collector in collectors.items():
        events = await collector
        result = finished(events)  # exactly one terminal each
        assert result.status == "completed", (task_id, result)
        assert result.usage is not None and result.usage.completion_tokens == 300
        indexes = token_indexes(events)
        assert len(indexes) == len(set(indexes)), f"{task_id}: a token index twice"
    assert finished(await collectors[handed]).node_id == survivor_node
    await nc.close()


async def hand_one_over(
    nc: Client, home_node: str, make: Callable[[int], TextGeneration], hold: int | None = None,
) -> tuple[dict[str, asyncio.Task[list[OutputEvent]]], str]:
    """Publish tasks one at a time until the other worker pulls one and hands it to
    `home_node` (each pull is either worker's, so about every second task); each earlier one
    runs to its end first. The collectors of all of them, and the id of the handed one.

    `hold`: the pid of `home_node`'s runner, stopped (SIGSTOP) while each task is published
    and let go once the task is known not to be the handed one; the handed one is left
    unread in the stopped runner's pipe (its worker sent it and published task_accepted)."""
    hand_offs = HandOffs()
    await hand_offs.watch(nc)
    collectors: dict[str, asyncio.Task[list[OutputEvent]]] = {}
    for i in range(16):
        task = make(i)
        collectors[task.task_id] = asyncio.create_task(events_of(nc, task.task_id, 180))
        accepted = asyncio.create_task(first_accepted(nc, task.task_id))
        if hold is not None:
            os.kill(hold, signal.SIGSTOP)
        await submit(nc, task)
        where = (await asyncio.wait_for(accepted, 60)).node_id
        # Its offer is on the bus well before the task starts, so it has been seen by now.
        if where == home_node and (home_node, task.task_id) in hand_offs.asked.values():
            return collectors, task.task_id
        if hold is not None:
            os.kill(hold, signal.SIGCONT)
        await collectors[task.task_id]
    raise AssertionError("no task was handed over")


async def test_a_task_handed_over_is_cancelled_there_once(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """The receiver holds a handed-over message as its own: a cancel ends it once, and the
    message is acked (the queue empties well inside AckWait)."""
    home_worker = start_worker("home", OPENBLAS_NUM_THREADS="1")
    nc = await client(nats_url)
    home_node = await wait_node(nc, home_worker.data_dir)
    home = (await ready_runners(nc, home_node, 1, slots=4)).pop()
    hot = SYSTEMS[1] * 3

    def hot_task(task_id: str, max_tokens: int) -> TextGeneration:
        return TextGeneration(
            task_id=task_id, model="tiny-llm", max_tokens=max_tokens, temperature=0.0,
            logit_bias={t: -100.0 for t in range(3)},  # no early end-of-sequence
            messages=[ChatMessage(role="system", content=hot),
                      ChatMessage(role="user", content=f"go on {task_id}")],
        )

    assert finished(await run_task(nc, hot_task("warm", 2))).runner_id == home
    other = start_worker("other", OPENBLAS_NUM_THREADS="1")
    await ready_runners(nc, await wait_node(nc, other.data_dir), 1, slots=4)
    await advertising(nc, [prompt_blocks(hot_task("warm", 2))])
    collectors, handed = await hand_one_over(nc, home_node, lambda i: hot_task(f"c-{i}", 800))
    await nc.publish(subjects.cancel(handed), encode(CancelTask(task_id=handed)))
    result = finished(await collectors[handed])
    assert result.status == "cancelled" and result.node_id == home_node
    await until_queue_empty(nc.jetstream(), timeout=10)
    await nc.close()


async def first_accepted(nc: Client, task_id: str) -> TaskAccepted:
    """The task's first task_accepted, from FLEET_OUT."""
    found: asyncio.Future[TaskAccepted] = asyncio.get_running_loop().create_future()

    async def on_event(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted) and not found.done():
            found.set_result(event)

    sub = await nc.jetstream().subscribe(
        subjects.out(task_id), stream=subjects.OUT_STREAM, ordered_consumer=True, cb=on_event
    )
    try:
        return await found
    finally:
        await sub.unsubscribe()
