"""The runner's wait for company: the window's rule as a table, and the loop taking a task
that arrives within it before the idle engine's first step, on the fault engine (the
plumbing) and on the real text engine with tiny-llm (the bench's burst8 cells measure it)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.runner.company import WINDOW_CAP_S, StepClock, window_s
from fleet.runner.engine import EngineConfig, EngineEvent
from fleet.runner.fault_engine import FaultEngine, fault_card
from fleet.runner.machine import RunnerMachine
from fleet.runner.main import PipeBroken, engine_config, serve
from fleet.runner.text import TextEngine
from fleet.wire.cluster import ModelCard
from fleet.wire.events import TaskFinished
from fleet.wire.pipe import (
    ConnectToGroup,
    LoadModel,
    RunnerCommand,
    Shutdown,
    SubmitTask,
    WarmUp,
)
from fleet.wire.tasks import TextGeneration
from tests.runner.test_machine import AT, make_spec, submit


@pytest.mark.parametrize(("typical", "share", "window"), [
    (None, 0.25, 0.0),  # no step measured yet: no wait
    (0.08, 0.0, 0.0),  # an engine that does not ask for it
    (0.008, 0.25, 0.002),  # a fast engine: a quarter of its step
    (0.04, 0.25, 0.01),
    (0.5, 0.25, WINDOW_CAP_S),  # a slow one: never more than the cap
])
def test_the_window_is_a_share_of_a_typical_step_with_a_cap(
    typical: float | None, share: float, window: float
) -> None:
    assert window_s(typical, share) == pytest.approx(window)


def test_the_typical_step_follows_the_measured_ones() -> None:
    clock = StepClock()
    assert clock.typical_s is None
    clock.add(0.1)
    assert clock.typical_s == pytest.approx(0.1)
    for _ in range(50):
        clock.add(0.01)
    assert clock.typical_s == pytest.approx(0.01, rel=0.05)


class GatheringFaultEngine(FaultEngine):
    """The fault engine asking for company, recording how many tasks each step ran."""

    company_share = 1000.0  # the window is then the cap, whatever a fault step takes

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, clock=lambda: AT, sleep=lambda _: None)
        self.widths: list[int] = []

    def step(self) -> list[EngineEvent]:
        self.widths.append(self.active)
        return list(super().step())


class Arrivals(queue.Queue[RunnerCommand | PipeBroken]):
    """An inbox that receives `later` once the loop waits on it for a while (a get with a
    timeout: the window), or has nothing else to do (a blocking get of an empty inbox): as a
    burst's next task reaches a runner just after its first."""

    def __init__(self) -> None:
        super().__init__()
        self.later: list[RunnerCommand] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block and self.later and (timeout is not None or self.empty()):
            for command in self.later:
                self.put(command)
            self.later.clear()
        return super().get(block, timeout)


def run_a_burst_after_a_warm_task(
    machine: RunnerMachine, widths: list[int], task: Callable[[str, int], SubmitTask],
    inbox: Arrivals, emitted: list[Any],
) -> int:
    """A warm task (so a step is measured), then a burst whose second task arrives only
    while the loop waits: the engine's task count at the burst's first step."""
    finished: list[str] = []
    burst_from: list[int] = []  # the index of the burst's first step in `widths`

    def emit(report: Any) -> None:
        if isinstance(report, TaskFinished):
            finished.append(report.task_id)
            if finished == ["warm"]:
                burst_from.append(len(widths))
                inbox.put(task("first", 3))
                inbox.later = [task("second", 3)]
            elif len(finished) == 3:
                inbox.put(Shutdown())

    emitted.append(emit)
    for command in (ConnectToGroup(), LoadModel(), WarmUp(), task("warm", 1)):
        inbox.put(command)
    assert serve(machine, inbox) == 0
    assert finished[0] == "warm" and set(finished[1:]) == {"first", "second"}
    return widths[burst_from[0]]


def test_a_task_arriving_within_the_window_starts_with_the_first() -> None:
    """The loop's plumbing, on the fault engine asking for a window."""
    inbox, emitted = Arrivals(), []
    spec = make_spec(fault_card())
    config = EngineConfig(card=spec.card, model_path=Path("/nowhere"), slots=4,
                          images_dir=Path())
    engine = GatheringFaultEngine(config)
    machine = RunnerMachine(spec, engine, lambda r: emitted[0](r), clock=lambda: AT)
    assert machine.company_share == 1000.0

    def task(task_id: str, tokens: int) -> SubmitTask:
        return submit(task_id, f"tokens:{tokens}")

    width = run_a_burst_after_a_warm_task(machine, engine.widths, task, inbox, emitted)
    assert width == 2, engine.widths  # not 1: "second" waited


class RecordingTextEngine(TextEngine):
    """The real text engine, recording how many tasks each step ran."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.widths: list[int] = []

    def step(self) -> list[EngineEvent]:
        self.widths.append(self.active)
        return list(super().step())


def test_the_text_engine_takes_a_burst_s_second_task_into_its_first_step(
    tiny_llm_dir: Path,
) -> None:
    """The text engine asks for the window (its own share of its own measured steps), and
    a task arriving in it starts with the first, on mlx-lm with tiny-llm."""
    inbox, emitted = Arrivals(), []
    card = ModelCard(id="tiny-llm", name="tiny-llm", tasks=["text_generation"],
                     family="mlx_lm", source="built-in", n_layers=2)
    spec = make_spec(card, model_path=str(tiny_llm_dir))
    engine = RecordingTextEngine(engine_config(spec))
    machine = RunnerMachine(spec, engine, lambda r: emitted[0](r), clock=lambda: AT)
    assert machine.company_share == TextEngine.company_share > 0

    def task(task_id: str, tokens: int) -> SubmitTask:
        return SubmitTask(task=TextGeneration(
            task_id=task_id, model="tiny-llm", prompt=f"hello {task_id}", max_tokens=tokens,
            temperature=0))

    width = run_a_burst_after_a_warm_task(machine, engine.widths, task, inbox, emitted)
    assert width == 2, engine.widths  # not 1: "second" waited
