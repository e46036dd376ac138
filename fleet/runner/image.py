"""The image engine: mflux behind the Engine seam, one task at a time, in admission order.

`step()` hands back a task's events as they appear: each preview while its image is still
denoising, then the image, then (after the last image) the TaskFinished. Returning a preview
mid-generation needs the generation to go on meanwhile, so the model lives on a thread of its
own, the only thread that ever touches it (load, warm-up, every generation), and `step()` waits
on the queue that thread fills. `cancel` may come from any thread; the generation stops after
the diffusion step in progress.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, Literal

from PIL import Image

from fleet.runner.engine import Admission, EngineConfig, Progress
from fleet.runner.image_codec import store_image
from fleet.runner.image_models import (
    ImageRequest,
    check_admission,
    decode_preview,
    family_of,
    generate,
    load_model,
)
from fleet.runner.image_steps import GenerationCancelled, ImageInProgress, StepHook, StepWatcher
from fleet.wire.cluster import ImageDefaults
from fleet.wire.events import (
    ErrorReason,
    ImageStats,
    OutputEvent,
    TaskFinished,
    TaskStats,
    failed,
)
from fleet.wire.tasks import ImageEdits, ImageGeneration

log = logging.getLogger(__name__)

WARM_UP_SIDE = 64
SEED_RANGE = 2**32


@dataclass
class _Queued:
    admission: Admission
    admitted_at: float


@dataclass
class _Running:
    admission: Admission
    task: ImageGeneration | ImageEdits
    base_seed: int
    started: float
    queue_wait_s: float
    next_image: int = 0


@dataclass(frozen=True)
class _ImageEnded:
    """Put on the event queue by the model thread after every generation, whatever happened."""

    outcome: Literal["done", "cancelled", "failed"]
    message: str = ""


class ImageEngine:
    def __init__(self, config: EngineConfig, on_step: StepHook | None = None) -> None:
        """`on_step` sees every diffusion step's timing, on the model thread: keep it short."""
        self._config = config
        self._family = family_of(config.card)
        self._defaults = config.card.image_defaults or ImageDefaults()
        self._model: Any = None
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mflux")
        self._events: queue.Queue[OutputEvent | _ImageEnded] = queue.Queue()
        self._lock = threading.Lock()  # guards the three fields below
        self._queued: deque[_Queued] = deque()
        self._running: _Running | None = None
        self._cancelled: set[str] = set()
        self._watcher = StepWatcher(self._is_cancelled, self._store_preview, on_step)

    def load(self, progress: Progress) -> None:
        progress(0, 1)
        self._model = self._on_model_thread(load_model, self._config.card, self._config.model_path)
        self._model.callbacks.register(self._watcher)
        progress(1, 1)

    def warm_up(self) -> None:
        inputs: list[Path] = []
        if not self._family.text_to_image:
            grey = Image.new("RGB", (WARM_UP_SIDE, WARM_UP_SIDE), (128, 128, 128))
            inputs = [store_image(grey, "png", self._config.images_dir).path]
        request = ImageRequest(
            prompt="warm up",
            width=WARM_UP_SIDE,
            height=WARM_UP_SIDE,
            steps=1,
            guidance=self._defaults.guidance,
            seed=0,
            input_paths=inputs,
        )
        self._on_model_thread(generate, self._model, self._family, request)

    def admit(self, admission: Admission) -> None:
        check_admission(self._config.card, self._family, admission)
        with self._lock:
            self._queued.append(_Queued(admission, admitted_at=time.time()))

    def step(self) -> list[OutputEvent]:
        events = self._end_cancelled_in_queue()
        if self._running is None and not self._start_next():
            return events
        events.extend(self._collect())
        return events

    def cancel(self, task_id: str) -> None:
        with self._lock:
            running = self._running is not None and self._running.task.task_id == task_id
            if running or any(q.admission.task.task_id == task_id for q in self._queued):
                self._cancelled.add(task_id)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._queued) + (self._running is not None)

    def close(self) -> None:
        with self._lock:
            if self._running is not None:
                self._cancelled.add(self._running.task.task_id)
        self._model_thread.shutdown(wait=True)
        self._model = None

    def _end_cancelled_in_queue(self) -> list[OutputEvent]:
        with self._lock:
            ended = [q for q in self._queued if q.admission.task.task_id in self._cancelled]
            for queued in ended:
                self._queued.remove(queued)
                self._cancelled.discard(queued.admission.task.task_id)
        return [self._cancelled_event(q.admission.task.task_id) for q in ended]

    def _start_next(self) -> bool:
        now = time.time()
        with self._lock:
            if not self._queued:
                return False
            queued = self._queued.popleft()
            task = queued.admission.task
            assert isinstance(task, ImageGeneration | ImageEdits)
            delivered = queued.admission.delivered_images
            running = _Running(
                admission=queued.admission,
                task=task,
                base_seed=task.seed if task.seed is not None else _seed_from(task.task_id),
                started=now,
                queue_wait_s=queued.admission.queue_wait_s + (now - queued.admitted_at),
                # A restarted task: its delivered images are not made again (same seeds,
                # same bytes); the next one starts from step 0.
                next_image=_first_undelivered(delivered, task.n),
            )
            self._running = running
        if running.next_image >= task.n:  # every image was delivered; only the terminal was lost
            self._events.put(_ImageEnded("done"))
        else:
            self._submit_next_image(running)
        return True

    def _submit_next_image(self, running: _Running) -> None:
        index = running.next_image
        running.next_image += 1
        self._model_thread.submit(
            self._make_image, running.task, self._request(running, index), index
        )

    def _request(self, running: _Running, index: int) -> ImageRequest:
        task = running.task
        edits = isinstance(task, ImageEdits)
        return ImageRequest(
            prompt=task.prompt,
            width=task.width,
            height=task.height,
            steps=task.steps or self._defaults.steps,
            guidance=self._defaults.guidance if task.guidance is None else task.guidance,
            # Image i of a task uses seed + i: each image differs, each is reproducible.
            seed=(running.base_seed + index) % SEED_RANGE,
            input_paths=[running.admission.inputs[h] for h in task.input_images] if edits else [],
            strength=task.strength if edits else 1.0,
        )

    def _collect(self) -> list[OutputEvent]:
        """Wait for the running task's next events; take whatever else is ready with them."""
        events: list[OutputEvent] = []
        while (running := self._running) is not None:
            try:
                item = self._events.get(block=not events)
            except queue.Empty:
                break
            if isinstance(item, _ImageEnded):
                events.extend(self._after_image(running, item))
            else:
                events.append(item)
        return events

    def _after_image(self, running: _Running, ended: _ImageEnded) -> list[OutputEvent]:
        task_id = running.task.task_id
        more = ended.outcome == "done" and running.next_image < running.task.n
        if more and not self._is_cancelled(task_id):
            self._submit_next_image(running)
            return []
        with self._lock:
            self._running = None
            self._cancelled.discard(task_id)
        if ended.outcome == "failed":
            return [
                self._with_origin(failed(task_id, time.time(), ErrorReason.INTERNAL, ended.message))
            ]
        if ended.outcome == "cancelled" or more:
            return [self._cancelled_event(task_id)]
        stats = TaskStats(queue_wait_s=running.queue_wait_s, total_s=time.time() - running.started)
        finished = TaskFinished(task_id=task_id, at=time.time(), status="completed", stats=stats)
        return [self._with_origin(finished)]

    def _make_image(
        self, task: ImageGeneration | ImageEdits, request: ImageRequest, index: int
    ) -> None:
        """On the model thread: one generation, its previews and its image, then _ImageEnded."""
        self._watcher.watch(ImageInProgress(task, index))
        started = time.time()
        outcome = _ImageEnded("failed", "the generation stopped without a result")
        try:
            image = generate(self._model, self._family, request)
            stored = store_image(image, task.output_format, self._config.images_dir)
            durations = [t.ended - t.started for t in self._watcher.timings]
            stats = ImageStats(
                seconds_per_step=fmean(durations) if durations else 0.0,
                total_s=time.time() - started,
                steps=len(durations),
            )
            self._events.put(stored.announced(task.task_id, index, stats=stats))
            outcome = _ImageEnded("done")
        except GenerationCancelled:
            outcome = _ImageEnded("cancelled")
        except Exception as error:
            log.exception("image %d of task %s failed", index, task.task_id)
            outcome = _ImageEnded("failed", f"{type(error).__name__}: {error}")
        finally:
            self._watcher.watch(None)
            self._events.put(outcome)

    def _store_preview(
        self, image: ImageInProgress, latents: Any, config: Any, index: int, total: int
    ) -> None:
        running = self._running
        if running is not None and f"{image.image_index}.{index}" in (
            running.admission.delivered_images
        ):
            return  # an earlier attempt delivered this preview
        preview = decode_preview(
            self._model, self._family, latents, width=config.width, height=config.height
        )
        stored = store_image(preview, image.task.output_format, self._config.images_dir)
        self._events.put(
            stored.announced(image.task.task_id, image.image_index, partial=(index, total))
        )

    def _on_model_thread(self, function: Any, *args: Any) -> Any:
        return self._model_thread.submit(function, *args).result()

    def _is_cancelled(self, task_id: str) -> bool:
        with self._lock:
            return task_id in self._cancelled

    def _cancelled_event(self, task_id: str) -> TaskFinished:
        return self._with_origin(failed(task_id, time.time(), ErrorReason.CANCELLED, "cancelled"))

    def _with_origin(self, finished: TaskFinished) -> TaskFinished:
        return finished.model_copy(
            update={"node_id": self._config.node_id, "runner_id": self._config.runner_id}
        )


def _first_undelivered(delivered: frozenset[str], count: int) -> int:
    index = 0
    while index < count and f"{index}.final" in delivered:
        index += 1
    return index


def _seed_from(task_id: str) -> int:
    """A task without a seed gets one from its id, so a redelivered task draws the same images."""
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big")

