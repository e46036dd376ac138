"""`n` choices of one request: n tasks, one per choice, read as one stream.

Each choice is a task of its own (`<id>-0`, `<id>-1`, …), so the fleet spreads them over its
runners like any other tasks; a seeded request gives choice i the seed + i, so its choices
differ and each is still reproducible. The events of all choices are merged in arrival order;
the renderers find a choice by its task id.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from fleet.gateway.openai_base import InvalidParameter
from fleet.gateway.replies import failure
from fleet.gateway.streams import EventReader, Indexed, TaskEvents
from fleet.wire.events import TaskFinished
from fleet.wire.tasks import TextGeneration

SEED_MAX = 2**63 - 1  # the gateway's own bound for a seed


def choice_tasks(task: TextGeneration, n: int) -> list[TextGeneration]:
    """The task itself for n = 1, else one task per choice; choice 0 keeps the seed, so it
    draws what the same request with n = 1 draws."""
    if n == 1:
        return [task]
    return [
        task.model_copy(update={"task_id": f"{task.task_id}-{index}",
                                "seed": _choice_seed(task.seed, index)})
        for index in range(n)
    ]


def _choice_seed(seed: int | None, index: int) -> int | None:
    if seed is None:
        return None
    return seed + index if seed + index <= SEED_MAX else seed - index


def refuse_resumable_choices(n: int, resumable: bool) -> None:
    if n > 1 and resumable:
        raise InvalidParameter(
            "n: a resumable stream carries one choice (ask with n = 1, or without resumable "
            "and resume each choice's task from /v1/tasks/<id>-<index>/events)", "n",
        )


class ChoiceEvents(EventReader):
    """The events of several tasks as one iterator, like TaskEvents for one.

    It ends when every task has finished, or just after a task that failed (one failed choice
    fails the request; the caller cancels the rest, listed by `unfinished`). `finished` is that
    failure, or the last terminal event once all completed; None before.
    """

    def __init__(self, parts: Sequence[TaskEvents]) -> None:
        """`parts`: opened, one per choice, in choice order."""
        self.parts = list(parts)
        self.finished: TaskFinished | None = None
        self._done: set[str] = set()
        self._arrived: asyncio.Queue[Indexed | BaseException] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(part)) for part in self.parts]

    async def _pump(self, part: TaskEvents) -> None:
        try:
            async for item in part:
                self._arrived.put_nowait(item)
        except Exception as exc:  # a deadline or a lost connection ends the whole request
            self._arrived.put_nowait(exc)

    def unfinished(self) -> list[str]:
        return [part.task_id for part in self.parts if part.task_id not in self._done]

    async def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        for part in self.parts:
            await part.close()

    async def __anext__(self) -> Indexed:
        if self.finished is not None:
            raise StopAsyncIteration
        item = await self._arrived.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item.event, TaskFinished):
            self._done.add(item.event.task_id)
            if failure(item.event) is not None or len(self._done) == len(self.parts):
                self.finished = item.event
        return item

