"""Fair tenants among tasks published straight on NATS (fleet.worker.lanes), against
nats-server and one `fleet worker` (fault engine, a runner of 2 slots): tenant A keeps 10x
tenant B's tasks going, both weigh 1. Published on the class's shared subject they are served
first come, first served (B gets about 1/11 of the tokens); published on their tenant lanes,
B gets about half, once A's head start is served."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from fleet.bus.connect import js_publish
from fleet.bus.fairness import shares
from fleet.bus.roles import FAIRNESS
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event, decode_events
from fleet.wire.events import TaskAccepted, TaskFinished, TokenChunk, token_indexes
from fleet.wire.fairness import TenantShare
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import place_on
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    client,
    events_of,
    fault_worker_stack,
    finished,
    serving,
    until_queue_empty,
    wait_node,
)
from tests.integration.killing import fault_workers

pytestmark = pytest.mark.timeout(300)

MODEL = "fault-llm"
TOKENS = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WorkerProcess]]:
    root = tmp_path_factory.mktemp("lanes")
    with fault_worker_stack(root, MODEL) as (url, worker):
        yield url, worker


class Terminals:
    """Each task's terminal, as the worker writes it on `fleet.out.<id>` (core NATS)."""

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Future[TaskFinished]] = {}
        self.nodes: set[str | None] = set()  # the nodes that ended them

    async def on_msg(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except DecodeError:
            return
        if not isinstance(event, TaskFinished):
            return
        self.nodes.add(event.node_id)
        if (done := self.waiting.pop(event.task_id, None)) is not None and not done.done():
            done.set_result(event)


async def b_share(nc: Client, terminals: Terminals, on_lanes: bool, run: str,
                  b_clients: int = 2) -> dict[str, int]:
    """A keeps 20 tasks going, B `b_clients`; the tokens each was served between B's 3rd and
    15th task (A's head start served by then)."""
    served = {"a": 0, "b": 0}
    marks: dict[str, dict[str, int]] = {}
    done, stop = asyncio.Event(), asyncio.Event()
    ids = itertools.count()

    async def tenant_client(tenant: str) -> None:
        subject = (subjects.lane(MODEL, "default", f"{run}-{tenant}") if on_lanes
                   else subjects.tasks(MODEL))
        while not stop.is_set():
            task = TextGeneration(
                task_id=f"{run}-{tenant}-{next(ids)}", model=MODEL, tenant=f"{run}-{tenant}",
                max_tokens=TOKENS, messages=[ChatMessage(
                    role="user", content=f"tokens:{TOKENS} tokens_per_s:200")])
            ended = terminals.waiting[task.task_id] = asyncio.get_running_loop().create_future()
            await js_publish(nc.jetstream(), subject, task, msg_id=task.task_id)
            result = await asyncio.wait_for(ended, 120)
            assert result.status == "completed" and result.usage is not None, result
            served[tenant] += result.usage.completion_tokens
            if served["b"] >= TOKENS * 3:
                marks.setdefault("from", dict(served))
            if served["b"] >= TOKENS * 15:
                marks.setdefault("to", dict(served))
                done.set()

    clients = [asyncio.ensure_future(tenant_client("a")) for _ in range(20)]
    clients += [asyncio.ensure_future(tenant_client("b")) for _ in range(b_clients)]
    try:
        await asyncio.wait_for(done.wait(), 200)
    except TimeoutError:
        errors = [c.exception() for c in clients if c.done() and c.exception()]
        pytest.fail(f"B was not served its 15 tasks: {served} {errors[:2]}")
    finally:
        stop.set()
        # every task ends: one left without a terminal fails the run here
        await asyncio.wait_for(asyncio.gather(*clients), 120)
    await until_queue_empty(nc.jetstream(), 60)  # nothing of this run left for the next
    return {t: marks["to"][t] - marks["from"][t] for t in served}


async def test_a_tenant_flooding_on_nats_leaves_the_other_lane_its_share(
    stack: tuple[str, WorkerProcess],
) -> None:
    url, worker = stack
    nc, _ = await serving(url, worker, add_fault_card(worker.data_dir, MODEL), slots=2)
    terminals = Terminals()
    await nc.subscribe("fleet.out.>", cb=terminals.on_msg)
    # Lanes first: the shared run's tasks are charged to A too (a head start of thousands
    # of tokens, which the lanes would rightly give B back first).
    began = time.monotonic()
    lanes = await b_share(nc, terminals, on_lanes=True, run="lanes")
    middle = time.monotonic()
    shared = await b_share(nc, terminals, on_lanes=False, run="shared")
    print(f"lanes run {middle - began:.1f} s, shared run {time.monotonic() - middle:.1f} s")
    print(f"B's share of tokens: shared subject {shares(shared)['b']:.2f} {shared}, "
          f"lanes {shares(lanes)['b']:.2f} {lanes}")
    assert shares(shared)["b"] < 0.25, shared  # first come, first served
    assert 0.35 < shares(lanes)["b"] < 0.65, lanes
    await nc.close()


async def test_lanes_share_by_weight_across_two_workers(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """Two workers of one slot each pull the same lanes: B weighs 3 (its entry, as a gateway
    writes it from B's tenant record), A 1, and B keeps 4 tasks going against A's 20: B's
    share of the tokens is near 3/4, whichever worker served them."""
    nc = await client(nats_url)
    kv = await nc.jetstream().key_value(FAIRNESS)
    await kv.put(f"{MODEL}.default.w-b", TenantShare(counter=0, waiting=0, at=0, weight=3)
                 .model_dump_json().encode())
    for name in ("w1", "w2"):
        worker = start_worker(name)
        await place_on(nc, add_fault_card(worker.data_dir, MODEL),
                       await wait_node(nc, worker.data_dir), slots=1)
    terminals = Terminals()
    await nc.subscribe("fleet.out.>", cb=terminals.on_msg)
    window = await b_share(nc, terminals, on_lanes=True, run="w", b_clients=4)
    print(f"two workers, B weighs 3: B's share {shares(window)['b']:.2f} {window}")
    assert 0.62 < shares(window)["b"] < 0.88, window
    assert len(terminals.nodes) == 2  # both workers served (each one slot)
    await nc.close()


async def test_a_lane_task_whose_worker_dies_mid_answer_is_continued_and_charged_once(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """A lane's task is a task like any other: its worker SIGKILLed after its third token,
    the redelivery (from the lane's durable) is continued on the second worker from the next
    token, ends once, and is charged once to the lane's tenant."""
    nc = await client(nats_url)
    start = fault_workers(nc, start_worker, FLEET_ACK_WAIT_S="2")
    first, _ = await start("a")
    task = TextGeneration(task_id="lane-continued", model=MODEL, tenant="cont", max_tokens=40,
                          messages=[ChatMessage(role="user",
                                                content="tokens:12 tokens_per_s:10")])
    reached = asyncio.Event()

    async def watch(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            if isinstance(event, TokenChunk) and event.next_index > 3:
                reached.set()

    watcher = await nc.subscribe(subjects.out(task.task_id), cb=watch)
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await js_publish(nc.jetstream(), subjects.lane(MODEL, "default", "cont"), task,
                     msg_id=task.task_id)
    await asyncio.wait_for(reached.wait(), 60)
    await watcher.unsubscribe()
    first.kill()
    await start("b")
    events = await collector
    result = finished(events)
    assert result.status == "completed" and result.usage is not None
    assert token_indexes([e for e in events if isinstance(e, TokenChunk)]) == list(range(12))
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert accepted[0].continued_from == 0 and accepted[-1].continued_from > 0  # continued
    await until_queue_empty(nc.jetstream(), 60)
    kv = await nc.jetstream().key_value(FAIRNESS)
    # The mark goes by a write after the ack is confirmed, so after the queue is empty:
    # watched until it has gone (or the wait ends, and the assert says what was left).
    entry = await _settled_entry(kv, f"{MODEL}.default.cont", 30)
    assert (entry.counter, entry.settled) == (
        result.usage.prompt_tokens + result.usage.completion_tokens, [])
    await nc.close()


async def _settled_entry(kv: KeyValue, key: str, timeout: float) -> TenantShare:
    """The entry once its `settled` marks are gone, or as it is when `timeout` passes."""
    watcher = await kv.watch(key)
    entry = TenantShare(counter=0, waiting=0, at=0)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                update = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                break
            if update is not None and update.value:
                entry = TenantShare.model_validate_json(update.value)
                if not entry.settled:
                    break
    finally:
        await watcher.stop()
    return entry
