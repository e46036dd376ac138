"""The vision cache's fleet-wide half on a real nats-server: entries one node made reach
another node's features directory through FLEET_VISION (a node that never encoded the image),
once each; a missing entry is a miss; the shipped worker role may do both."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client

from fleet.bus.connect import ConnectOptions, connect
from fleet.bus.provision import provision
from fleet.bus.vision_layout import entry, features_dir, key_file, object_name
from fleet.bus.vision_store import VisionShare
from tests.secured import PASSWORDS, as_role, shipped_auth_server

FP, RED, BLUE = "f" * 32, "a" * 64, "b" * 64


def node(root: Path, nc: Client) -> VisionShare:
    """A node whose runner of tiny-vlm loaded the model with fingerprint FP."""
    images = root / "images"
    directory = features_dir(images)
    (directory / FP).mkdir(parents=True)
    key_file(directory, "tiny-vlm").write_text(FP)
    return VisionShare(nc, images)


async def test_an_entry_made_on_one_node_reaches_another(
    provisioned_nc: Client, tmp_path: Path
) -> None:
    first, second = node(tmp_path / "a", provisioned_nc), node(tmp_path / "b", provisioned_nc)
    made = entry(first.directory, FP, RED)
    made.write_bytes(b"features of the red image")
    assert await second.prefetch([RED, BLUE]) == 0  # nothing shared yet: misses

    first.share([RED, BLUE])  # BLUE was never encoded there: nothing to store for it
    await first.drain()
    assert await first.store.find(object_name(FP, RED)) is not None
    assert await first.store.find(object_name(FP, BLUE)) is None

    assert await second.prefetch([RED, BLUE]) == 1
    assert entry(second.directory, FP, RED).read_bytes() == b"features of the red image"
    assert await second.prefetch([RED]) == 0  # already here: no second fetch

    first.share([RED])  # stored once: not again
    assert not first._uploads


async def test_a_node_without_a_vision_model_fetches_nothing(
    provisioned_nc: Client, tmp_path: Path
) -> None:
    bare = VisionShare(provisioned_nc, tmp_path / "images")
    assert await bare.prefetch([RED]) == 0
    bare.share([RED])
    assert not bare._uploads


async def test_the_shipped_worker_role_may_share_and_fetch_entries(tmp_path: Path) -> None:
    with shipped_auth_server(tmp_path / "nats") as url:
        admin = await as_role(url, "operator")
        await provision(admin)
        await admin.close()
        nc = await connect(url, "test-worker", inbox_owner="worker", options=ConnectOptions(
            user="worker", password=PASSWORDS["worker"]))
        try:
            first, second = node(tmp_path / "a", nc), node(tmp_path / "b", nc)
            entry(first.directory, FP, RED).write_bytes(b"features")
            first.share([RED])
            await first.drain()
            assert await second.prefetch([RED]) == 1
            assert not first._warned and not second._warned
        finally:
            await nc.close()
