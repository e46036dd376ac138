"""Where a node keeps its vision cache on disk, shared by the runner that writes entries and
the worker that exchanges them with the FLEET_VISION object store (fleet/bus/vision_store.py).

`<images_dir>/../vision-features/<fingerprint>/<image sha256>.safetensors` holds one image's
encoded features for the model with that fingerprint; `<model>.key` names the fingerprint of
the model a runner of this node loaded. Beside the image cache, not inside it: its loader
deletes every entry it does not know.
"""

from __future__ import annotations

from pathlib import Path

SUFFIX = ".safetensors"


def features_dir(images_dir: Path) -> Path:
    return images_dir.parent / "vision-features"


def key_file(directory: Path, model: str) -> Path:
    return directory / f"{model}.key"


def entry(directory: Path, fingerprint: str, sha: str) -> Path:
    return directory / fingerprint / f"{sha}{SUFFIX}"


def object_name(fingerprint: str, sha: str) -> str:
    """The entry's name in FLEET_VISION: another model's features never match."""
    return f"{fingerprint}-{sha}"
