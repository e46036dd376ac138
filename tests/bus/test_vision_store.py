"""The vision cache's fleet-wide half on a real nats-server: entries one node made reach
another node's features directory through FLEET_VISION (a node that never encoded the image),
once each; a missing entry is a miss; a bad entry (digest) is dropped as a miss."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client

from fleet.bus.vision_layout import entry, features_dir, key_file, object_name
from fleet.bus.vision_store import VisionShare

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
