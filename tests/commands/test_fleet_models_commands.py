"""`fleet models add` on a NATS no Fleet process has used yet makes the buckets it needs and
publishes (it failed: "object store bucket FLEET_WEIGHTS does not exist"), and `fleet models
list --nats-url URL` (the setting after the verb) shows the fleet's catalogue, as does a plain
`fleet models list` beside a local server (`fleet up`'s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleet.bus.embedded import EmbeddedNats
from tests.integration.harness import REPO


def fleet(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], cwd=REPO, capture_output=True, text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "FLEET_DATA_DIR": str(tmp_path / "data"), **env},
    )


def test_models_add_on_a_bare_nats_publishes_and_list_shows_it(
    nats_server: EmbeddedNats, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    added = fleet(tmp_path, "models", "add", "--id", "my-tiny", "--path", str(tiny_llm_dir),
                  "--nats-url", nats_server.url)
    assert added.returncode == 0, added.stdout + added.stderr
    assert "published my-tiny to the fleet" in added.stdout
    listed = fleet(tmp_path, "models", "list", "--nats-url", nats_server.url)
    assert listed.returncode == 0, listed.stderr
    fleet_part = listed.stdout.split("fleet (FLEET_MODELS):")[1]
    assert "my-tiny" in fleet_part
    local = fleet(tmp_path, "models", "list", FLEET_NATS_PORT=str(nats_server.port))
    assert local.returncode == 0, local.stderr
    assert "my-tiny" in local.stdout.split("fleet (FLEET_MODELS):")[1]
    nowhere = fleet(tmp_path, "models", "list", FLEET_NATS_PORT="1")
    assert nowhere.returncode == 0 and "no fleet at nats://127.0.0.1:1" in nowhere.stdout
