"""A runner's images leave the node only once their bytes are in FLEET_IMAGES.

The runner writes each image to the node's cache and reports it; the worker uploads it, then
publishes the `image` event. When the store refuses the bytes (full, unreachable) the task
stops there and ends failed: the runner is told to cancel it and its terminal report is
rewritten, so the task still ends exactly once and after its other events.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fleet.wire.events import ErrorReason, ImageChunk, TaskFinished, failed
from fleet.wire.tasks import CancelTask
from fleet.worker.cluster import ClusterLink
from fleet.worker.outputs import TaskOutput
from fleet.worker.spans import TaskSpans

log = logging.getLogger(__name__)

SendToRunner = Callable[[str, CancelTask], Awaitable[None]]


class ImageOutputs:
    def __init__(
        self, cluster: ClusterLink, output: TaskOutput, spans: TaskSpans, send: SendToRunner
    ) -> None:
        self.cluster = cluster
        self.output = output
        self.spans = spans
        self.send = send
        self.unstored: dict[str, str] = {}  # task id -> why an image of it was not stored

    async def announce(self, runner_id: str, image: ImageChunk) -> None:
        if image.task_id in self.unstored:
            return
        try:
            with self.spans.child(image.task_id, "put image", {"fleet.image": image.sha256}):
                await self.cluster.upload_output(image.sha256)
        except Exception as exc:
            log.error("task %s: image %s not stored: %s", image.task_id, image.sha256, exc)
            self.unstored[image.task_id] = f"image {image.sha256} could not be stored: {exc}"
            await self.send(runner_id, CancelTask(task_id=image.task_id))
            return
        await self.output.chunk(image)

    def final(self, report: TaskFinished, runner_id: str) -> TaskFinished:
        """The runner's terminal report, or a failure in its place if an image was lost."""
        why = self.unstored.pop(report.task_id, None)
        if why is None:
            return report
        lost = failed(report.task_id, report.at, ErrorReason.INTERNAL, why)
        return lost.model_copy(update={"node_id": report.node_id, "runner_id": runner_id})
