"""bench/http_middleware.py runs and reports every number (a smoke run: the numbers
themselves are the benchmark's, never asserted here)."""

from __future__ import annotations

from bench.http_middleware import run


async def test_the_middleware_benchmark_reports_its_numbers() -> None:
    result = await run(requests=3, rounds=1, chunks=2)
    assert set(result) == {
        "overhead_us_per_request_0_chunks", "overhead_us_per_request_2_chunks",
        "overhead_us_per_chunk", "metrics_render_us", "load_1m",
    }
