"""`fleet models add/list/remove` with a NATS URL: the model becomes (and stops being) fleet
state, against a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.provision import provision
from fleet.bus.weights import FleetModels
from tests.models.test_models_cli import run


async def _fleet(url: str) -> tuple[Client, FleetModels]:
    nc = await nats.connect(url)
    return nc, FleetModels(nc)


def test_add_publishes_list_shows_and_remove_deletes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_llm_dir: Path,
    provisioned_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_NATS_URL", provisioned_url)
    added = run(capsys, tmp_path / "a", "add", "--id", "my-tiny", "--path", str(tiny_llm_dir))
    assert "published my-tiny to the fleet" in added

    # Another machine (another data dir, no local card) sees it in the fleet's catalogue.
    listed = run(capsys, tmp_path / "b", "list")
    fleet_part = listed.split("fleet (FLEET_MODELS):")[1]
    row = next(line.split() for line in fleet_part.splitlines() if line.startswith("my-tiny "))
    assert row[2:4] == [str(len(list(tiny_llm_dir.iterdir()))), "files,"]

    async def stored() -> set[str]:
        nc, fleet = await _fleet(provisioned_url)
        try:
            return await fleet.stored_names()
        finally:
            await nc.close()

    assert asyncio.run(stored())
    removed = run(capsys, tmp_path / "b", "remove", "my-tiny")
    assert "removed my-tiny from the fleet" in removed
    assert asyncio.run(stored()) == set()
    assert "my-tiny " not in run(capsys, tmp_path / "b", "list").split("fleet (FLEET_MODELS):")[1]


@pytest.fixture
def provisioned_url(nats_url: str) -> str:
    async def main() -> None:
        nc = await nats.connect(nats_url)
        await provision(nc)
        await nc.close()

    asyncio.run(main())
    return nats_url
