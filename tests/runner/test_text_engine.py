"""The text engine on real mlx-lm with the tiny random model (and SmolLM2 for one real answer).

Random weights make greedy decoding repeat a token and sampling hit EOS early, so tests that
need N tokens decode greedily or ban EOS with a logit bias.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fleet.errors import TaskRejected
from fleet.runner.engine import Admission, EngineConfig, EngineEvent, Token
from fleet.wire.cluster import ModelCard
from fleet.wire.events import ErrorReason, TaskFinished, TokenChunk, ToolCallChunk
from fleet.wire.tasks import TextGeneration

# fleet.runner's modules are imported where used, not at the top: they import mlx-lm, which
# pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from fleet.runner.text import TextEngine

EOS = 2  # <|im_end|> in tiny-llm's vocabulary
NO_EOS = {EOS: -100.0}


def make_engine(
    model_dir: Path, slots: int = 4, progress: list[tuple[int, int]] | None = None, **extra: str
) -> TextEngine:
    from fleet.runner.text import TextEngine
    card = ModelCard(
        id="tiny-llm", name="tiny-llm", tasks=["text_generation"], family="mlx_lm", source="test"
    )
    config = EngineConfig(
        card=card, model_path=model_dir, slots=slots, images_dir=model_dir, extra=extra
    )
    engine = TextEngine(config)
    reports = progress if progress is not None else []
    engine.load(lambda done, total: reports.append((done, total)))
    return engine


@pytest.fixture(scope="module")
def engine(tiny_llm_dir: Path) -> Iterator[TextEngine]:
    engine = make_engine(tiny_llm_dir)
    engine.warm_up()
    yield engine
    engine.close()


def text_task(task_id: str, **fields: object) -> TextGeneration:
    fields.setdefault("temperature", 0.0)
    if "messages" not in fields and "prompt" not in fields:
        fields["prompt"] = "The quick brown fox"
    return TextGeneration(task_id=task_id, model="tiny-llm", **fields)  # type: ignore[arg-type]


class Outcome:
    """Everything the engine emitted, checked on the way: chunks in order, nothing after the
    one TaskFinished, and usage that counts exactly the chunks emitted."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[TokenChunk]] = {}
        self.finished: dict[str, TaskFinished] = {}
        self.calls: dict[str, list[ToolCallChunk]] = {}

    def add(self, events: Sequence[EngineEvent]) -> None:
        for event in events:
            assert event.task_id not in self.finished, f"event after TaskFinished: {event}"
            chunks = self.tokens.setdefault(event.task_id, [])
            if isinstance(event, Token):  # a plain token, as the engine makes it
                event = event.chunk()
            if isinstance(event, TokenChunk):
                assert event.index == len(chunks)
                chunks.append(event)
            elif isinstance(event, ToolCallChunk):
                self.calls.setdefault(event.task_id, []).append(event)
            elif isinstance(event, TaskFinished):
                assert event.usage is not None
                assert event.usage.completion_tokens == len(chunks)
                self.finished[event.task_id] = event

    def ids(self, task_id: str) -> list[int]:
        return [chunk.token_id for chunk in self.tokens.get(task_id, [])]

    def text(self, task_id: str) -> str:
        return "".join(chunk.text for chunk in self.tokens.get(task_id, []))


def run(engine: TextEngine, *tasks: TextGeneration, outcome: Outcome | None = None) -> Outcome:
    outcome = outcome or Outcome()
    for task in tasks:
        engine.admit(Admission(task=task))
    while engine.active:
        outcome.add(engine.step())
    assert {task.task_id for task in tasks} <= set(outcome.finished)
    return outcome


def test_load_reports_progress_layer_by_layer(tiny_llm_dir: Path) -> None:
    progress: list[tuple[int, int]] = []
    make_engine(tiny_llm_dir, progress=progress).close()
    assert progress == [(0, 2), (1, 2), (2, 2)]  # tiny-llm has two layers


def test_greedy_decoding_is_deterministic(engine: TextEngine) -> None:
    first = run(engine, text_task("a", max_tokens=12, logit_bias=NO_EOS))
    second = run(engine, text_task("b", max_tokens=12, logit_bias=NO_EOS))
    assert first.ids("a") == second.ids("b")
    assert len(first.ids("a")) == 12


def test_seed_gives_the_same_tokens_alone_and_batched(engine: TextEngine) -> None:
    def sampled(task_id: str, seed: int, prompt: str = "Hello! How can") -> TextGeneration:
        return text_task(
            task_id, prompt=prompt, temperature=1.0, seed=seed, max_tokens=16, logit_bias=NO_EOS
        )

    alone = run(engine, sampled("alone", seed=7))
    batched = run(
        engine,
        sampled("other-1", seed=1, prompt="The capital of France"),
        sampled("other-2", seed=2),
        sampled("again", seed=7),
    )
    assert batched.ids("again") == alone.ids("alone")
    assert batched.ids("other-2") != alone.ids("alone")


PROMPTS = ["The quick brown fox", "Hello! How can", "1 2 3 4", "def add(a, b):"]


def test_batched_greedy_equals_single_stream(engine: TextEngine) -> None:
    def greedy(index: int) -> TextGeneration:
        return text_task(
            f"p{index}", prompt=PROMPTS[index], max_tokens=16, logit_bias=NO_EOS, logprobs=True
        )

    singles = [run(engine, greedy(index)) for index in range(len(PROMPTS))]
    batched = run(engine, *(greedy(index) for index in range(len(PROMPTS))))
    for index, single in enumerate(singles):
        task_id = f"p{index}"
        assert batched.ids(task_id) == single.ids(task_id)
        for one, many in zip(single.tokens[task_id], batched.tokens[task_id], strict=True):
            assert one.logprob == pytest.approx(many.logprob, abs=1e-4)
        assert batched.finished[task_id].stats.batched_with == len(PROMPTS) - 1


def test_a_task_admitted_mid_batch_joins_the_running_batch(engine: TextEngine) -> None:
    # The first task starts alone and moves into the batch when the second arrives; its
    # sampler's key goes with it, so its tokens do not change.
    long = text_task("long", max_tokens=40, temperature=0.9, seed=5, logit_bias=NO_EOS)
    late = text_task("late", prompt="Hello! How can", max_tokens=8, logit_bias=NO_EOS)
    outcome = Outcome()
    engine.admit(Admission(task=long))
    while len(outcome.tokens.get("long", [])) < 5:
        outcome.add(engine.step())
    engine.admit(Admission(task=late))
    while "late" not in outcome.finished:
        outcome.add(engine.step())
    assert "long" not in outcome.finished, "the late task had to wait for the batch to drain"
    run(engine, outcome=outcome)

    assert outcome.ids("long") == run(engine, long).ids("long")
    assert outcome.ids("late") == run(engine, late).ids("late")
    assert outcome.finished["late"].stats.batched_with == 1


def test_stop_string_ends_the_task_without_showing_it(engine: TextEngine) -> None:
    def sampled(task_id: str, stop: list[str]) -> TextGeneration:
        return text_task(
            task_id, temperature=1.0, seed=11, max_tokens=24, logit_bias=NO_EOS, stop=stop
        )

    free = run(engine, sampled("free", stop=[]))
    full_text = free.text("free")
    # A stop string across two tokens' text, so it can only be caught by holding text back.
    texts = [chunk.text for chunk in free.tokens["free"]]
    start = next(i for i in range(4, len(texts) - 1) if texts[i] and texts[i + 1])
    stop = texts[start][-1] + texts[start + 1][:1]
    expected = full_text[: full_text.index(stop)]

    stopped = run(engine, sampled("stopped", stop=["never appears", stop]))
    assert stopped.finished["stopped"].finish_reason == "stop"
    assert stopped.text("stopped") == expected
    assert stop not in stopped.text("stopped")


def test_max_tokens_ends_with_length(engine: TextEngine) -> None:
    outcome = run(engine, text_task("short", max_tokens=5, logit_bias=NO_EOS))
    finished = outcome.finished["short"]
    assert finished.finish_reason == "length"
    assert finished.usage is not None
    assert finished.usage.completion_tokens == 5
    assert finished.usage.total_tokens == finished.usage.prompt_tokens + 5


def test_end_of_sequence_ends_with_stop(engine: TextEngine) -> None:
    outcome = run(engine, text_task("eos", max_tokens=5, logit_bias={EOS: 100.0}))
    assert outcome.finished["eos"].finish_reason == "stop"
    assert outcome.ids("eos") == [EOS]
    assert outcome.text("eos") == ""


def test_chat_messages_use_the_template_and_report_stats(engine: TextEngine) -> None:
    task = text_task(
        "chat",
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "What is two plus two?"}]},
        ],
        max_tokens=6,
        logit_bias=NO_EOS,
        logprobs=True,
        top_logprobs=3,
    )
    engine.admit(Admission(task=task, queue_wait_s=0.25))
    outcome = run(engine)
    finished = outcome.finished["chat"]
    assert finished.status == "completed"
    assert finished.usage is not None and finished.usage.prompt_tokens > 10
    stats = finished.stats
    assert stats is not None and stats.queue_wait_s == 0.25
    assert stats.time_to_first_token_s is not None and stats.time_to_first_token_s > 0
    assert stats.tokens_per_s is not None and stats.tokens_per_s > 0
    assert stats.total_s is not None and stats.total_s >= stats.time_to_first_token_s
    first = outcome.tokens["chat"][0]
    assert first.top_logprobs is not None and len(first.top_logprobs) == 3
    # Greedy picks the most likely token, which heads the list.
    assert first.top_logprobs[0].token_id == first.token_id
    assert first.top_logprobs[0].logprob == pytest.approx(first.logprob)


def test_prompt_longer_than_the_context_is_rejected(engine: TextEngine) -> None:
    with pytest.raises(TaskRejected) as rejected:
        engine.admit(Admission(task=text_task("huge", prompt="fox " * 3000)))
    assert rejected.value.reason is ErrorReason.CONTEXT_LENGTH
    assert "2048" in rejected.value.message
    assert engine.active == 0


def test_image_parts_are_rejected_by_a_text_model(engine: TextEngine) -> None:
    image = {"type": "image", "sha256": "ab" * 32}
    task = text_task("image", messages=[{"role": "user", "content": [image]}])
    with pytest.raises(TaskRejected) as rejected:
        engine.admit(Admission(task=task))
    assert rejected.value.reason is ErrorReason.UNSUPPORTED
    assert engine.active == 0


def test_cancel_from_another_thread_ends_the_task_at_the_next_step(engine: TextEngine) -> None:
    outcome = Outcome()
    for task_id in ("keep", "drop"):
        engine.admit(Admission(task=text_task(task_id, max_tokens=12, logit_bias=NO_EOS)))
    while len(outcome.tokens.get("drop", [])) < 3:
        outcome.add(engine.step())
    canceller = threading.Thread(target=engine.cancel, args=("drop",))
    canceller.start()
    canceller.join()
    outcome.add(engine.step())
    dropped = outcome.finished["drop"]
    assert dropped.status == "cancelled"
    assert dropped.reason is ErrorReason.CANCELLED
    assert dropped.usage is not None
    assert dropped.usage.completion_tokens == len(outcome.tokens["drop"])
    run(engine, outcome=outcome)
    assert outcome.finished["keep"].finish_reason == "length"
    assert len(outcome.ids("keep")) == 12


def test_top_k_of_one_samples_the_greedy_tokens(engine: TextEngine) -> None:
    greedy = run(engine, text_task("greedy", max_tokens=10, logit_bias=NO_EOS))
    top_one = run(
        engine,
        text_task("top1", max_tokens=10, temperature=1.5, top_k=1, seed=3, logit_bias=NO_EOS),
    )
    assert top_one.ids("top1") == greedy.ids("greedy")


def test_more_tasks_than_slots_are_refused(engine: TextEngine) -> None:
    for index in range(4):
        engine.admit(Admission(task=text_task(f"slot{index}", max_tokens=2)))
    with pytest.raises(TaskRejected) as rejected:
        engine.admit(Admission(task=text_task("one-too-many", max_tokens=2)))
    assert rejected.value.reason is ErrorReason.QUEUE_FULL
    with pytest.raises(TaskRejected) as duplicate:
        engine.admit(Admission(task=text_task("slot0", max_tokens=2)))
    assert duplicate.value.reason is ErrorReason.INVALID_TASK
    outcome = run(engine)
    assert sorted(outcome.finished) == ["slot0", "slot1", "slot2", "slot3"]


def test_cancel_a_task_running_alone(engine: TextEngine) -> None:
    outcome = Outcome()
    engine.admit(Admission(task=text_task("alone", max_tokens=50, logit_bias=NO_EOS)))
    while len(outcome.tokens.get("alone", [])) < 2:
        outcome.add(engine.step())
    engine.cancel("alone")
    engine.cancel("never-admitted")
    outcome.add(engine.step())
    assert outcome.finished["alone"].status == "cancelled"
    assert engine.active == 0
    assert run(engine, text_task("after", max_tokens=3)).finished["after"].status == "completed"


def test_prefix_cache_gives_the_same_tokens_as_a_full_prefill(tiny_llm_dir: Path) -> None:
    system = {"role": "system", "content": "You are a helpful assistant. " * 8}

    def chat(task_id: str, question: str) -> TextGeneration:
        messages = [system, {"role": "user", "content": question}]
        return text_task(task_id, messages=messages, max_tokens=10, logit_bias=NO_EOS)

    uncached = make_engine(tiny_llm_dir, prefix_cache_entries="0")
    cached = make_engine(tiny_llm_dir)
    try:
        questions = ["What is two plus two?", "Write a short poem", "Hello!"]
        expected = [run(uncached, chat(f"q{i}", q)).ids(f"q{i}") for i, q in enumerate(questions)]
        # Sequential tasks reuse the system prompt's cache, as do tasks joining a running one.
        first = run(cached, chat("q0", questions[0]))
        together = run(cached, chat("q1", questions[1]), chat("q2", questions[2]))
        assert first.ids("q0") == expected[0]
        assert together.ids("q1") == expected[1]
        assert together.ids("q2") == expected[2]
        repeated = run(cached, chat("q0", questions[0]))
        assert repeated.ids("q0") == expected[0]
        # Usage says how much prefill the cache saved: nothing cold, the system prompt after.
        saved = [
            outcome.finished[task].usage.cached_tokens
            for outcome, task in [(first, "q0"), (together, "q1"), (together, "q2")]
        ]
        prompt_tokens = first.finished["q0"].usage.prompt_tokens
        assert saved[0] == 0 and 0 < saved[1] < prompt_tokens and 0 < saved[2] < prompt_tokens
        assert repeated.finished["q0"].usage.cached_tokens >= saved[1]
    finally:
        uncached.close()
        cached.close()


def test_a_random_schedule_gives_every_task_its_tokens_alone(tiny_llm_dir: Path) -> None:
    """Admissions, cancels, stop strings and shared prompts in a seeded random order: each
    completed task must produce exactly the tokens it produces alone on a fresh engine."""
    chooser = random.Random(0)
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}

    def random_task(index: int) -> TextGeneration:
        fields: dict[str, Any] = {
            "max_tokens": chooser.randrange(1, 16),
            "temperature": chooser.choice([0.0, 0.7, 1.2]),
            "seed": index,
            "logit_bias": NO_EOS if chooser.random() < 0.7 else None,
            "stop": [chooser.choice(["a", "e ", "th"])] if chooser.random() < 0.3 else [],
        }
        question = chooser.choice(["Hello", "What is two plus two?", "1 2 3"])
        if chooser.random() < 0.3:
            fields["prompt"] = question
        else:
            fields["messages"] = [system, {"role": "user", "content": question}]
        return text_task(f"r{index}", **fields)

    engine = make_engine(tiny_llm_dir)
    alone = make_engine(tiny_llm_dir, slots=1, prefix_cache_entries="0")
    try:
        outcome, admitted = Outcome(), {}
        while len(admitted) < 24 or engine.active:
            if len(admitted) < 24 and engine.active < 4 and chooser.random() < 0.4:
                task = random_task(len(admitted))
                engine.admit(Admission(task=task))
                admitted[task.task_id] = task
            if engine.active and chooser.random() < 0.08:
                engine.cancel(chooser.choice(list(admitted)))
            outcome.add(engine.step())
        assert set(outcome.finished) == set(admitted)
        for task_id, finished in outcome.finished.items():
            if finished.status == "completed":
                assert outcome.ids(task_id) == run(alone, admitted[task_id]).ids(task_id)
    finally:
        engine.close()
        alone.close()


def test_smollm2_answers_paris(smollm2_dir: Path) -> None:
    engine = make_engine(smollm2_dir, slots=1)
    try:
        question = {"role": "user", "content": "What is the capital of France?"}
        outcome = run(engine, text_task("paris", messages=[question], max_tokens=24))
        assert "Paris" in outcome.text("paris")
    finally:
        engine.close()


YES_OR_NO = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_a_json_schema_is_kept_token_by_token_and_ends_the_task(engine: TextEngine) -> None:
    task = text_task(
        "schema", max_tokens=40, response_format={"type": "json_schema", "json_schema": YES_OR_NO}
    )
    outcome = run(engine, task)
    # Random weights left to themselves write anything; masked, they can only answer.
    assert json.loads(outcome.text("schema")) in ({"answer": "yes"}, {"answer": "no"})
    assert outcome.finished["schema"].finish_reason == "stop"


def test_json_mode_in_a_batch_leaves_its_neighbours_as_they_were(engine: TextEngine) -> None:
    free = text_task("free", max_tokens=12, logit_bias=NO_EOS)
    alone = run(engine, free).ids("free")
    together = run(
        engine,
        text_task("json", max_tokens=12, response_format={"type": "json_object"}),
        text_task("free", max_tokens=12, logit_bias=NO_EOS),
    )
    assert together.ids("free") == alone
    json_text = together.text("json")
    assert json_text.startswith("{") and together.finished["json"].status == "completed"
    if together.finished["json"].finish_reason == "stop":
        assert isinstance(json.loads(json_text), dict)


def test_a_schema_that_cannot_be_compiled_is_an_invalid_task(engine: TextEngine) -> None:
    broken = {"type": "json_schema", "json_schema": {"type": "no-such-type"}}
    with pytest.raises(TaskRejected) as rejected:
        engine.admit(Admission(task=text_task("broken", response_format=broken)))
    assert rejected.value.reason is ErrorReason.INVALID_TASK
    assert "no-such-type" in rejected.value.message
    assert engine.active == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False,
}}}


def tool_task(task_id: str, tool_choice: object) -> TextGeneration:
    return text_task(
        task_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=48,
    )


def test_a_named_tool_choice_makes_the_model_call_that_function(engine: TextEngine) -> None:
    outcome = run(engine, tool_task("forced", {"type": "function", "name": "get_weather"}))
    [call] = outcome.calls["forced"]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert outcome.text("forced") == "" and outcome.finished["forced"].finish_reason == "tool_calls"


def test_tool_choice_required_gives_calls_of_the_offered_tools_only(engine: TextEngine) -> None:
    outcome = run(engine, tool_task("required", "required"))
    calls = outcome.calls["required"]
    assert calls, "a required tool choice must produce a call"
    for call in calls:
        assert call.name in ("get_weather", "get_time")
        expected = {"city"} if call.name == "get_weather" else set()
        assert set(json.loads(call.arguments)) == expected


THREE_ANSWERS = {
    "type": "object",
    "properties": {
        "first": {"enum": ["yes", "no"]},
        "second": {"enum": ["yes", "no"]},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["first", "second", "colour"],
    "additionalProperties": False,
}


def test_a_constrained_task_keeps_its_grammar_when_it_moves_into_the_batch(
    engine: TextEngine,
) -> None:
    shaped = {"type": "json_schema", "json_schema": THREE_ANSWERS}
    alone = run(engine, text_task("alone", max_tokens=60, response_format=shaped))
    outcome = Outcome()
    engine.admit(Admission(task=text_task("moved", max_tokens=60, response_format=shaped)))
    while len(outcome.tokens.get("moved", [])) < 4:  # mid-object, decoding alone
        outcome.add(engine.step())
    engine.admit(Admission(task=text_task("joiner", max_tokens=8, logit_bias=NO_EOS)))
    run(engine, outcome=outcome)
    assert outcome.finished["joiner"].stats.batched_with == 1
    assert outcome.ids("moved") == alone.ids("alone")
    answer = json.loads(outcome.text("moved"))
    assert set(answer) == {"first", "second", "colour"}
    assert answer["colour"] in ("red", "green", "blue")


def test_penalties_count_the_completion_and_hold_alone_and_batched(engine: TextEngine) -> None:
    def task(task_id: str, **penalties: float) -> TextGeneration:
        return text_task(task_id, max_tokens=16, logit_bias=NO_EOS, **penalties)  # type: ignore[arg-type]

    plain = run(engine, task("plain")).ids("plain")
    assert len(set(plain)) < len(plain) / 2  # random weights: greedy loops on a few tokens
    penalised = run(engine, task("freq", frequency_penalty=2.0)).ids("freq")
    assert len(set(penalised)) > len(set(plain))
    present = run(engine, task("presence", presence_penalty=2.0)).ids("presence")
    assert present != plain
    batched = run(
        engine, task("freq-b", frequency_penalty=2.0), task("presence-b", presence_penalty=2.0),
        task("plain-b"),
    )
    assert batched.ids("freq-b") == penalised
    assert batched.ids("presence-b") == present
    assert batched.ids("plain-b") == plain
    moved = Outcome()  # starts alone, moves into the batch mid-completion, keeps its counts
    engine.admit(Admission(task=task("moved", frequency_penalty=2.0)))
    while len(moved.tokens.get("moved", [])) < 5:
        moved.add(engine.step())
    engine.admit(Admission(task=task("joiner")))
    run(engine, outcome=moved)
    assert moved.finished["joiner"].stats.batched_with == 1
    assert moved.ids("moved") == penalised


def test_after_a_batch_a_lone_task_reads_its_prompt_in_a_ramp_that_newcomers_join(
    engine: TextEngine,
) -> None:
    """An engine that just ran tasks together expects more: a lone task reads its prompt in
    short chunks (prefill_ramp.py), so a task arriving meanwhile joins after one short step;
    every task's tokens are those it makes alone."""
    # Prompts that share no prefix: the prefix cache must not shorten the reads counted.
    prompts = [f"{start} quick brown fox jumps over the lazy dog, then naps. " * 7
               for start in ("One", "Two", "Six")]

    def steps_to_first_token(task: TextGeneration) -> tuple[int, Outcome]:
        outcome, steps = Outcome(), 0
        engine.admit(Admission(task=task))
        while not outcome.tokens.get(task.task_id):
            outcome.add(engine.step())
            steps += 1
        run(engine, outcome=outcome)
        return steps, outcome

    run(engine, text_task("lone", max_tokens=2))
    whole_task = text_task("whole", prompt=prompts[0], max_tokens=4, logit_bias=NO_EOS)
    whole_steps, whole = steps_to_first_token(whole_task)  # after a lone task: read whole
    assert whole.finished["whole"].usage.prompt_tokens > 130
    run(engine, text_task("b1", max_tokens=2), text_task("b2", max_tokens=2))
    ramped_task = text_task("ramped", prompt=prompts[1], max_tokens=4, logit_bias=NO_EOS)
    ramped_steps, ramped = steps_to_first_token(ramped_task)
    assert ramped_steps >= whole_steps + 4  # 16, 16, 32, 64, ... instead of one read
    assert ramped.ids("ramped") == run(engine, ramped_task).ids("ramped")

    # A newcomer after the first short chunk: both move into the batch mid-prompt.
    run(engine, text_task("b3", max_tokens=2), text_task("b4", max_tokens=2))
    first = text_task("first", prompt=prompts[2], max_tokens=6, temperature=0.8, seed=3)
    joiner = text_task("joiner", prompt="Hello! How can", max_tokens=6, logit_bias=NO_EOS)
    outcome = Outcome()
    engine.admit(Admission(task=first))
    outcome.add(engine.step())
    assert not outcome.tokens.get("first"), "the first chunk was the whole prompt"
    engine.admit(Admission(task=joiner))
    run(engine, outcome=outcome)
    assert outcome.ids("first") == run(engine, first).ids("first")
    assert outcome.ids("joiner") == run(engine, joiner).ids("joiner")


def test_a_burst_onto_an_idle_engine_is_read_in_two_groups(engine: TextEngine) -> None:
    """Several prompts at once: the first to arrive, just over half, are read and get their
    first tokens before the rest start (burst_split.py); every task's tokens are its own."""
    tasks = [
        text_task(f"burst{index}", prompt=PROMPTS[index % len(PROMPTS)] + f" {index}",
                  max_tokens=6, logit_bias=NO_EOS)
        for index in range(4)  # the engine's 4 slots: 3 first, then 1
    ]
    outcome, first_step = Outcome(), {}
    for task in tasks:
        engine.admit(Admission(task=task))
    step = 0
    while engine.active:
        outcome.add(engine.step())
        step += 1
        for task in tasks:
            if outcome.tokens.get(task.task_id):
                first_step.setdefault(task.task_id, step)
    early = [first_step[task.task_id] for task in tasks[:3]]
    assert len(set(early)) == 1, "the first group is read together"
    assert first_step["burst3"] > early[0], "the last arrival waited for the first group"
    for task in tasks:
        assert outcome.ids(task.task_id) == run(engine, task).ids(task.task_id)


def test_a_lone_task_that_had_started_stays_ahead_of_a_burst(engine: TextEngine) -> None:
    """Tasks arriving while a lone task runs go into the batch behind it: it keeps decoding
    at every step, in the burst's first group (burst_split.py)."""
    lead = text_task("lead", prompt="Hello! How can", max_tokens=12, logit_bias=NO_EOS)
    burst = [
        text_task(f"late{index}", prompt=PROMPTS[index] + " again", max_tokens=4,
                  logit_bias=NO_EOS)
        for index in range(3)  # with the lead, the engine's 4 slots: lead + 2 first, then 1
    ]
    outcome, first_step = Outcome(), {}
    engine.admit(Admission(task=lead))
    while not outcome.tokens.get("lead"):
        outcome.add(engine.step())
    for task in burst:
        engine.admit(Admission(task=task))
    step, lead_tokens = 0, [len(outcome.tokens["lead"])]
    while engine.active:
        outcome.add(engine.step())
        step += 1
        lead_tokens.append(len(outcome.tokens.get("lead", [])))
        for task in burst:
            if outcome.tokens.get(task.task_id):
                first_step.setdefault(task.task_id, step)
    assert all(b - a == 1 for a, b in itertools.pairwise(lead_tokens)
               if b < 12), f"the lead waited for the burst: {lead_tokens}"
    assert first_step["late0"] == first_step["late1"] < first_step["late2"]
    for task in (lead, *burst):
        assert outcome.ids(task.task_id) == run(engine, task).ids(task.task_id)
