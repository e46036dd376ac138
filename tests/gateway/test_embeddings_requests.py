"""The embeddings API's pure parts: a request's inputs as a list, the task it becomes (and the
dimensions a card refuses), and the answer put together from the task's events."""

from __future__ import annotations

import asyncio

import pytest

from fleet.errors import FleetError, InvalidParameter
from fleet.gateway.embeddings_api import (
    EmbeddingsRenderer,
    EmbeddingsRequest,
    embeddings_task,
    inputs_of,
)
from fleet.models.catalog import get_card
from fleet.wire.events import EmbeddingChunk, OutputEvent, TaskFinished, Usage


@pytest.mark.parametrize(
    ("raw", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),  # one token array
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_input_form_is_a_list(raw: object, inputs: list) -> None:
    request = EmbeddingsRequest.model_validate({"model": "m", "input": raw})
    assert inputs_of(request.input) == inputs


@pytest.mark.parametrize(
    ("raw", "words"),
    [("", "input[0] is empty"), ([], "at least one"), (["a", ""], "input[1] is empty"),
     ([[1], []], "input[1] is empty"), (["x"] * 2049, "at most 2048")],
)
def test_nothing_to_embed_is_a_400_naming_input(raw: object, words: str) -> None:
    with pytest.raises(InvalidParameter, match=words.replace("[", r"\[")) as refused:
        inputs_of(raw)  # type: ignore[arg-type]
    assert refused.value.param == "input" and refused.value.http_status == 400


@pytest.mark.parametrize(
    ("model", "dimensions", "refused"),
    [("tiny-embed", 16, False), ("tiny-embed", 64, False), ("tiny-embed", 65, True),
     ("smollm2-135m-embed", 576, False), ("smollm2-135m-embed", 256, True)],
)
def test_dimensions_where_the_card_allows(model: str, dimensions: int, refused: bool) -> None:
    card = get_card(model)
    if refused:
        with pytest.raises(InvalidParameter) as error:
            embeddings_task(card, ["x"], encoding="float", dimensions=dimensions, timeout_s=5)
        assert error.value.param == "dimensions"
        return
    task = embeddings_task(card, ["x"], encoding="base64", dimensions=dimensions, timeout_s=5)
    assert task.model == card.id and task.dimensions == dimensions
    assert task.encoding_format == "base64" and task.deadline is not None


def events(*chunks: tuple[int, list]) -> list[OutputEvent]:
    found: list[OutputEvent] = [
        EmbeddingChunk(task_id="t", at=0.0, index=index, encoding_format="float", dimensions=2,
                       embeddings=vectors, forward_pass=1)
        for index, vectors in chunks
    ]
    usage = Usage(prompt_tokens=7, total_tokens=7)
    return [*found, TaskFinished(task_id="t", at=0.0, status="completed", usage=usage)]


def test_the_answer_is_in_input_order_whatever_order_the_events_came_in() -> None:
    renderer = EmbeddingsRenderer("tiny-embed", 3)
    body = asyncio.run(renderer.body(events((2, [[5.0, 6.0]]), (0, [[1.0, 2.0], [3.0, 4.0]]))))
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert [item["embedding"] for item in body["data"]] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert body["object"] == "list" and body["model"] == "tiny-embed"


def test_a_missing_vector_is_an_error_not_a_short_answer() -> None:
    with pytest.raises(FleetError, match="2 vectors for 3 inputs"):
        asyncio.run(EmbeddingsRenderer("m", 3).body(events((0, [[1.0, 2.0], [3.0, 4.0]]))))
