"""The vision engine in-process on tiny-vlm: an image changes the answer, each task ends with
exactly one TaskFinished, a cancel ends its task once, a missing or unreadable image is a
typed refusal; and the prompt carries one placeholder run per image (a pure table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from PIL import Image

from fleet.errors import TaskRejected
from fleet.models.catalog import get_card
from fleet.runner.engine import Admission, EngineConfig
from fleet.runner.vision_cache import EncodeTiming
from fleet.runner.vision_inputs import VisionShape, read_shape, template_messages
from fleet.wire.events import OutputEvent, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, ImagePart, ResponseFormat, TextGeneration, TextPart

# fleet.runner's modules are imported where used, not at the top: they import mlx-lm, which
# pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from fleet.runner.vision import VisionEngine

RED, BLUE = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> VisionEngine:
    from fleet.runner.vision import VisionEngine
    vision = VisionEngine(EngineConfig(card=get_card("tiny-vlm"), model_path=tiny_vlm_dir,
                                       slots=4, images_dir=tiny_vlm_dir))
    vision.load(lambda done, total: None)
    return vision


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision-images")
    paths = {}
    for sha, colour in ((RED, (220, 20, 20)), (BLUE, (10, 40, 230))):
        paths[sha] = folder / f"{sha}.png"
        Image.new("RGB", (48, 40), colour).save(paths[sha])
    return paths


def chat(task_id: str, sha: str | None, max_tokens: int = 6) -> TextGeneration:
    parts: list[TextPart | ImagePart] = [TextPart(text="What is in this picture?")]
    if sha:
        parts.insert(0, ImagePart(sha256=sha))
    return TextGeneration(task_id=task_id, model="tiny-vlm", temperature=0.0,
                          max_tokens=max_tokens,
                          messages=[ChatMessage(role="user", content=parts)])


def run_all(engine: VisionEngine) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    while engine.active:
        events += engine.step()
    return events


def tokens_of(events: list[OutputEvent], task_id: str) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenChunk) and e.task_id == task_id]


def test_the_image_changes_the_answer_and_each_task_ends_once(
    engine: VisionEngine, images: dict[str, Path]
) -> None:
    engine.admit(Admission(task=chat("red", RED), inputs=images))
    engine.admit(Admission(task=chat("blue", BLUE), inputs=images))
    events = run_all(engine)
    finished = [e for e in events if isinstance(e, TaskFinished)]
    assert sorted(f.task_id for f in finished) == ["blue", "red"]
    assert all(f.status == "completed" and f.usage for f in finished)
    red, blue = tokens_of(events, "red"), tokens_of(events, "blue")
    assert red and blue and red != blue  # random weights, but the image reaches the model
    prompt = next(f for f in finished if f.task_id == "red").usage
    assert prompt is not None and prompt.prompt_tokens > 16  # 16 image tokens and the text


def test_a_cancel_ends_its_task_once(engine: VisionEngine, images: dict[str, Path]) -> None:
    engine.admit(Admission(task=chat("gone", RED, max_tokens=50), inputs=images))
    engine.step()
    engine.cancel("gone")
    events = run_all(engine)
    ends = [e for e in events if isinstance(e, TaskFinished)]
    assert [(e.task_id, e.status) for e in ends] == [("gone", "cancelled")]


def test_a_continued_task_goes_on_after_the_tokens_already_streamed(
    engine: VisionEngine, images: dict[str, Path]
) -> None:
    engine.admit(Admission(task=chat("whole", RED, max_tokens=6), inputs=images))
    whole = tokens_of(run_all(engine), "whole")
    assert len(whole) == 6  # tiny-vlm's greedy answer to this image never hits EOS early

    engine.admit(Admission(task=chat("rest", RED, max_tokens=6), inputs=images,
                           generated=tuple(whole[:3])))
    events = run_all(engine)
    chunks = [e for e in events if isinstance(e, TokenChunk)]
    assert [c.token_id for c in chunks] == whole[3:]
    assert [c.index for c in chunks] == [3, 4, 5]
    end = events[-1]
    assert isinstance(end, TaskFinished) and end.usage and end.usage.completion_tokens == 6

    engine.admit(Admission(task=chat("done", RED, max_tokens=6), inputs=images,
                           generated=tuple(whole)))
    assert [(type(e).__name__, getattr(e, "finish_reason", None))
            for e in run_all(engine)] == [("TaskFinished", "length")]


def test_a_stop_string_ends_the_answer_before_it(
    engine: VisionEngine, images: dict[str, Path]
) -> None:
    engine.admit(Admission(task=chat("free", BLUE, max_tokens=12), inputs=images))
    free = "".join(e.text for e in run_all(engine) if isinstance(e, TokenChunk))
    assert len(free.strip()) >= 4, free  # tiny-vlm's greedy answer to this image
    middle = len(free) // 2
    stop = free[middle:middle + 2]
    stopped = chat("stopped", BLUE, max_tokens=12).model_copy(update={"stop": [stop]})
    engine.admit(Admission(task=stopped, inputs=images))
    events = run_all(engine)
    shown = "".join(e.text for e in events if isinstance(e, TokenChunk))
    assert shown == free[:free.index(stop)]
    assert isinstance(events[-1], TaskFinished) and events[-1].finish_reason == "stop"


def test_a_seed_repeats_a_sampled_answer(engine: VisionEngine, images: dict[str, Path]) -> None:
    answers = []
    for attempt in range(2):
        sampled = chat(f"seeded-{attempt}", RED, max_tokens=8).model_copy(
            update={"temperature": 1.0, "seed": 1234})
        engine.admit(Admission(task=sampled, inputs=images))
        answers.append(tokens_of(run_all(engine), f"seeded-{attempt}"))
    assert answers[0] and answers[0] == answers[1]


def test_what_the_engine_cannot_honour_is_refused(engine: VisionEngine) -> None:
    json_mode = chat("json", None).model_copy(
        update={"response_format": ResponseFormat(type="json_object")})
    with pytest.raises(TaskRejected, match="response_format json_object") as refused:
        engine.admit(Admission(task=json_mode))
    assert refused.value.code == "unsupported" and engine.active == 0


def test_a_missing_or_unreadable_image_is_refused(
    engine: VisionEngine, images: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(TaskRejected, match="did not reach this node") as missing:
        engine.admit(Admission(task=chat("no-input", RED), inputs={}))
    assert missing.value.code == "input_missing"
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    with pytest.raises(TaskRejected, match="could not be read") as corrupt:
        # An image never encoded here (the cache keys on the sha256 the worker verified).
        engine.admit(Admission(task=chat("junk", "c" * 64), inputs={"c" * 64: junk}))
    assert corrupt.value.code == "input_corrupt" and engine.active == 0


SHAPE = VisionShape(image_size=32, tokens_per_image=3, image_token="<i>", image_token_id=9)


@pytest.mark.parametrize(("content", "expected"), [
    ("plain text", "plain text"),
    ([TextPart(text="look "), ImagePart(sha256=RED)], "look <i><i><i>"),
    ([ImagePart(sha256=RED), ImagePart(sha256=BLUE), TextPart(text="?")],
     "<i><i><i><i><i><i>?"),
    (None, ""),
])
def test_template_messages_put_one_placeholder_run_per_image(
    content: str | list[TextPart | ImagePart] | None, expected: str
) -> None:
    message = ChatMessage(role="user", content=content)
    assert template_messages([message], SHAPE) == [{"role": "user", "content": expected}]


@pytest.mark.parametrize(("vision", "strategy", "tokens"), [
    ({"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}, "default", 576),
    ({"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}, "full", 577),
    ({"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14}, "full", 729),
    ({"model_type": "clip_vision_model", "image_size": 32, "patch_size": 8}, "default", 16),
])
def test_tokens_per_image_follow_the_tower(
    tmp_path: Path, vision: dict[str, object], strategy: str, tokens: int
) -> None:
    config = {"vision_config": vision, "vision_feature_select_strategy": strategy,
              "image_token_index": 7}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_shape(tmp_path)
    assert (shape.tokens_per_image, shape.image_token_id) == (tokens, 7)


def test_a_second_encode_of_an_image_is_a_cache_hit_with_the_same_answer(
    tiny_vlm_dir: Path, images: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy tokens with the vision cache equal those without it; the second task with an
    image is a counted hit, and a new engine (another runner) finds the entry on disk."""
    from fleet.runner.vision import VisionEngine

    encodes: list[EncodeTiming] = []  # what the runner's `encode images` span is made from

    def fresh(cache_mb: str) -> VisionEngine:
        monkeypatch.setenv("FLEET_VISION_CACHE_MB", cache_mb)
        vision = VisionEngine(EngineConfig(card=get_card("tiny-vlm"), model_path=tiny_vlm_dir,
                                           slots=4, images_dir=tmp_path / "images"),
                              on_encode=encodes.append)
        vision.load(lambda done, total: None)
        return vision

    def answer(vision: VisionEngine, task_id: str, *shas: str) -> tuple[list[int], int, int]:
        parts: list[TextPart | ImagePart] = [ImagePart(sha256=s) for s in shas]
        task = TextGeneration(task_id=task_id, model="tiny-vlm", temperature=0.0, max_tokens=6,
                              messages=[ChatMessage(role="user", content=[
                                  *parts, TextPart(text="What is in this picture?")])])
        vision.admit(Admission(task=task, inputs=images))
        events = run_all(vision)
        usage = next(e for e in events if isinstance(e, TaskFinished)).usage
        assert usage is not None
        return tokens_of(events, task_id), usage.images, usage.cached_images

    uncached, images_seen, hits = answer(fresh("0"), "off", RED, BLUE)
    assert (images_seen, hits) == (2, 0)
    cached = fresh("64")
    assert answer(cached, "first", RED, BLUE) == (uncached, 2, 0)
    assert answer(cached, "second", RED, BLUE) == (uncached, 2, 2)
    assert (cached.cache.counts.hits, cached.cache.counts.misses) == (2, 2)  # type: ignore[union-attr]
    # Another runner of the same model on this node reads what the first wrote.
    assert answer(fresh("64"), "other", BLUE, RED)[1:] == (2, 2)
    assert [(e.task_id, e.images, e.cached) for e in encodes] == [
        ("off", 2, 0), ("first", 2, 0), ("second", 2, 2), ("other", 2, 2)]
    assert all(e.started <= e.ended for e in encodes)
