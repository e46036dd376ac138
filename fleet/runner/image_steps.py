"""What happens between two diffusion steps: timing, cancellation and preview images.

mflux calls a registered object's `call_before_loop` and `call_in_loop` (after each denoising
step, before it evaluates that step's latents). An exception raised from
`call_in_loop` leaves `generate_image` at once and the model stays usable, which is how a
cancel stops a generation between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.wire.tasks import ImageEdits, ImageGeneration


class GenerationCancelled(Exception):
    """Raised between diffusion steps when the task being generated was cancelled."""


@dataclass(frozen=True)
class StepTiming:
    """One diffusion step in wall-clock seconds (unix time), for spans and statistics.

    Step 0 also carries the prompt encoding: mflux leaves it lazy until the first step runs.
    """

    task_id: str
    image_index: int
    step: int  # 0-based within this generation's loop
    total: int  # steps this generation runs (an edit may skip the first ones)
    started: float
    ended: float


StepHook = Callable[[StepTiming], None]


@dataclass(frozen=True)
class ImageInProgress:
    task: ImageGeneration | ImageEdits
    image_index: int


# (image, latents, mflux config, preview index, previews in this image)
PreviewSink = Callable[[ImageInProgress, Any, Any, int, int], None]


def preview_steps(loop_steps: int, partial_images: int) -> list[int]:
    """After which completed steps (1-based) to show a preview: evenly spaced, never the last.

    A preview after the last step would be the final image again, and two previews after the
    same step would be one image twice, so fewer steps than asked for give fewer previews.
    """
    spaced = {round(k * loop_steps / (partial_images + 1)) for k in range(1, partial_images + 1)}
    return sorted(step for step in spaced if 1 <= step < loop_steps)


class StepWatcher:
    """Registered once on the model; told before each generation which image it is making."""

    def __init__(
        self,
        is_cancelled: Callable[[str], bool],
        on_preview: PreviewSink,
        on_step: StepHook | None = None,
    ) -> None:
        self._is_cancelled = is_cancelled
        self._on_preview = on_preview
        self._on_step = on_step
        self._image: ImageInProgress | None = None
        self._previews: list[int] = []
        self._total = 0
        self._completed = 0
        self._step_started = 0.0
        self.timings: list[StepTiming] = []

    def watch(self, image: ImageInProgress | None) -> None:
        """Follow `image` from its next generation on; None for runs nobody waits on (warm-up)."""
        self._image = image
        self.timings = []

    def call_before_loop(self, *, config: Any, **_: Any) -> None:
        if self._image is None:
            return
        self._total = config.num_inference_steps - config.init_time_step
        self._previews = preview_steps(self._total, self._image.task.partial_images)
        self._completed = 0
        self._raise_if_cancelled(self._image)
        self._step_started = time.time()

    def call_in_loop(self, *, latents: Any, config: Any, **_: Any) -> None:
        image = self._image
        if image is None:
            return
        import mlx.core as mx

        # mflux evaluates the step's latents only after this call; evaluate here so the step
        # ends where its computation ends.
        mx.eval(latents)
        timing = StepTiming(
            task_id=image.task.task_id,
            image_index=image.image_index,
            step=self._completed,
            total=self._total,
            started=self._step_started,
            ended=time.time(),
        )
        self.timings.append(timing)
        self._completed += 1
        if self._on_step is not None:
            self._on_step(timing)
        self._raise_if_cancelled(image)
        if self._completed in self._previews:
            index = self._previews.index(self._completed)
            self._on_preview(image, latents, config, index, len(self._previews))
        self._step_started = time.time()

    def _raise_if_cancelled(self, image: ImageInProgress) -> None:
        if self._is_cancelled(image.task.task_id):
            raise GenerationCancelled(f"task {image.task.task_id} cancelled")
