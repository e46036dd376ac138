"""The fault engine's rate knob (tokens_per_s): a measurement pace, on a fake clock."""

from __future__ import annotations

import itertools
from pathlib import Path

from fleet.runner.engine import Admission, EngineConfig, Token
from fleet.runner.fault_engine import FaultEngine, fault_card, parse_knobs
from fleet.wire.events import TaskFinished
from fleet.wire.tasks import TextGeneration


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def test_the_rate_knob_is_parsed() -> None:
    assert parse_knobs("tokens:9 tokens_per_s:250").tokens_per_s == 250
    assert parse_knobs("tokens:9 tokens_per_s:250").tokens == 9
    assert parse_knobs("tokens:9").tokens_per_s is None


def test_paced_tasks_make_tokens_at_their_rate(tmp_path: Path) -> None:
    clock = FakeClock()
    config = EngineConfig(card=fault_card(), model_path=tmp_path, slots=4, images_dir=tmp_path)
    engine = FaultEngine(config, clock=clock, sleep=clock.sleep)
    rates = {"fast": 200, "slow": 50}
    for task_id, rate in rates.items():
        engine.admit(Admission(task=TextGeneration(
            task_id=task_id, model="fault-llm", prompt=f"tokens:6 tokens_per_s:{rate}",
            max_tokens=100,
        )))
    made: dict[str, list[float]] = {task_id: [] for task_id in rates}
    finished: set[str] = set()
    for _ in range(1000):
        if engine.active == 0:
            break
        for event in engine.step():
            if isinstance(event, Token):
                made[event.task_id].append(event.at)
            elif isinstance(event, TaskFinished):
                finished.add(event.task_id)
    assert finished == set(rates)
    for task_id, rate in rates.items():
        times = made[task_id]
        assert len(times) == 6
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert min(gaps) >= 1 / rate - 1e-9, (task_id, gaps)
        assert max(gaps) <= 1 / rate + 1e-9, (task_id, gaps)


def test_a_continuation_that_had_every_token_ends_without_another(tmp_path: Path) -> None:
    """The worker lost before its terminal, after the last token was stored: the continued
    attempt ends at once (the text engine's `_ended_before`), never with token `tokens`."""
    clock = FakeClock()
    config = EngineConfig(card=fault_card(), model_path=tmp_path, slots=4, images_dir=tmp_path)
    engine = FaultEngine(config, clock=clock, sleep=clock.sleep)
    task = TextGeneration(task_id="t", model="fault-llm", prompt="tokens:3", max_tokens=100)
    engine.admit(Admission(task=task, generated=(0, 1, 2)))
    events = engine.step()
    assert [type(e) for e in events] == [TaskFinished]
    assert events[0].usage is not None and events[0].usage.completion_tokens == 3
    assert engine.active == 0


def test_a_command_ends_an_idle_paced_wait(tmp_path: Path) -> None:
    """A paced task's next token is a second away: a step with a command waiting (`wake`,
    as the runner's pipe reader calls it) returns at once with nothing made, so the command
    is admitted now; without the wake the step would idle that second and make the token."""
    config = EngineConfig(card=fault_card(), model_path=tmp_path, slots=4, images_dir=tmp_path)
    engine = FaultEngine(config)  # the real clock and idle wait
    engine.admit(Admission(task=TextGeneration(
        task_id="paced", model="fault-llm", prompt="tokens:3 tokens_per_s:1", max_tokens=10)))
    assert [type(e) for e in engine.step()] == [Token]  # the first is due at once
    engine.wake()
    assert engine.step() == []
    assert engine.active == 1
