"""The image engine on real mflux with tiny-flux2 (random weights: the images are noise)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PIL import Image

from fleet.errors import TaskRejected
from fleet.models.make_tiny_flux import make_tiny_flux2
from fleet.runner.engine import Admission, EngineConfig
from fleet.runner.image import ImageEngine
from fleet.runner.image_steps import StepTiming, preview_steps
from fleet.wire.cluster import ImageDefaults, ModelCard
from fleet.wire.events import ErrorReason, ImageChunk, OutputEvent, TaskFinished
from fleet.wire.tasks import ImageEdits, ImageGeneration

StepHook = Callable[[StepTiming], None]


class Hooks:
    """The engine's one `on_step`, forwarding to whatever hooks a test installs."""

    def __init__(self) -> None:
        self.installed: list[StepHook] = []
        self.timings: list[StepTiming] = []

    def __call__(self, timing: StepTiming) -> None:
        self.timings.append(timing)
        for hook in self.installed:
            hook(timing)


def make_engine(model_dir: Path, images_dir: Path, family: str, hooks: Hooks) -> ImageEngine:
    card = ModelCard(
        id="tiny-flux2",
        name="tiny-flux2",
        tasks=["text_to_image", "image_to_image"],
        family=family,
        source="built-in",
        image_defaults=ImageDefaults(steps=4, guidance=1.0, size="128x128"),
    )
    config = EngineConfig(card=card, model_path=model_dir, slots=1, images_dir=images_dir)
    engine = ImageEngine(config, on_step=hooks)
    engine.load(lambda done, total: None)
    engine.warm_up()
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_flux2(tmp_path_factory.mktemp("tiny-flux2") / "tiny-flux2")


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def hooks() -> Hooks:
    return Hooks()


@pytest.fixture(scope="module")
def engine(model_dir: Path, images_dir: Path, hooks: Hooks) -> Iterator[ImageEngine]:
    engine = make_engine(model_dir, images_dir, "mflux_flux2", hooks)
    yield engine
    engine.close()


@pytest.fixture
def input_image(images_dir: Path) -> tuple[str, Path]:
    gradient = Image.linear_gradient("L").resize((96, 96)).convert("RGB")
    path = images_dir / "input.png"
    gradient.save(path)
    return hashlib.sha256(path.read_bytes()).hexdigest(), path


def generation(task_id: str, **fields: object) -> ImageGeneration:
    fields.setdefault("size", "64x64")
    fields.setdefault("seed", 7)
    return ImageGeneration(task_id=task_id, model="tiny-flux2", prompt="a red fox", **fields)  # type: ignore[arg-type]


def run(engine: ImageEngine, *admissions: Admission) -> list[OutputEvent]:
    """Admit the tasks, then step until every one of them has finished."""
    for admission in admissions:
        engine.admit(admission)
    events: list[OutputEvent] = []
    while sum(isinstance(e, TaskFinished) for e in events) < len(admissions):
        events.extend(engine.step())
    return events


def chunks(events: list[OutputEvent]) -> list[ImageChunk]:
    return [e for e in events if isinstance(e, ImageChunk)]


def open_image(images_dir: Path, chunk: ImageChunk) -> Image.Image:
    data = (images_dir / chunk.sha256).read_bytes()
    assert hashlib.sha256(data).hexdigest() == chunk.sha256
    assert len(data) == chunk.size_bytes
    return Image.open(images_dir / chunk.sha256)


def test_generates_a_png_of_the_size_asked(engine: ImageEngine, images_dir: Path):
    events = run(engine, Admission(generation("png", size="128x128")))

    image, finished = events
    assert isinstance(image, ImageChunk) and isinstance(finished, TaskFinished)
    assert (image.image_index, image.partial_index, image.format) == (0, None, "png")
    assert (image.width, image.height) == (128, 128)
    assert image.stats is not None and image.stats.steps == 4
    assert image.stats.seconds_per_step > 0
    with open_image(images_dir, image) as png:
        assert (png.format, png.size) == ("PNG", (128, 128))
    assert finished.status == "completed" and finished.stats is not None
    assert engine.active == 0


def test_same_seed_same_bytes_other_seed_other_bytes(engine: ImageEngine):
    first = chunks(run(engine, Admission(generation("seed-a", seed=11, steps=1))))
    again = chunks(run(engine, Admission(generation("seed-b", seed=11, steps=1))))
    other = chunks(run(engine, Admission(generation("seed-c", seed=12, steps=1))))

    assert first[0].sha256 == again[0].sha256
    assert first[0].sha256 != other[0].sha256


def test_each_diffusion_step_is_timed(engine: ImageEngine, hooks: Hooks):
    hooks.timings.clear()
    run(engine, Admission(generation("timed")))

    assert [t.step for t in hooks.timings] == [0, 1, 2, 3]
    assert all(t.task_id == "timed" and t.total == 4 for t in hooks.timings)
    assert all(t.started <= t.ended for t in hooks.timings)
    assert all(a.ended <= b.started for a, b in zip(hooks.timings, hooks.timings[1:], strict=False))


def test_partial_images_come_first_then_the_final(engine: ImageEngine, images_dir: Path):
    events = run(engine, Admission(generation("partials", partial_images=2)))

    *images, finished = events
    assert [(c.partial_index, c.partial_total) for c in chunks(images)] == [
        (0, 2),
        (1, 2),
        (None, None),
    ]
    assert len({c.sha256 for c in chunks(images)}) == 3
    assert isinstance(finished, TaskFinished) and finished.status == "completed"
    with open_image(images_dir, chunks(images)[0]) as preview:
        assert preview.size == (64, 64)


@pytest.mark.parametrize(("output_format", "pillow_format"), [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_jpeg_and_webp(
    engine: ImageEngine, images_dir: Path, output_format: str, pillow_format: str
):
    task = generation(f"as-{output_format}", output_format=output_format, steps=1)
    events = run(engine, Admission(task))
    again = run(engine, Admission(task.model_copy(update={"task_id": f"{task.task_id}-again"})))

    (image,) = chunks(events)
    assert image.format == output_format
    assert chunks(again)[0].sha256 == image.sha256
    with open_image(images_dir, image) as decoded:
        assert (decoded.format, decoded.size) == (pillow_format, (64, 64))


def test_two_images_without_a_seed_differ_and_repeat_for_the_same_task(engine: ImageEngine):
    task = generation("two", n=2, seed=None, steps=1)
    first = chunks(run(engine, Admission(task)))
    redelivered = chunks(run(engine, Admission(task)))

    assert [c.image_index for c in first] == [0, 1]
    assert first[0].sha256 != first[1].sha256
    assert [c.sha256 for c in redelivered] == [c.sha256 for c in first]


def test_edit_of_an_input_image(engine: ImageEngine, input_image: tuple[str, Path]):
    sha256, path = input_image
    task = ImageEdits(
        task_id="edit",
        model="tiny-flux2",
        prompt="a red fox",
        size="64x64",
        seed=7,
        input_images=[sha256],
        strength=0.5,
    )
    events = run(engine, Admission(task, inputs={sha256: path}))

    (image,) = chunks(events)
    assert (image.width, image.height) == (64, 64)
    # mflux keeps half of the input: the loop starts half way and runs two of the four steps.
    assert image.stats is not None and image.stats.steps == 2
    # The same seed and prompt without the input image: the input made the difference.
    plain = chunks(run(engine, Admission(generation("not-edited"))))
    assert plain[0].sha256 != image.sha256


def test_edit_without_its_input_file_is_rejected(engine: ImageEngine, input_image):
    sha256, _ = input_image
    task = ImageEdits(task_id="no-input", model="tiny-flux2", prompt="x", input_images=[sha256])

    with pytest.raises(TaskRejected) as rejected:
        engine.admit(Admission(task, inputs={}))
    assert rejected.value.reason is ErrorReason.INPUT_MISSING


@pytest.mark.parametrize("size", ["120x128", "128x100"])
def test_size_not_a_multiple_of_16_is_rejected(engine: ImageEngine, size: str):
    with pytest.raises(TaskRejected) as rejected:
        engine.admit(Admission(generation("odd-size", size=size)))
    assert rejected.value.reason is ErrorReason.INVALID_TASK
    assert engine.active == 0


def test_cancel_from_another_thread_stops_between_steps(engine: ImageEngine, hooks: Hooks):
    reached_step_1 = threading.Event()
    cancel_sent = threading.Event()

    def hold_at_step_1(timing: StepTiming) -> None:
        if timing.task_id == "cancel-me" and timing.step == 1:
            reached_step_1.set()
            cancel_sent.wait(timeout=60)

    def cancel_when_reached() -> None:
        reached_step_1.wait(timeout=60)
        engine.cancel("cancel-me")
        cancel_sent.set()

    hooks.installed.append(hold_at_step_1)
    canceller = threading.Thread(target=cancel_when_reached)
    canceller.start()
    try:
        events = run(engine, Admission(generation("cancel-me", n=2)))
    finally:
        hooks.installed.remove(hold_at_step_1)
        canceller.join()

    (finished,) = events
    assert isinstance(finished, TaskFinished)
    assert (finished.status, finished.reason) == ("cancelled", ErrorReason.CANCELLED)
    assert max(t.step for t in hooks.timings if t.task_id == "cancel-me") == 1
    # The model is still usable after a generation was stopped half way.
    assert chunks(run(engine, Admission(generation("after-cancel", steps=1))))


def test_a_queued_task_that_is_cancelled_never_runs(engine: ImageEngine):
    engine.admit(Admission(generation("runs", steps=1)))
    engine.admit(Admission(generation("queued", steps=1)))
    engine.cancel("queued")

    events: list[OutputEvent] = []
    while engine.active:
        events.extend(engine.step())

    finished = {e.task_id: e for e in events if isinstance(e, TaskFinished)}
    assert finished["queued"].status == "cancelled"
    assert finished["runs"].status == "completed"
    assert {c.task_id for c in chunks(events)} == {"runs"}


def test_reference_edit_family_conditions_on_every_input(
    model_dir: Path, images_dir: Path, input_image: tuple[str, Path]
):
    sha256, path = input_image
    editor = make_engine(model_dir, images_dir, "mflux_flux2_edit", Hooks())
    try:
        with pytest.raises(TaskRejected) as rejected:
            editor.admit(Admission(generation("text-only")))
        task = ImageEdits(
            task_id="reference-edit",
            model="tiny-flux2",
            prompt="the same, in blue",
            size="64x64",
            steps=2,
            input_images=[sha256, sha256],
        )
        events = run(editor, Admission(task, inputs={sha256: path}))
    finally:
        editor.close()

    assert rejected.value.reason is ErrorReason.UNSUPPORTED
    (image,) = chunks(events)
    assert image.stats is not None and image.stats.steps == 2


@pytest.mark.parametrize(
    ("loop_steps", "partial_images", "after"),
    [(4, 0, []), (4, 1, [2]), (4, 2, [1, 3]), (4, 3, [1, 2, 3]), (4, 8, [1, 2, 3]), (1, 2, [])],
)
def test_preview_steps_are_evenly_spaced(loop_steps: int, partial_images: int, after: list[int]):
    assert preview_steps(loop_steps, partial_images) == after
