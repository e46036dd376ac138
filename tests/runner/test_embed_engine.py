"""The embedding engine in-process: tasks admitted together share a forward pass, a cancel
ends its task once, over-long inputs are refused or cut as the task says; and SmolLM2's real
weights give vectors whose similarities mean something."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from fleet.errors import TaskRejected
from fleet.models.catalog import get_card
from fleet.runner.engine import Admission, EngineConfig
from fleet.wire.events import EmbeddingChunk, OutputEvent, TaskFinished
from fleet.wire.tasks import Embeddings

# fleet.runner.embed is imported where used, not at the top: it imports mlx-lm, which pulls in
# transformers (1.2 s of CPU), and collection imports this module in every xdist worker
# (issue 28).
if TYPE_CHECKING:
    from fleet.runner.embed import EmbeddingEngine


def engine_for(model: str, path: Path) -> EmbeddingEngine:
    from fleet.runner.embed import EmbeddingEngine
    engine = EmbeddingEngine(EngineConfig(card=get_card(model), model_path=path, slots=8,
                                          images_dir=path))
    engine.load(lambda done, total: None)
    return engine


@pytest.fixture(scope="module")
def tiny(tiny_embed_dir: Path) -> EmbeddingEngine:
    return engine_for("tiny-embed", tiny_embed_dir)


def run_all(engine: EmbeddingEngine) -> list[OutputEvent]:
    """Step until every admitted task has ended (a step may wait for inputs to join it)."""
    events: list[OutputEvent] = []
    while engine.active:
        events += engine.step()
    return events


def task(task_id: str, inputs: list, **fields: object) -> Admission:
    return Admission(task=Embeddings(task_id=task_id, model="tiny-embed", input=inputs,
                                     **fields))  # type: ignore[arg-type]


def test_tasks_admitted_together_share_one_forward_pass(tiny: EmbeddingEngine) -> None:
    for index in range(3):
        tiny.admit(task(f"together-{index}", [f"text {index}", "shared"]))
    before = tiny.forward_passes
    events = run_all(tiny)
    assert tiny.forward_passes == before + 1 and tiny.active == 0
    chunks = [e for e in events if isinstance(e, EmbeddingChunk)]
    assert {c.forward_pass for c in chunks} == {before + 1}
    finished = [e for e in events if isinstance(e, TaskFinished)]
    assert [f.task_id for f in finished] == ["together-0", "together-1", "together-2"]
    assert all(f.status == "completed" and f.stats and f.stats.batched_with == 2
               for f in finished)


def test_a_cancelled_task_ends_once_and_others_go_on(tiny: EmbeddingEngine) -> None:
    tiny.admit(task("stays", ["hello"]))
    tiny.admit(task("goes", ["hello"]))
    tiny.cancel("goes")
    events = run_all(tiny)
    ends = {e.task_id: e.status for e in events if isinstance(e, TaskFinished)}
    assert ends == {"goes": "cancelled", "stays": "completed"}
    assert tiny.active == 0


def test_too_long_is_refused_unless_the_task_says_cut(tiny: EmbeddingEngine) -> None:
    with pytest.raises(TaskRejected) as refused:
        tiny.admit(task("long", [[1] * 3000]))
    assert refused.value.code == "context_length"
    tiny.admit(task("cut", [[1] * 3000], truncate=True))
    (finished,) = [e for e in run_all(tiny) if isinstance(e, TaskFinished)]
    assert finished.usage and finished.usage.prompt_tokens == 2048  # the card's context


def test_unknown_tokens_are_refused(tiny: EmbeddingEngine) -> None:
    with pytest.raises(TaskRejected, match="not in the model's vocabulary"):
        tiny.admit(task("bad", [[5, 100_000]]))


def test_smollm2_vectors_put_paraphrases_closest(smollm2_dir: Path) -> None:
    engine = engine_for("smollm2-135m-embed", smollm2_dir)
    texts = ["The capital of France is Paris.", "Paris is the capital city of France.",
             "I like to eat bananas and apples.", "Fruit such as apples and bananas is good."]
    engine.admit(Admission(task=Embeddings(task_id="real", model="smollm2-135m-embed",
                                           input=texts)))
    chunks = [e for e in run_all(engine) if isinstance(e, EmbeddingChunk)]
    vectors = np.array([v for c in chunks for v in c.embeddings])
    assert vectors.shape == (4, 576)
    similar = vectors @ vectors.T
    assert similar[0, 1] > max(similar[0, 2], similar[0, 3]) + 0.1
    assert similar[2, 3] > max(similar[2, 0], similar[2, 1]) + 0.1
