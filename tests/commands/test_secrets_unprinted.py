"""A NATS password given in the URL never reaches the console: `fleet up` against a secured
server serves a chat and a failure, `fleet instances list` and `fleet models list` read the
fleet, and none of their output holds the secret (the URL is shown as `user:***@`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.bus.embedded import EmbeddedNats, ops_dir
from tests.commands.test_exits import Command, assert_clean, free_port
from tests.integration.harness import REPO, seed_models

SECRET = "s3cret-in-the-url-7fd2"


@pytest.fixture
def secured_url(tmp_path: Path) -> Iterator[str]:
    """A server with one user, as an operator's own NATS may be; its URL carries the secret."""
    config = tmp_path / "one-user.conf"
    config.write_text(
        (ops_dir() / "nats" / "single.conf").read_text()
        + f'\nauthorization {{ user: fleet, password: "{SECRET}" }}\n'
    )
    server = EmbeddedNats(tmp_path / "nats", port=0, config=config).start()
    try:
        yield f"nats://fleet:{SECRET}@127.0.0.1:{server.port}"
    finally:
        server.stop()


def fleet(tmp_path: Path, url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args, "--nats-url", url], cwd=REPO,
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "FLEET_DATA_DIR": str(tmp_path / "data")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


async def test_no_output_of_a_secured_stack_holds_the_password(
    secured_url: str, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    seed_models(tmp_path / "data", {"tiny-llm": tiny_llm_dir})
    port = free_port()
    up = Command(tmp_path, "up", "--nats-url", secured_url, "--models", "tiny-llm",
                 "--port", str(port))
    try:
        up.wait_for_line("is ready", timeout=120)
        assert "fleet up: NATS nats://fleet:***@127.0.0.1:" in up.log()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            chat = {"model": "tiny-llm", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            too_long = {**chat, "messages": [{"role": "user", "content": "word " * 3000}]}
            assert (await http.post("/v1/chat/completions", json=too_long)).status_code == 400
        printed = fleet(tmp_path, secured_url, "instances", "list")
        printed += fleet(tmp_path, secured_url, "models", "list")
        assert "tiny-llm" in printed
        assert_clean(up, *up.terminate_and_time())
    finally:
        up.kill()
    everything = up.log() + printed
    assert SECRET not in everything
