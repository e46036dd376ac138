"""A worker that dies: JetStream redelivers its task, and the task still ends exactly once.

These drive the fault-injection engine (a plumbing double): what is under test is the worker's
redelivery handling, not a model.
"""

from __future__ import annotations

from fleet.wire import subjects
from fleet.wire.events import ErrorReason, TaskAccepted, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import client, finished, until_queue_empty
from tests.integration.killing import accepted, fault_workers, kill_mid_task, tokens_past

FAST = {"FLEET_ACK_WAIT_S": "2"}  # the dead worker's task is redelivered 2 s on


def fault_task(task_id: str, knobs: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content=knobs)],
    )


async def test_worker_killed_before_output_lets_a_second_worker_complete_the_task(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    task = fault_task("survives", "tokens:3 delay_ms:4000")  # its first token 4 s away
    killed = await kill_mid_task(nc, task, fault_workers(nc, start_worker, **FAST), accepted)
    assert finished(killed.events).status == "completed"
    assert token_indexes(killed.events) == [0, 1, 2]  # never twice
    deliveries = [e.delivery for e in killed.events if isinstance(e, TaskAccepted)]
    assert deliveries[0] == 1 and deliveries[-1] >= 2
    await nc.close()


async def test_worker_killed_after_output_started_ends_the_task_worker_lost_past_its_limit(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    task = fault_task("half-done", "tokens:200 delay_ms:200").model_copy(
        update={"max_continuations": 0}
    )
    killed = await kill_mid_task(
        nc, task, fault_workers(nc, start_worker, **FAST), tokens_past(0)
    )
    result = finished(killed.events)
    assert result.status == "failed" and result.reason is ErrorReason.WORKER_LOST
    await nc.close()


async def test_worker_killed_after_output_started_is_continued_from_the_next_token(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    task = fault_task("continued", "tokens:12 delay_ms:300")
    killed = await kill_mid_task(
        nc, task, fault_workers(nc, start_worker, **FAST), tokens_past(0)
    )
    result = finished(killed.events)
    assert result.status == "completed" and result.usage is not None
    tokens = [e for e in killed.events if isinstance(e, TokenChunk)]
    assert token_indexes(tokens) == list(range(12))  # no index repeated, none missing
    assert "".join(t.text for t in tokens) == "".join(f" t{i}" for i in range(12))
    assert result.usage.completion_tokens == 12
    accepted_at = [e.continued_from for e in killed.events if isinstance(e, TaskAccepted)]
    assert accepted_at[0] == 0 and accepted_at[-1] > 0
    await nc.close()


async def test_a_task_past_max_deliver_is_dead_lettered_and_finished_failed(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    # The server checks MaxDeliver when it would redeliver, i.e. when the second worker pulls.
    workers = fault_workers(nc, start_worker, **FAST, FLEET_MAX_DELIVER="1")
    killed = await kill_mid_task(nc, fault_task("doomed", "tokens:3 delay_ms:5000"), workers,
                                 accepted)
    result = finished(killed.events)
    assert result.status == "failed" and result.reason is ErrorReason.MAX_DELIVERIES
    js = nc.jetstream()
    dead = await js.get_last_msg(subjects.DEAD_LETTERS_STREAM, subjects.dead_letter("fault-llm"))
    assert b'"task_id":"doomed"' in (dead.data or b"")
    await until_queue_empty(js)
    await nc.close()
