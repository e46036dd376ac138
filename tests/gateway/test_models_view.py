"""Placement and readiness from KV records, and the Prometheus text: pure, tables."""

from __future__ import annotations

import pytest

from fleet.gateway.metrics import Counter, GatewayMetrics, Histogram, TaskObserver
from fleet.gateway.models_view import ModelState, model_states, refuses_images, refuses_task
from fleet.models.catalog import builtin_cards
from fleet.wire.cluster import Instance, RunnerRecord, ShardAssignment
from fleet.wire.events import TaskFinished, TokenChunk, Usage
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


def test_counter_and_histogram_text() -> None:
    counter = Counter("c_total", "help")
    counter.inc(route="/a", status="200")
    counter.inc(2, route="/a", status="200")
    assert list(counter.render())[-1] == 'c_total{route="/a",status="200"} 3'
    histogram = Histogram("h_seconds", "help", buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 5.0):
        histogram.observe(value, model='a"b')
    assert list(histogram.render())[2:] == [
        'h_seconds_bucket{model="a\\"b",le="0.1"} 1',
        'h_seconds_bucket{model="a\\"b",le="1"} 2',
        'h_seconds_bucket{model="a\\"b",le="+Inf"} 3',
        'h_seconds_sum{model="a\\"b"} 5.55',
        'h_seconds_count{model="a\\"b"} 3',
    ]


def test_observer_times_tokens_from_the_first_one() -> None:
    metrics = GatewayMetrics()
    observer = TaskObserver(metrics, "m", started=10.0)
    for index, now in enumerate((10.5, 10.7, 10.9)):
        observer.see(TokenChunk(task_id="t", at=0, index=index, token_id=0, text="x"), now)
    usage = Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7)
    observer.see(TaskFinished(task_id="t", at=0, status="completed", usage=usage), 11.0)
    key = (("model", "m"),)
    assert metrics.ttft.sums[key] == pytest.approx(0.5)
    assert metrics.tpot.sums[key] == pytest.approx(0.2)
    assert metrics.tokens.values[(("kind", "prompt"), ("model", "m"))] == 4
