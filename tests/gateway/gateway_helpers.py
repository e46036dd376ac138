"""Test helpers for the gateway: a stand-in worker that answers tasks with scripted events."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client

from fleet.bus.connect import js_publish
from fleet.bus.provision import ensure_task_consumer
from fleet.wire import subjects
from fleet.wire.codec import decode_task
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk, Usage
from fleet.wire.tasks import Task

Script = Callable[[Task], list[OutputEvent]]


def tokens_script(*texts: str, finish: str = "stop") -> Script:
    def script(task: Task) -> list[OutputEvent]:
        events: list[OutputEvent] = [
            TaskAccepted(
                task_id=task.task_id, at=1.0, model=task.model, node_id="n1", runner_id="r1"
            )
        ]
        for index, text in enumerate(texts):
            events.append(
                TokenChunk(task_id=task.task_id, at=2.0, index=index, token_id=index, text=text)
            )
        usage = Usage(prompt_tokens=5, completion_tokens=len(texts), total_tokens=5 + len(texts))
        events.append(
            TaskFinished(
                task_id=task.task_id, at=3.0, status="completed", finish_reason=finish, usage=usage
            )
        )
        return events

    return script


class StandInWorker:
    """Takes tasks of one model from FLEET_TASKS and publishes scripted events for them."""

    def __init__(self, nc: Client, model: str) -> None:
        self.nc = nc
        self.model = model
        self.tasks: list[Task] = []
        self.headers: list[dict[str, str]] = []  # each task message's, in order

    async def answer(
        self, script: Script, timeout: float = 10.0, priority: str = "default"
    ) -> Task:
        await ensure_task_consumer(self.nc, self.model, priority=priority)
        js = self.nc.jetstream()
        sub = await js.pull_subscribe_bind(
            subjects.durable(self.model, priority), stream=subjects.TASKS_STREAM
        )
        [message] = await sub.fetch(1, timeout=timeout)
        task = decode_task(message.data)
        self.tasks.append(task)
        self.headers.append(dict(message.headers or {}))
        for event in script(task):
            await js_publish(js, subjects.out(task.task_id), event)
        await message.ack()
        await sub.unsubscribe()
        return task


def vision_card(data_dir: Path) -> None:
    """A custom card for a model that reads images (no built-in one does)."""
    folder = data_dir / "models" / "custom"
    folder.mkdir(parents=True, exist_ok=True)
    card = (
        '{"id": "tiny-vlm", "name": "test", "tasks": ["text_generation"], "family": "mlx_lm",'
        ' "source": "/nowhere", "capabilities": ["vision"]}'
    )
    (folder / "tiny-vlm.json").write_text(card)


def sse_blocks(body: str) -> list[dict[str, str]]:
    """Each server-sent event of a body as its fields (event, id, data)."""
    blocks = [block for block in body.strip().split("\n\n") if block]
    return [dict(line.split(": ", 1) for line in block.splitlines()) for block in blocks]
