"""The worker's metrics: the task timings the gateway records too (fleet/meters.py
TaskTimings), here as the runner measured them, from each task's terminal event; and the
worker's own /metrics (`--metrics-port`) so Prometheus can scrape a fleet without a collector.
They also go out over OTLP when an endpoint is configured. The prefix cache's hit ratio per
model (cached / prompt tokens, from each terminal's usage) is a gauge over this worker's
totals, with the two counters beside it for a fleet-wide sum.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client import start_http_server

from fleet.errors import InvalidSetting
from fleet.meters import MODEL, Meters, TaskTimings
from fleet.wire.events import TaskFinished

log = logging.getLogger(__name__)


class TaskMetrics:
    def __init__(self, held: Callable[[], int] = lambda: 0) -> None:
        """`held()`: how many tasks the worker has taken and not yet settled."""
        self.meters = Meters("fleet-worker")
        meter = self.meters.meter("fleet.worker")
        self.timings = TaskTimings(meter)

        def observe_held(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(held())

        meter.create_observable_gauge(
            "fleet.worker.tasks", [observe_held], unit="{task}",
            description="Tasks this worker has taken and not yet acked, nakked or termed",
        )
        # The counters are observed from the totals this worker keeps anyway, not added to
        # per task: an SDK Counter.add costs ~7 us (attributes cleaned and hashed each time),
        # four a task at issue 23's rates, and a scrape reads the same sums.
        self.prompt_totals: dict[str, tuple[int, int]] = {}  # model -> (cached, prompt)
        meter.create_observable_counter(
            "fleet.prefix_cache.prompt_tokens", [self._totals(self.prompt_totals, 1)],
            unit="{token}", description="Prompt tokens of finished text tasks",
        )
        meter.create_observable_counter(
            "fleet.prefix_cache.cached_tokens", [self._totals(self.prompt_totals, 0)],
            unit="{token}", description="Prompt tokens whose prefill a runner's prefix cache saved",
        )
        meter.create_observable_gauge(
            "fleet.prefix_cache.hit_ratio", callbacks=[self._hit_ratios], unit="1",
            description="Cached / prompt tokens of the text tasks this worker finished",
        )
        # The vision cache (fleet/runner/vision_cache.py): images whose encode it saved.
        self.image_totals: dict[str, tuple[int, int]] = {}  # model -> (cached, images)
        meter.create_observable_counter(
            "fleet.vision_cache.images", [self._totals(self.image_totals, 1)], unit="{image}",
            description="Input images of finished vision tasks")
        meter.create_observable_counter(
            "fleet.vision_cache.hits", [self._totals(self.image_totals, 0)], unit="{image}",
            description="Input images whose encoding the vision cache saved")
        meter.create_observable_gauge(
            "fleet.vision_cache.hit_ratio", callbacks=[self._image_hit_ratios], unit="1",
            description="Cached / input images of the vision tasks this worker finished")

    @staticmethod
    def _totals(
        totals: dict[str, tuple[int, int]], which: int
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A counter's callback: element `which` of each model's (cached, all) totals. A
        scrape runs in prometheus_client's thread: it reads a copy of the dict (list() holds
        the GIL), never the dict as the loop adds a model."""
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for model, pair in list(totals.items()):
                yield Observation(pair[which], {MODEL: model})
        return observe

    def _hit_ratios(self, options: CallbackOptions) -> Iterable[Observation]:
        for model, (cached, prompt) in list(self.prompt_totals.items()):
            if prompt:
                yield Observation(cached / prompt, {MODEL: model})

    def _image_hit_ratios(self, options: CallbackOptions) -> Iterable[Observation]:
        for model, (cached, images) in list(self.image_totals.items()):
            yield Observation(cached / images, {MODEL: model})

    def hit_ratio(self, model: str) -> float | None:
        cached, prompt = self.prompt_totals.get(model, (0, 0))
        return cached / prompt if prompt else None

    def finished(self, attributes: dict[str, str], event: TaskFinished) -> None:
        """`attributes`: the task's (meters.task_attributes)."""
        if (usage := event.usage) is not None and usage.prompt_tokens:
            model = attributes[MODEL]
            cached, prompt = self.prompt_totals.get(model, (0, 0))
            self.prompt_totals[model] = (cached + usage.cached_tokens, prompt + usage.prompt_tokens)
        if (usage := event.usage) is not None and usage.images:
            model = attributes[MODEL]
            cached, images = self.image_totals.get(model, (0, 0))
            self.image_totals[model] = (cached + usage.cached_images, images + usage.images)
        stats = event.stats
        if stats is not None:
            if stats.time_to_first_token_s is not None:
                self.timings.time_to_first_token.record(stats.time_to_first_token_s, attributes)
            if stats.tokens_per_s:
                self.timings.time_per_output_token.record(1.0 / stats.tokens_per_s, attributes)
            if stats.queue_wait_s is not None:
                self.timings.queue_wait.record(stats.queue_wait_s, attributes)
        self.timings.finished(attributes, stats.total_s if stats else None, event)

    @contextmanager
    def served(self, host: str, port: int) -> Iterator[int | None]:
        """GET /metrics on host:port while inside (port 0: not served); yields the port.
        prometheus_client's own server runs it in a thread: a scrape reads only what the
        SDK holds (no NATS), and the SDK's instruments are thread-safe."""
        if not port:
            yield None
            return
        try:
            server, thread = start_http_server(port, host, registry=self.meters.registry)
        except OSError as exc:
            raise InvalidSetting(f"--metrics-port {port}: cannot listen on {host}: {exc}") from None
        log.info("worker metrics on http://%s:%d/metrics", host, port)
        try:
            yield port
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5.0)
