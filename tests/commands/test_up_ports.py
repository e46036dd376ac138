"""`fleet up` checks its ports before it starts anything: a taken gateway or NATS port ends
it at once with the reason, and no nats-server, worker or runner was started (they were left
to stop for ~15 s)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.commands.test_exits import Command
from tests.integration.harness import seed_models


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def ended(command: Command, timeout: float = 30.0) -> tuple[int, float, str]:
    started = time.monotonic()
    code = command.process.wait(timeout)
    return code, time.monotonic() - started, command.log()


@pytest.mark.parametrize("flag", ["--port", "--nats-port"])
def test_fleet_up_on_a_taken_port_starts_nothing_and_says_why(
    tmp_path: Path, tiny_llm_dir: Path, taken_port: int, flag: str
) -> None:
    seed_models(tmp_path / "data", {"tiny-llm": tiny_llm_dir})
    other = "--nats-port" if flag == "--port" else "--port"
    up = Command(tmp_path, "up", "--models", "tiny-llm", flag, str(taken_port), other, "0")
    try:
        code, took, log = ended(up)
    finally:
        up.kill()
    assert code == 1, log
    assert f"{taken_port}" in log and "in use" in log.lower(), log
    assert "pass --port N" in log or "pass --nats-port N" in log, log
    for started in ("serving on", "runner run-", "placed tiny-llm", "Traceback"):
        assert started not in log, log
    assert took < 15, log
