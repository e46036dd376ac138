"""Settings after the command, on real runs: `fleet up --nats-url X --data-dir Y --port P`
connects to X, keeps its data in Y, serves on P, says when its runner is ready and writes one
access-log line per request; every short command that connects does so with its settings
before or after the command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fleet.bus.embedded import EmbeddedNats
from tests.commands.test_exits import Command, assert_clean, free_port
from tests.integration.harness import seed_models

FLEET = Path(sys.executable).parent / "fleet"
CHAT = {"model": "tiny-llm", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


async def test_fleet_up_takes_its_settings_after_the_command_and_serves_with_them(
    nats_server: EmbeddedNats, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    data = tmp_path / "flagged-data"  # not the FLEET_DATA_DIR the Command sets
    seed_models(data, {"tiny-llm": tiny_llm_dir})
    port = free_port()
    up = Command(tmp_path, "up", "--nats-url", nats_server.url, "--data-dir", str(data),
                 "--port", str(port), "--models", "tiny-llm")
    try:
        up.wait_for_line("fleet up: NATS", timeout=120)
        assert f"fleet up: NATS {nats_server.url}, data {data}" in up.log()
        for page in ("/v1", "/ui", "/docs"):  # the API, the dashboard and the API docs
            assert f"http://127.0.0.1:{port}{page}\n" in up.log()
        up.wait_for_line("for tiny-llm on node", timeout=120)
        assert "is ready" in up.log()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            chat = await http.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200, chat.text
        task_id = chat.headers["x-fleet-task-id"]
        up.wait_for_line(f"task={task_id}")
        lines = [line for line in up.log().splitlines() if "POST /v1/chat/completions" in line]
        assert len(lines) == 1, lines  # one access-log line, not uvicorn's as well
        assert (data / "node_id").is_file()
        assert_clean(up, *up.terminate_and_time())
    finally:
        up.kill()


# Each connecting command with what it prints once it has talked to NATS.
CONNECTING: list[tuple[list[str], int, str]] = [
    (["instances", "list"], 0, ""),
    (["images", "ls"], 0, ""),
    (["cancel", "t-unknown"], 0, "task t-unknown has no events: it is still queued"),
    (["follow", "t-unknown", "--timeout", "1"], 1, "no events are stored for task t-unknown"),
    (["trace", "t-unknown"], 1, "t-unknown"),
    (["submit", "hello", "--model", "tiny-llm", "--no-follow"], 0, "on fleet.tasks.tiny-llm"),
]


# Every command parses its settings the same before or after itself (in-process, for each
# command: tests/commands/test_cli_settings.py); here each runs as a process once with them
# after it, and one also with them before it (a process start costs seconds of CPU).
WHERE = [("after", *each) for each in CONNECTING] + [("before", *CONNECTING[-1])]


@pytest.mark.parametrize(("where", "argv", "code", "says"), WHERE,
                         ids=[f"{c[1][0]}-{c[0]}" for c in WHERE])
def test_a_connecting_command_takes_its_settings_before_or_after_itself(
    provisioned_nc: object, nats_url: str, tmp_path: Path, where: str, argv: list[str],
    code: int, says: str,
) -> None:
    settings = ["--nats-url", nats_url, "--data-dir", str(tmp_path)]
    line = [*settings, *argv] if where == "before" else [*argv, *settings]
    result = subprocess.run([str(FLEET), *line], capture_output=True, text=True, timeout=60,
                            check=False, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    output = result.stdout + result.stderr
    assert "cannot reach NATS" not in output, output
    assert result.returncode == code, output
    assert says in output, output
