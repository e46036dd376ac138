"""The benchmark's guards: a hung path costs one time limit, and a failed run says so.

A stuck path here is a stand-in (fault injection); the paths themselves are exercised by
`fleet bench --quick`, which CI runs after the tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.cli import show_logs
from bench.report import stream_failures
from bench.text import Bursts, Samples
from bench.workload import Request, StreamResult

REQUEST = Request([{"role": "user", "content": "Hi"}], 4, {})


class StuckPath:
    name = "stuck"

    def __init__(self) -> None:
        self.calls = 0

    async def burst(self, requests: list[Request]) -> list[StreamResult]:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class QuickPath:
    name = "quick"

    async def burst(self, requests: list[Request]) -> list[StreamResult]:
        return [StreamResult(start_s=0.0, first_s=0.1, last_s=0.2, tokens=4) for _ in requests]


async def test_a_hung_path_times_out_once_and_is_skipped_after() -> None:
    bursts, stuck = Bursts(0.2), StuckPath()
    first = await bursts.run(stuck, [REQUEST, REQUEST])
    assert [r.error for r in first] == ["timed out after 0 s"] * 2
    later = await bursts.run(stuck, [REQUEST])
    assert stuck.calls == 1
    assert later[0].error is not None and later[0].error.startswith("skipped")
    assert (await bursts.run(QuickPath(), [REQUEST]))[0].error is None


def test_failed_streams_are_named_and_short_ones_are_not_failures() -> None:
    failed = Samples([StreamResult(start_s=0.0, error="timed out after 120 s")], [])
    short = Samples([StreamResult(start_s=0.0, first_s=0.1, last_s=0.2, tokens=3)], [])
    text = {"tiny-llm": {"results": {"unique": {"c1": {
        "fleet_nats": failed.summary(16), "peer": short.summary(16),
    }}}}}
    assert stream_failures(text) == [
        "tiny-llm unique c1 fleet_nats: 1 of 1 streams failed (timed out after 120 s)"
    ]


def test_the_logs_of_a_failed_run_are_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    (tmp_path / "tiny-llm" / "fleet-data").mkdir(parents=True)
    (tmp_path / "tiny-llm" / "fleet-data" / "fleet-up.log").write_text(
        "".join(f"line {n}\n" for n in range(100)) + "fleet: node 'x' is not alive\n"
    )
    show_logs(tmp_path, lines=3)
    err = capsys.readouterr().err
    assert "tiny-llm/fleet-data/fleet-up.log: last 3 lines" in err
    assert "line 98\nline 99\nfleet: node 'x' is not alive" in err
    assert "line 97" not in err
