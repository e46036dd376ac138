"""A runner's images leave the node only once their bytes are in FLEET_IMAGES.

The runner writes each image to the node's cache and reports it; an upload child (beside the
loop, at most UPLOADS at once) stores it and reports `ImageUploaded`; only then does the loop
publish the `image` event. While a task has an image on its way, its later reports wait here
in order (its terminal one included), so the terminal still comes after every other event.
When the store refuses the bytes (full, unreachable) the task stops there and ends failed: the
runner is told to cancel it and its terminal report is rewritten, so the task still ends
exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable

from fleet.aio import Supervisor
from fleet.wire.events import ErrorReason, ImageChunk, TaskFinished, failed
from fleet.wire.tasks import CancelTask
from fleet.worker.cluster import ClusterLink
from fleet.worker.continuation import image_key
from fleet.worker.inbox import ImageUploaded, Inbox, RunnerReported
from fleet.worker.spans import TaskSpans

log = logging.getLogger(__name__)

UPLOADS = 2  # uploads at once: each saturates a core hashing and copying
# Fault injection, for tests only (like the runner's FLEET_FAULT_* knobs): a FIFO each upload
# of an output image reads one line from before it stores the bytes, so a test holds an upload
# open for as long as it needs (tests/integration/test_image_ending.py).
UPLOAD_GATE_ENV = "FLEET_FAULT_UPLOAD_GATE"
SendToRunner = Callable[[str, CancelTask], Awaitable[bool]]


class ImageOutputs:
    def __init__(
        self, cluster: ClusterLink, spans: TaskSpans, send: SendToRunner, inbox: Inbox,
        owner: Supervisor, limit: int = UPLOADS,
    ) -> None:
        self.cluster = cluster
        self.spans = spans
        self.send = send
        self.inbox = inbox
        self.owner = owner
        self._bound = asyncio.Semaphore(limit)
        # task id -> its reports waiting behind an image upload (the image itself first)
        self._waiting: dict[str, deque[RunnerReported]] = {}
        self.unstored: dict[str, str] = {}  # task id -> why an image of it was not stored

    def admit(self, item: RunnerReported) -> bool:
        """True when the loop may handle `item` now; False when it waits here (behind an
        upload of its task, or as an image whose upload this starts)."""
        task_id = getattr(item.report, "task_id", None)
        if task_id is None:
            return True
        if queue := self._waiting.get(task_id):
            if isinstance(item.report, TaskFinished) and any(
                isinstance(waiting.report, TaskFinished) for waiting in queue
            ):
                return False  # one terminal per task (the runner's, then its exit's): first wins
            queue.append(item)
            return False
        if isinstance(item.report, ImageChunk):
            if task_id in self.unstored:
                return False  # the task already failed on an image: drop the rest
            self._waiting[task_id] = deque([item])
            self._upload(item.runner_id, item.report)
            return False
        return True

    def uploaded(self, done: ImageUploaded) -> list[RunnerReported]:
        """An upload ended: what the loop handles now, in order (the image when stored, then
        the reports that waited behind it, up to the next image, whose upload starts)."""
        task_id = done.image.task_id
        queue = self._waiting.pop(task_id, deque())
        if queue:
            queue.popleft()  # the image that was uploading
        ready: list[RunnerReported] = []
        if done.error is None:
            ready.append(RunnerReported(done.runner_id, done.image))
        else:
            log.error("task %s: image %s not stored: %s", task_id, done.image.sha256, done.error)
            self.unstored.setdefault(
                task_id, f"image {done.image.sha256} could not be stored: {done.error}"
            )
            self.owner.spawn(
                f"cancel {task_id}", self.send(done.runner_id, CancelTask(task_id=task_id))
            )
        while queue:
            item = queue[0]
            if isinstance(item.report, ImageChunk) and task_id not in self.unstored:
                self._waiting[task_id] = queue
                self._upload(item.runner_id, item.report)
                break
            queue.popleft()
            if not isinstance(item.report, ImageChunk):
                ready.append(item)
        return ready

    def ending(self, task_id: str) -> bool:
        """Whether the task's terminal report already came and waits here behind an upload:
        the task has ended at its runner, only its images are still on their way."""
        return any(isinstance(item.report, TaskFinished) for item in self._waiting.get(task_id, ()))

    def on_the_way(self, task_id: str) -> frozenset[str]:
        """The images of a task made but not yet announced (uploading, or waiting to), as
        continuation keys ('<image>.<preview>', '<image>.final')."""
        return frozenset(
            image_key(item.report) for item in self._waiting.get(task_id, ())
            if isinstance(item.report, ImageChunk)
        )

    def final(self, report: TaskFinished, runner_id: str) -> TaskFinished:
        """The runner's terminal report, or a failure in its place if an image was lost."""
        why = self.unstored.pop(report.task_id, None)
        if why is None:
            return report
        lost = failed(report.task_id, report.at, ErrorReason.INTERNAL, why)
        return lost.model_copy(update={"node_id": report.node_id, "runner_id": runner_id})

    def _upload(self, runner_id: str, image: ImageChunk) -> None:
        self.owner.spawn(f"upload {image.sha256[:12]}", self._store(runner_id, image))

    async def _store(self, runner_id: str, image: ImageChunk) -> None:
        error: str | None = None
        try:
            if gate := os.environ.get(UPLOAD_GATE_ENV):
                log.warning("fault injection: upload of %s waits on %s", image.sha256[:12], gate)
                await asyncio.to_thread(_read_line, gate)
            async with self._bound:
                with self.spans.child(image.task_id, "put image", {"fleet.image": image.sha256}):
                    await self.cluster.upload_output(image.sha256)
        except Exception as exc:  # reported to the loop, which fails the task
            error = f"{type(exc).__name__}: {exc}"
        self.inbox.put_nowait(ImageUploaded(runner_id, image, error))


def _read_line(path: str) -> None:
    """One line from the FIFO; an end without one (a writer that closed before this reader
    came) waits for the next writer."""
    while True:
        with open(path, "rb") as fifo:  # blocks until a writer opens it
            if fifo.readline():
                return
