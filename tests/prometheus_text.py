"""Reading /metrics as Prometheus does: prometheus_client's text parser, and lookups of one
sample by name and a subset of its labels."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass
class Scrape:
    types: dict[str, str]  # family name -> counter, gauge, histogram, ...
    samples: list[Sample]

    @classmethod
    def of(cls, text: str) -> Scrape:
        families = list(text_string_to_metric_families(text))
        return cls(
            types={family.name: family.type for family in families},
            samples=[sample for family in families for sample in family.samples],
        )

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample called `name` whose labels include `labels` (None: no such sample)."""
        found = [
            s.value for s in self.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]
        assert len(found) <= 1, f"{len(found)} samples {name} {labels}"
        return found[0] if found else None

    def histograms(self) -> set[str]:
        return {name for name, kind in self.types.items() if kind == "histogram"}


# The histograms the gateway and the workers both record (fleet/meters.py TaskTimings).
SHARED_HISTOGRAMS = {
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai_server_request_duration_seconds",
    "fleet_task_queue_wait_seconds",
    "gen_ai_client_token_usage",
}
