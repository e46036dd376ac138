"""A second `fleet up` on the same data dir says that it restores the instances the first one
placed (the embedded server keeps them in its store), and `--fresh` starts without them."""

from __future__ import annotations

from pathlib import Path

from tests.commands.test_exits import Command, assert_clean, free_port
from tests.integration.harness import seed_models


def up(tmp_path: Path, *args: str) -> Command:
    return Command(tmp_path, "up", "--port", str(free_port()), "--nats-port", "0", *args)


def test_a_second_fleet_up_names_what_it_restores_and_fresh_starts_clean(
    tmp_path: Path, tiny_llm_dir: Path
) -> None:
    seed_models(tmp_path / "data", {"tiny-llm": tiny_llm_dir})
    runs: list[Command] = []
    try:
        first = up(tmp_path, "--models", "tiny-llm")
        runs.append(first)
        first.wait_for_line("fleet up: NATS", timeout=120)
        assert "placed tiny-llm as" in first.log() and "restoring" not in first.log()
        assert_clean(first, *first.terminate_and_time())

        second = up(tmp_path, "--models", "")
        runs.append(second)
        second.wait_for_line("fleet up: NATS", timeout=120)
        assert "restoring 1 instance(s) placed before on this data dir: tiny-llm-" in (
            second.log())
        assert "fleet up --fresh" in second.log()
        assert_clean(second, *second.terminate_and_time())

        third = up(tmp_path, "--models", "", "--fresh")
        runs.append(third)
        third.wait_for_line("fleet up: NATS", timeout=120)
        assert "--fresh: removed 1 instance(s) placed before: tiny-llm-" in third.log()
        assert_clean(third, *third.terminate_and_time())

        fourth = up(tmp_path, "--models", "")
        runs.append(fourth)
        fourth.wait_for_line("fleet up: NATS", timeout=120)
        assert "restoring" not in fourth.log()  # nothing is left to restore
        assert_clean(fourth, *fourth.terminate_and_time())
    finally:
        for run in runs:
            run.kill()
