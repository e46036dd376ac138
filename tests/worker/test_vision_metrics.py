"""The vision cache's hit ratio on a worker's /metrics: cached / input images of the vision
tasks it finished, per model, with the two counters beside it; text tasks count nothing."""

from __future__ import annotations

from fleet.wire.events import TaskFinished, Usage
from fleet.worker.task_metrics import TaskMetrics
from tests.prometheus_text import Scrape

VLM = {"gen_ai.request.model": "tiny-vlm", "gen_ai.operation.name": "chat"}
LLM = {"gen_ai.request.model": "tiny-llm", "gen_ai.operation.name": "chat"}


def ended(images: int, cached: int) -> TaskFinished:
    usage = Usage(prompt_tokens=30, completion_tokens=4, total_tokens=34, images=images,
                  cached_images=cached)
    return TaskFinished(task_id="t", status="completed", at=0.0, usage=usage)


def test_vision_cache_hit_ratio_per_model() -> None:
    metrics = TaskMetrics()
    metrics.finished(VLM, ended(images=2, cached=0))  # the first sight of two images
    metrics.finished(VLM, ended(images=2, cached=2))
    metrics.finished(LLM, ended(images=0, cached=0))  # a text task: not a vision sample
    scrape = Scrape.of(metrics.meters.exposition().decode())
    assert scrape.value("fleet_vision_cache_hit_ratio", gen_ai_request_model="tiny-vlm") == 0.5
    assert scrape.value("fleet_vision_cache_hits_total", gen_ai_request_model="tiny-vlm") == 2
    assert scrape.value("fleet_vision_cache_images_total", gen_ai_request_model="tiny-vlm") == 4
    assert "tiny-llm" not in str(metrics.image_totals)
