"""A continued text task (its first attempt died after k tokens) yields, token for token, what
an uninterrupted run yields: for greedy, seeded sampling, penalties, stop strings, a JSON
schema, a forced tool call and logprobs, alone and in a batch. Real mlx-lm on tiny-llm."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fleet.runner.engine import Admission
from fleet.wire.tasks import TextGeneration
from tests.runner.test_text_engine import (
    NO_EOS,
    THREE_ANSWERS,
    WEATHER,
    Outcome,
    make_engine,
    run,
    text_task,
)

# fleet.runner's modules are imported where used, not at the top: they import mlx-lm, which
# pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from fleet.runner.text import TextEngine


@pytest.fixture(scope="module")
def engine(tiny_llm_dir: Path) -> Iterator[TextEngine]:
    engine = make_engine(tiny_llm_dir)
    engine.warm_up()
    yield engine
    engine.close()


def continued(engine: TextEngine, task: TextGeneration, generated: list[int]) -> Outcome:
    """Run `task` as a continuation after `generated`; the outcome's chunks start at index k."""
    outcome = Outcome()
    outcome.tokens[task.task_id] = [None] * len(generated)  # type: ignore[list-item]
    engine.admit(Admission(task=task, generated=tuple(generated)))
    while engine.active:
        outcome.add(engine.step())
    assert task.task_id in outcome.finished
    return outcome


CASES = {
    "greedy": {"max_tokens": 24, "logit_bias": NO_EOS},
    "seeded": {"max_tokens": 24, "temperature": 0.8, "seed": 11, "logit_bias": NO_EOS},
    "top-p": {"max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 5, "logit_bias": NO_EOS},
    "frequency": {"max_tokens": 24, "frequency_penalty": 1.5, "logit_bias": NO_EOS},
    "presence+repetition": {
        "max_tokens": 24, "presence_penalty": 1.0, "repetition_penalty": 1.3,
        "logit_bias": NO_EOS,
    },
    "logprobs": {"max_tokens": 16, "logprobs": True, "top_logprobs": 3, "logit_bias": NO_EOS},
    "json_schema": {
        "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": THREE_ANSWERS},
    },
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seam", [1, 7])
def test_a_continued_task_equals_an_uninterrupted_one(
    engine: TextEngine, name: str, seam: int
) -> None:
    whole = run(engine, text_task("whole", **CASES[name]))
    chunks = whole.tokens["whole"]
    assert len(chunks) > seam
    rest = continued(engine, text_task("rest", **CASES[name]), whole.ids("whole")[:seam])
    tail = rest.tokens["rest"][seam:]
    assert [c.token_id for c in tail] == [c.token_id for c in chunks[seam:]]
    assert [c.index for c in tail] == list(range(seam, len(chunks)))
    assert "".join(c.text for c in chunks[:seam] + tail) == whole.text("whole")
    assert [c.logprob for c in tail] == [c.logprob for c in chunks[seam:]]
    done, expected = rest.finished["rest"], whole.finished["whole"]
    assert done.finish_reason == expected.finish_reason
    assert done.usage.completion_tokens == expected.usage.completion_tokens  # counted once
    if name == "json_schema":
        json.loads("".join(c.text for c in chunks[:seam] + tail))


def test_a_continued_task_equals_an_uninterrupted_one_in_a_batch(engine: TextEngine) -> None:
    fields = CASES["seeded"]
    whole = run(engine, text_task("whole", **fields)).ids("whole")
    outcome = Outcome()
    outcome.tokens["rest"] = [None] * 5  # type: ignore[list-item]
    engine.admit(Admission(task=text_task("other", max_tokens=30, logit_bias=NO_EOS)))
    engine.admit(Admission(task=text_task("rest", **fields), generated=tuple(whole[:5])))
    while engine.active:
        outcome.add(engine.step())
    assert [c.token_id for c in outcome.tokens["rest"][5:]] == whole[5:]


def test_a_stop_string_across_the_seam_is_still_held_back_and_found(engine: TextEngine) -> None:
    fields = {"max_tokens": 40, "logit_bias": NO_EOS}
    free = run(engine, text_task("free", **fields))
    text = free.text("free")
    stop = text[10:16]  # a string that spans several tokens, somewhere in the middle
    whole = run(engine, text_task("whole", stop=[stop], **fields))
    ids = whole.ids("whole")
    for seam in range(1, len(ids)):
        rest = continued(engine, text_task("rest", stop=[stop], **fields), ids[:seam])
        shown = whole.tokens["whole"][:seam] + rest.tokens["rest"][seam:]
        assert "".join(c.text for c in shown) == whole.text("whole")
        assert rest.finished["rest"].finish_reason == "stop"


def test_a_forced_tool_call_continues_into_the_same_call(engine: TextEngine) -> None:
    fields = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_tokens": 48,
    }
    whole = run(engine, text_task("whole", **fields))
    ids = whole.ids("whole")
    rest = continued(engine, text_task("rest", **fields), ids[:3])
    assert [c.token_id for c in rest.tokens["rest"][3:]] == ids[3:]
    [call] = rest.calls["rest"]
    assert call.name == "get_weather" and call.index == 0
    assert rest.finished["rest"].finish_reason == "tool_calls"


def test_a_stream_that_had_already_ended_finishes_without_a_new_token(
    engine: TextEngine,
) -> None:
    whole = run(engine, text_task("whole", max_tokens=6, logit_bias=NO_EOS))
    rest = continued(engine, text_task("rest", max_tokens=6), whole.ids("whole"))
    assert rest.tokens["rest"][6:] == []
    assert rest.finished["rest"].finish_reason == "length"
    assert rest.finished["rest"].usage.completion_tokens == 6


def test_token_seeds_are_a_pure_function_of_seed_and_index() -> None:
    from fleet.runner.sampling import token_seed
    assert token_seed(7, 3) == token_seed(7, 3)
    seeds = {token_seed(seed, index) for seed in range(20) for index in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= s < 1 << 64 for s in seeds)
