"""Find model weights already on this machine: a directory, or the local Hugging Face cache.

Nothing here downloads. The cache layout is `<hub>/models--<org>--<name>/snapshots/<revision>/`
with `refs/main` naming the revision a plain download resolved to; `<hub>` follows the same
environment variables as huggingface_hub (HF_HUB_CACHE, then HF_HOME/hub, then
XDG_CACHE_HOME/huggingface/hub, then ~/.cache/huggingface/hub).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fleet.errors import ModelNotFound

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache_home = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home).expanduser() / "huggingface" / "hub"


def find_in_hf_cache(repo_id: str, env: dict[str, str] | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the local cache, or None if it is not there."""
    repo_dir = hub_cache_dir(env) / ("models--" + repo_id.replace("/", "--"))
    return _snapshot_of(repo_dir) if repo_dir.is_dir() else None


def resolve_local_model(path_or_repo: Path | str, env: dict[str, str] | None = None) -> Path:
    """An absolute model directory from a path (plain, cache entry or snapshot) or a repo id."""
    candidate = Path(path_or_repo).expanduser()
    if candidate.is_dir():
        if (candidate / "snapshots").is_dir():
            snapshot = _snapshot_of(candidate)
            if snapshot is None:
                raise ModelNotFound(f"{candidate} is a Hugging Face cache entry with no snapshot")
            return snapshot
        return candidate.resolve()
    if isinstance(path_or_repo, str) and _REPO_ID.match(path_or_repo):
        snapshot = find_in_hf_cache(path_or_repo, env)
        if snapshot is not None:
            return snapshot
        raise ModelNotFound(
            f"{path_or_repo!r} is not in the local Hugging Face cache ({hub_cache_dir(env)})"
        )
    raise ModelNotFound(f"no model directory at {candidate}")


def repo_id_of_snapshot(path: Path) -> str | None:
    """`org/name` for a directory `.../models--org--name/snapshots/<rev>`, else None."""
    entry = path.parent.parent.name
    if path.parent.name != "snapshots" or not entry.startswith("models--"):
        return None
    return entry.removeprefix("models--").replace("--", "/", 1)


def _snapshot_of(repo_dir: Path) -> Path | None:
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snapshot = repo_dir / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot.resolve()
    # No usable ref (a copied cache, a pinned revision): take the newest snapshot.
    snapshots = sorted(
        (entry for entry in (repo_dir / "snapshots").glob("*") if entry.is_dir()),
        key=lambda entry: entry.stat().st_mtime,
    )
    return snapshots[-1].resolve() if snapshots else None
