"""A disk budget for the models a node keeps (`--models-disk-limit` / FLEET_MODELS_DISK_LIMIT,
bytes; 0: no limit). Before a fetch, the least recently used models that are not placed on
this node are evicted until the new one fits; if it cannot fit even then, the fetch is refused
and says why. The node advertises the room it has (placement skips a node without enough).

Only directories this node made (`<models_dir>/<id>`, fetched or built) count and may be
evicted: a symlink or a card's own path is someone else's and never deleted. "Used" is the
directory's mtime, touched whenever a runner is started from it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import DiskBudgetExceeded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    model: str
    size: int
    last_used: float


def choose_evictions(
    held: list[Held], placed: set[str], needed: int, limit: int
) -> list[str] | None:
    """Models to delete so that `needed` more bytes fit under `limit`, oldest use first;
    None when even evicting every unplaced model is not enough. Pure."""
    if limit <= 0:
        return []
    used = sum(h.size for h in held)
    evict: list[str] = []
    for candidate in sorted(held, key=lambda h: (h.last_used, h.model)):
        if used + needed <= limit:
            break
        if candidate.model in placed:
            continue
        evict.append(candidate.model)
        used -= candidate.size
    return evict if used + needed <= limit else None


def room_for_models(held: Iterable[Held], placed: set[str], limit: int) -> int | None:
    """Bytes of new model files that fit under `limit` once every model not in `placed` is
    evicted; None without a budget. What a node advertises so that placement can skip it. Pure."""
    if limit <= 0:
        return None
    return max(0, limit - sum(h.size for h in held if h.model in placed))


def held_models(models_dir: Path) -> list[Held]:
    found = []
    for entry in Path(models_dir).iterdir() if Path(models_dir).is_dir() else []:
        if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        if entry.name == "custom":  # cards, not weights
            continue
        size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
        found.append(Held(entry.name, size, entry.stat().st_mtime))
    return found


def make_room(
    models_dir: Path, model: str, needed: int, placed: set[str], limit: int
) -> list[str]:
    """Evict under the budget so that `model` (`needed` bytes) fits; the models evicted."""
    evict = choose_evictions(held_models(models_dir), placed | {model}, needed, limit)
    if evict is None:
        raise DiskBudgetExceeded(
            f"{model} needs {needed} bytes and this node's models budget is {limit} "
            "(--models-disk-limit); the models held for placed instances leave too little room"
        )
    for victim in evict:
        shutil.rmtree(Path(models_dir) / victim, ignore_errors=True)
    return evict


def touch(path: Path, models_dir: Path) -> None:
    """Mark a model directory of ours used now (the LRU clock); others' paths are left alone."""
    if Path(path).parent != Path(models_dir).absolute() or Path(path).is_symlink():
        return
    try:
        os.utime(path)
    except OSError as exc:  # only the eviction order suffers
        log.warning("could not mark %s used: %s", path, exc)
