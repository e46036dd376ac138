"""ImageOutputs' ordering rule: an image event goes out only once its bytes are stored, and a
task's later reports (its terminal included) wait behind it, in order. The store here is a
stand-in whose uploads the test releases one by one (the real store: test_image_flow)."""

from __future__ import annotations

import asyncio

from fleet.aio import Supervisor
from fleet.wire.events import ErrorReason, ImageChunk, TaskFinished, TokenChunk
from fleet.wire.tasks import CancelTask
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import ImageUploaded, Inbox, RunnerReported
from fleet.worker.spans import TaskSpans


class Store:
    """Uploads that end when the test says: release(sha) or refuse(sha)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Future[None]] = {}

    def _gate(self, sha: str) -> asyncio.Future[None]:
        return self.gates.setdefault(sha, asyncio.get_running_loop().create_future())

    async def upload_output(self, sha256: str) -> None:
        await self._gate(sha256)

    def release(self, sha: str) -> None:
        self._gate(sha).set_result(None)

    def refuse(self, sha: str) -> None:
        self._gate(sha).set_exception(OSError("store full"))


def image(task_id: str, n: int) -> ImageChunk:
    return ImageChunk(
        task_id=task_id, at=0.0, sha256=f"{n:064x}", image_index=n, format="png", width=1,
        height=1, size_bytes=1,
    )


def reported(report: object) -> RunnerReported:
    return RunnerReported("run-1", report)  # type: ignore[arg-type]


async def test_reports_wait_behind_an_upload_and_the_terminal_comes_last() -> None:
    store, inbox, cancels = Store(), Inbox(), []
    cancelled = asyncio.Event()

    async def send(runner_id: str, command: CancelTask) -> bool:
        cancels.append(command.task_id)
        cancelled.set()
        return True

    async with Supervisor("test") as owner:
        images = ImageOutputs(store, TaskSpans(), send, inbox, owner)  # type: ignore[arg-type]
        first, second = image("t", 0), image("t", 1)
        token = TokenChunk(task_id="t", at=0.0, index=0, token_id=1, text="x")
        end = TaskFinished(task_id="t", at=0.0, status="completed")
        assert not images.admit(reported(first))  # its upload starts
        assert not images.admit(reported(token))  # waits behind it
        assert not images.admit(reported(second))
        assert not images.ending("t")
        assert not images.admit(reported(end))
        assert images.ending("t")  # its terminal came: a runner exit now must not restart it
        assert not images.admit(reported(end))  # a second terminal (the runner's exit) dropped
        other = TokenChunk(task_id="u", at=0.0, index=0, token_id=1, text="y")
        assert images.admit(reported(other))  # another task's events never wait
        store.release(first.sha256)
        done = await asyncio.wait_for(inbox.get(), 5)
        assert isinstance(done, ImageUploaded) and done.error is None
        assert [r.report for r in images.uploaded(done)] == [first, token]  # second uploads now
        store.refuse(second.sha256)
        done = await asyncio.wait_for(inbox.get(), 5)
        assert isinstance(done, ImageUploaded) and done.error
        [last] = images.uploaded(done)
        assert last.report == end
        rewritten = images.final(end, "run-1")
        assert (rewritten.status, rewritten.reason) == ("failed", ErrorReason.INTERNAL)
        await asyncio.wait_for(cancelled.wait(), 5)  # the runner is told to stop the task
        await owner.cancel_all()
    assert cancels == ["t"]
