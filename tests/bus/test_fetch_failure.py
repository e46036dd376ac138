"""A failed weights fetch says why (issue 31, item 6): its runner record turns `failed` with the
reason, and `fleet instances list` shows it, instead of "downloading 0% 0/0 MB" for ever."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from fleet.bus.weights import FAILURE_CHARS, FleetModels, fetch_failure
from fleet.commands.announce import status_text
from fleet.commands.stack import instances_cmd
from fleet.config import load_settings
from fleet.errors import ObjectCorrupt
from fleet.models.catalog import describe_model_dir
from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.runners import RunnerDownloading, RunnerFailed
from tests.integration.harness import WorkerProcess, client, wait_node, wait_runner


@pytest.mark.parametrize(("exc", "says"), [
    (ObjectCorrupt("unreadable object description: 'name'"),
     "fetching m from the fleet failed: unreadable object description: 'name'"),
    (TimeoutError("no chunk\nfor 30 s"), "fetching m from the fleet failed: TimeoutError: no "
     "chunk for 30 s"),
])
def test_fetch_failure(exc: Exception, says: str) -> None:
    assert fetch_failure("m", exc) == says


def test_a_failure_is_one_bounded_line() -> None:
    said = fetch_failure("m", ValueError("x" * 5000))
    assert len(said) == FAILURE_CHARS and "\n" not in said


def test_status_text_says_why_a_runner_failed() -> None:
    assert status_text(RunnerFailed(error="fetching m failed: gone")) == (
        "failed: fetching m failed: gone")
    assert status_text(RunnerDownloading(bytes_done=0, bytes_total=0)).startswith("downloading")


async def test_a_fetch_of_a_corrupted_description_shows_the_reason_in_the_listing(
    nats_url: str, tmp_path: Path, tiny_llm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The weights metadata junked as issue 31's confused deputy did: the node cannot fetch
    the model, and the listing says so."""
    nc = await client(nats_url)
    worker = WorkerProcess(nats_url, tmp_path / "w", FLEET_MODEL_SOURCES="fleet").start()
    try:
        fleet = FleetModels(nc)
        card = await fleet.publish(describe_model_dir("junked", tiny_llm_dir), tiny_llm_dir)
        assert card.manifest is not None
        victim = max(card.manifest.files, key=lambda f: f.size).sha256
        await nc.jetstream().publish(fleet.weights.meta_subject(victim), b'{"nuid": "x"}',
                                     headers={"Nats-Rollup": "sub"})
        node = await wait_node(nc, tmp_path / "w")
        runners = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
        watcher = await runners.watchall()
        await place(nc.jetstream(), card, node_id=node, slots=1)
        failed = await wait_runner(watcher, "junked", ("failed",), 60)
        assert isinstance(failed.status, RunnerFailed)
        assert "fetching junked from the fleet failed" in failed.status.error
        assert "unreadable object description" in failed.status.error
        settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path / "cli"}, env={})
        deadline = time.monotonic() + 10
        while True:  # the next try may have just put a downloading record back
            capsys.readouterr()
            assert await instances_cmd(settings, argparse.Namespace(action="list")) == 0
            listed = capsys.readouterr().out
            if "failed: fetching junked" in listed or time.monotonic() > deadline:
                break
        assert "failed: fetching junked from the fleet failed" in listed, listed
    finally:
        worker.kill()
        await nc.close()
