"""Which trace `fleet trace ID` shows: a task's, or that of a gateway request with n > 1
choices (whose id names no task: its choices `<id>-0`… share the request's trace)."""

from __future__ import annotations

from nats.aio.client import Client

from fleet.bus.task_log import TaskLog
from fleet.trace.lookup import trace_id_of_request
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskAccepted

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER = "0af7651916cd43dd8448eb211c80319c"


async def accepted(nc: Client, task_id: str, trace_id: str) -> None:
    event = TaskAccepted(task_id=task_id, at=1.0, model="tiny-llm", node_id="n", runner_id="r",
                         trace_id=trace_id)
    await nc.jetstream().publish(subjects.out(task_id), encode(event))


async def test_a_task_id_names_its_own_trace(provisioned_nc: Client) -> None:
    await accepted(provisioned_nc, "solo-1", TRACE)
    await accepted(provisioned_nc, "solo-1-0", OTHER)  # another task, not a choice of it
    assert await trace_id_of_request(TaskLog(provisioned_nc), "solo-1") == TRACE


async def test_a_request_with_choices_is_traced_through_its_first_choice(
    provisioned_nc: Client,
) -> None:
    for index in range(3):
        await accepted(provisioned_nc, f"chatcmpl-n3-{index}", TRACE)
    assert await trace_id_of_request(TaskLog(provisioned_nc), "chatcmpl-n3") == TRACE


async def test_an_unknown_id_has_no_trace(provisioned_nc: Client) -> None:
    assert await trace_id_of_request(TaskLog(provisioned_nc), "nobody") is None
