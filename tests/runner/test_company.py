"""The runner's wait for company: the window's rule as a table, and the loop taking a task
that arrives within it before the idle engine's first step (the fault engine proves the
plumbing; the bench's burst8 cells are the evidence on a real model)."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from fleet.runner.company import WINDOW_CAP_S, StepClock, window_s
from fleet.runner.engine import EngineConfig, EngineEvent
from fleet.runner.fault_engine import FaultEngine, fault_card
from fleet.runner.machine import RunnerMachine
from fleet.runner.main import PipeBroken, serve
from fleet.wire.events import TaskFinished
from fleet.wire.pipe import ConnectToGroup, LoadModel, RunnerCommand, Shutdown, WarmUp
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


def test_a_task_arriving_within_the_window_starts_with_the_first() -> None:
    inbox = Arrivals()
    spec = make_spec(fault_card())
    config = EngineConfig(card=spec.card, model_path=Path("/nowhere"), slots=4,
                          images_dir=Path())
    engine = GatheringFaultEngine(config)
    finished: list[str] = []
    burst_from: list[int] = []  # the index of the burst's first step in engine.widths

    def emit(report: Any) -> None:
        if isinstance(report, TaskFinished):
            finished.append(report.task_id)
            if finished == ["warm"]:  # a step is measured: now the burst, its first alone
                burst_from.append(len(engine.widths))
                inbox.put(submit("first", "tokens:3"))
                inbox.later = [submit("second", "tokens:3")]
            elif len(finished) == 3:
                inbox.put(Shutdown())

    for command in (ConnectToGroup(), LoadModel(), WarmUp(), submit("warm", "tokens:1")):
        inbox.put(command)
    machine = RunnerMachine(spec, engine, emit, clock=lambda: AT)
    assert machine.company_share == 1000.0
    assert serve(machine, inbox) == 0
    assert finished[0] == "warm" and set(finished[1:]) == {"first", "second"}
    assert engine.widths[burst_from[0]] == 2, engine.widths  # not 1: "second" waited
