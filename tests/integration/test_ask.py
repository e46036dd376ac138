"""`nats req fleet.ask.<model>`: a real worker answers with the task's final answer, or with a
typed error. The asker is raw nats-py, as a NATS CLI user would be."""

from __future__ import annotations

import asyncio
import json

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.connect import js_publish
from fleet.models.catalog import get_card
from fleet.wire import subjects
from fleet.wire.ask import AskAnswer, AskError
from fleet.wire.codec import ASK_REPLY, decode_with
from fleet.wire.events import TokenChunk, token_indexes
from fleet.worker.asks import AskResponder
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import add_fault_card, events_of, serving


def reply_of(msg: Msg) -> AskAnswer | AskError:
    return decode_with(ASK_REPLY, msg.data)


async def test_an_ask_is_answered_with_the_text_its_task_stored(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc, _ = await serving(nats_url, worker, get_card("tiny-llm"))
    asker = await nats.connect(nats_url)
    task = {"task_id": "ask-1", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6, "temperature": 0.0}

    answer = reply_of(await asker.request("fleet.ask.tiny-llm", json.dumps(task).encode(),
                                          timeout=120))

    assert isinstance(answer, AskAnswer), answer
    assert (answer.task_id, answer.status, answer.finish_reason) == ("ask-1", "completed",
                                                                      "length")
    stored = await events_of(nc, "ask-1")
    tokens = [e for e in stored if isinstance(e, TokenChunk)]
    assert answer.text == "".join(t.text for t in tokens) and len(token_indexes(tokens)) == 6
    assert answer.usage is not None and answer.usage.completion_tokens == 6

    # Plain text is a question; the worker names the task.
    plain = reply_of(await asker.request("fleet.ask.tiny-llm", b"hello there", timeout=120))
    assert isinstance(plain, AskAnswer) and plain.status == "completed"
    assert plain.task_id.startswith("ask-") and plain.task_id != "ask-1"

    # The same id again is another message for a used id: refused by the worker's claim.
    again = await asker.request("fleet.ask.tiny-llm",
                                json.dumps({**task, "max_tokens": 2}).encode(), timeout=120)
    refused = reply_of(again)
    assert isinstance(refused, AskError) and refused.reason in ("task_id_taken", "task_id_used")
    assert again.headers is not None and again.headers["Nats-Service-Error-Code"] == "409"

    # Not a task: answered at once, named, and nothing is published.
    bad = reply_of(await asker.request("fleet.ask.tiny-llm", b'{"prompt": "x", "max_tokens": -1}',
                                       timeout=30))
    assert isinstance(bad, AskError) and bad.reason == "invalid_task"
    assert "max_tokens" in bad.message
    await asker.close()
    await nc.close()


async def test_an_ask_that_outlives_its_timeout_is_told_so_and_its_task_goes_on(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker("slow", FLEET_ASK_TIMEOUT_S="1")
    nc, _ = await serving(nats_url, worker, add_fault_card(worker.data_dir))
    asker = await nats.connect(nats_url)
    task = {"task_id": "slow-1",
            "messages": [{"role": "user", "content": "tokens:6 delay_ms:500"}]}

    late = await asker.request("fleet.ask.fault-llm", json.dumps(task).encode(), timeout=60)

    error = reply_of(late)
    assert isinstance(error, AskError) and error.reason == "timeout"
    assert error.task_id == "slow-1" and "fleet.out.slow-1" in error.message
    assert late.headers is not None and late.headers["Nats-Service-Error-Code"] == "504"
    ended = [e for e in await events_of(nc, "slow-1", timeout=60) if e.type == "task_finished"]
    assert [e.status for e in ended] == ["completed"]  # the task itself was not cut short
    await asker.close()
    await nc.close()


async def test_a_worker_that_stops_mid_ask_says_so_and_leaves_the_task_to_others(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker("leaving")
    nc, _ = await serving(nats_url, worker, add_fault_card(worker.data_dir))
    asker = await nats.connect(nats_url)
    accepted = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        if b"task_accepted" in msg.data:
            accepted.set()

    await asker.subscribe("fleet.out.stay-1", cb=on_event)
    task = {"task_id": "stay-1",
            "messages": [{"role": "user", "content": "tokens:40 delay_ms:200"}]}
    asking = asyncio.ensure_future(
        asker.request("fleet.ask.fault-llm", json.dumps(task).encode(), timeout=60)
    )
    await asyncio.wait_for(accepted.wait(), 30)
    await asyncio.to_thread(worker.stop)  # SIGTERM: a graceful stop

    error = reply_of(await asking)
    assert isinstance(error, AskError) and error.reason == "stopped"
    assert error.task_id == "stay-1" and "fleet.out.stay-1" in error.message
    await asker.close()
    await nc.close()


async def test_the_read_back_finds_every_stored_event_in_order(provisioned_nc: Client) -> None:
    """What an ask falls back to when its live copy has a gap: FLEET_OUT, by sequence."""
    js = provisioned_nc.jetstream()
    events = [TokenChunk(task_id="back-1", at=1.0, index=i, token_id=i, text=t)
              for i, t in enumerate(["a", "b", "c"])]
    for event in events:
        await js_publish(js, subjects.out("back-1"), event)
    await js_publish(js, subjects.out("other-1"), events[0].model_copy(
        update={"task_id": "other-1"}))
    responder = AskResponder(provisioned_nc, js, 5.0, owner=None)  # type: ignore[arg-type]
    assert await responder.stored_count("back-1") == 3
    assert await responder.stored_events("back-1") == events
    assert await responder.stored_count("never-1") == 0
