"""The vision engine's shared batch (continuous batching) on tiny-vlm: greedy tasks of
different prompt lengths, with and without images and cached features, admitted together or
while others decode, give exactly the tokens each gives decoded on its own (mlx-vlm's
generation step); a sampled task decodes beside the batch; which tasks share it (a table)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from PIL import Image

from fleet.models.catalog import get_card
from fleet.runner.engine import Admission, EngineConfig
from fleet.wire.events import OutputEvent, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, ImagePart, TextGeneration, TextPart

# fleet.runner's modules are imported where used, not at the top: they import mlx-lm, which
# pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from fleet.runner.vision import VisionEngine

COLOURS = {"1" * 64: (220, 20, 20), "2" * 64: (10, 40, 230), "3" * 64: (20, 200, 60)}


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> VisionEngine:
    from fleet.runner.vision import VisionEngine
    vision_engine = VisionEngine(EngineConfig(
        card=get_card("tiny-vlm"), model_path=tiny_vlm_dir, slots=4,
        images_dir=tmp_path_factory.mktemp("batch-cache")))
    vision_engine.load(lambda done, total: None)
    return vision_engine


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("batch-images")
    paths = {}
    for sha, colour in COLOURS.items():
        paths[sha] = folder / f"{sha}.png"
        Image.new("RGB", (40, 36), colour).save(paths[sha])
    return paths


def chat(task_id: str, shas: list[str], question: str, max_tokens: int = 10) -> TextGeneration:
    parts: list[TextPart | ImagePart] = [ImagePart(sha256=sha) for sha in shas]
    parts.append(TextPart(text=question))
    return TextGeneration(task_id=task_id, model="tiny-vlm", temperature=0.0,
                          max_tokens=max_tokens,
                          messages=[ChatMessage(role="user", content=parts)])


# Prompts of different lengths (the batch left-pads the shorter), one without an image.
TASKS = [
    chat("a", ["1" * 64], "What is this?"),
    chat("b", ["2" * 64], "Describe the colour of this picture in a few careful words."),
    chat("c", ["1" * 64, "3" * 64], "Compare them."),
    chat("d", [], "Say something about nothing at all, please, at length.", max_tokens=14),
]


def run_all(engine: VisionEngine) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    while engine.active:
        events += engine.step()
    return events


def answers(events: list[OutputEvent]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, TokenChunk):
            out.setdefault(event.task_id, []).append(event.token_id)
    return out


@pytest.fixture(scope="module")
def alone(engine: VisionEngine, images: dict[str, Path]) -> dict[str, list[int]]:
    """Each task decoded on its own with mlx-vlm's generation step (the engine's path for a
    sampled task), one after another."""
    from fleet.runner import vision

    found: dict[str, list[int]] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vision, "is_greedy", lambda task: False)
        for task in TASKS:
            engine.admit(Admission(task=task, inputs=images))
            found |= answers(run_all(engine))
    assert all(len(tokens) >= 4 for tokens in found.values()), found
    return found


def test_tasks_admitted_together_decode_as_they_would_alone(
    engine: VisionEngine, images: dict[str, Path], alone: dict[str, list[int]]
) -> None:
    for task in TASKS:
        engine.admit(Admission(task=task, inputs=images))
    assert engine._batch is not None
    events = run_all(engine)
    assert answers(events) == alone
    ends = [e for e in events if isinstance(e, TaskFinished)]
    assert sorted(e.task_id for e in ends) == ["a", "b", "c", "d"]


def test_a_task_that_joins_mid_decode_changes_no_one_s_tokens(
    engine: VisionEngine, images: dict[str, Path], alone: dict[str, list[int]]
) -> None:
    events: list[OutputEvent] = []
    for task in TASKS[:2]:
        engine.admit(Admission(task=task, inputs=images))
    for _ in range(4):
        events += engine.step()
    engine.admit(Admission(task=TASKS[2], inputs=images))  # its features now cached
    events += engine.step()
    engine.admit(Admission(task=TASKS[3], inputs=images))
    events += run_all(engine)
    assert answers(events) == alone


def test_a_sampled_task_decodes_beside_the_batch(
    engine: VisionEngine, images: dict[str, Path], alone: dict[str, list[int]]
) -> None:
    sampled = TASKS[0].model_copy(update={"task_id": "s", "temperature": 1.0, "seed": 7})
    engine.admit(Admission(task=sampled, inputs=images))
    reference = answers(run_all(engine))["s"]
    engine.admit(Admission(task=TASKS[1], inputs=images))
    engine.admit(Admission(task=sampled, inputs=images))
    engine.admit(Admission(task=TASKS[2], inputs=images))
    found = answers(run_all(engine))
    assert found == {"b": alone["b"], "s": reference, "c": alone["c"]}


def test_a_cancelled_row_leaves_the_others_their_tokens(
    engine: VisionEngine, images: dict[str, Path], alone: dict[str, list[int]]
) -> None:
    for task in TASKS[:3]:
        engine.admit(Admission(task=task, inputs=images))
    events = engine.step() + engine.step()
    engine.cancel("b")
    events += run_all(engine)
    assert {k: v for k, v in answers(events).items() if k != "b"} == {
        "a": alone["a"], "c": alone["c"]}
    ends = {e.task_id: e.status for e in events if isinstance(e, TaskFinished)}
    assert ends == {"a": "completed", "b": "cancelled", "c": "completed"}


@pytest.mark.parametrize(("update", "greedy"), [
    ({}, True),
    ({"temperature": 0.7}, False),
    ({"logit_bias": {5: 2.0}}, False),
    ({"presence_penalty": 0.5}, False),
    ({"frequency_penalty": 0.5}, False),
    ({"repetition_penalty": 1.1}, False),
    ({"repetition_penalty": 1.0}, True),
    ({"seed": 3, "top_p": 0.5}, True),  # no draw at temperature 0: the seed changes nothing
])
def test_which_tasks_share_the_greedy_batch(update: dict[str, object], greedy: bool) -> None:
    from fleet.runner.vision import is_greedy
    assert is_greedy(TASKS[0].model_copy(update=update)) is greedy
