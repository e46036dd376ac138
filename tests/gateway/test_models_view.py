"""Placement and readiness from KV records, and the Prometheus text: pure, tables."""

from __future__ import annotations

import pytest

from fleet.gateway.catalogue import ModelState, model_states, refuses_images, refuses_task
from fleet.models.catalog import builtin_cards
from fleet.wire.cluster import Instance, RunnerRecord, ShardAssignment
from fleet.wire.runners import RunnerFailed, RunnerLoading, RunnerReady, RunnerRunning


def instance(name: str, model: str, shards: int = 1) -> Instance:
    assignments = [ShardAssignment(node_id="n", runner_id="pending", rank=i) for i in range(shards)]
    return Instance(instance_id=name, model=model, shards=assignments, created_at=0)


def runner(runner_id: str, instance_id: str, model: str, status: object) -> RunnerRecord:
    return RunnerRecord(
        runner_id=runner_id,
        instance_id=instance_id,
        node_id="n",
        model=model,
        status=status,
        at=0,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("instances", "runners", "expected"),
    [
        ([], [], ModelState()),
        ([instance("i", "m")], [], ModelState(placed=True, instances=1)),
        (
            [instance("i", "m")],
            [runner("r", "i", "m", RunnerLoading(layers_done=1, layers_total=2))],
            ModelState(placed=True, instances=1),
        ),
        (
            [instance("i", "m")],
            [runner("r", "i", "m", RunnerRunning())],
            ModelState(placed=True, ready=True, instances=1, ready_runners=1),
        ),
        (  # a pipeline with one shard failed cannot take a task
            [instance("i", "m", shards=2)],
            [
                runner("r0", "i", "m", RunnerReady()),
                runner("r1", "i", "m", RunnerFailed(error="x")),
            ],
            ModelState(placed=True, instances=1, ready_runners=1),
        ),
        (  # a ready runner whose instance record is gone still takes tasks
            [],
            [runner("r", "gone", "m", RunnerReady())],
            ModelState(placed=True, ready=True, ready_runners=1),
        ),
        (  # other models' records say nothing about this one
            [instance("i", "other")],
            [runner("r", "i", "other", RunnerReady())],
            ModelState(),
        ),
    ],
)
def test_model_states(instances: list, runners: list, expected: ModelState) -> None:
    assert model_states(["m"], instances, runners) == {"m": expected}


def test_refusals_say_why() -> None:
    cards = builtin_cards()
    assert "text-only" in (refuses_images(cards["tiny-llm"]) or "")
    assert refuses_task(cards["tiny-llm"], "text_generation") is None
    assert "text to image" in (refuses_task(cards["tiny-llm"], "text_to_image") or "")
    assert refuses_task(cards["tiny-flux2"], "image_to_image") is None
