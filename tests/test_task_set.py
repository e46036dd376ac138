"""TaskSet: the owner of tasks started outside any Supervisor (the span processor's flushes)."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import pytest

from fleet.aio import TaskSet

VALUE: contextvars.ContextVar[str] = contextvars.ContextVar("VALUE", default="caller's")


async def test_a_task_is_kept_until_it_ends_runs_in_its_context_and_its_failure_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet()
    seen: list[str] = []

    async def fails() -> None:
        seen.append(VALUE.get())
        raise RuntimeError("flush broke")

    own = contextvars.Context()
    own.run(VALUE.set, "its own")
    with caplog.at_level(logging.ERROR, logger="fleet.aio"):
        task = tasks.spawn(fails(), context=own)
        assert tasks._tasks == {task}  # referenced: the loop keeps only weak references
        await asyncio.wait([task])  # its done callbacks ran first, in the order added
    assert tasks._tasks == set()
    assert seen == ["its own"]
    assert "flush broke" in caplog.text
