"""The vision cache: an image's encoded features for one model, kept so that the next task
with the same image skips the vision tower and projector.

Key: (the model's vision fingerprint, the image's sha256). The fingerprint hashes the weights
that make the features (every parameter outside the language model) and the pixel
preparation, so two nodes share entries only when they would compute the same features.
Entries live in this runner's memory, bounded in bytes, least recently used first out, and are
written through to the node's features directory (fleet/bus/vision_layout.py),
from which the worker shares them through the FLEET_VISION object store
(fleet/bus/vision_store.py) and into which it places the entries other nodes made. A hit
on the directory is a hit: the encoder does not run.

`FLEET_VISION_CACHE_MB` (default 512; 0 turns the cache off) bounds the memory; the
directory keeps at most twice that, oldest use first out.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.bus.vision_layout import SUFFIX, entry, key_file

log = logging.getLogger(__name__)

DEFAULT_MB = 512


def budget_bytes(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The memory budget from FLEET_VISION_CACHE_MB. Pure over `environ`."""
    raw = environ.get("FLEET_VISION_CACHE_MB", "")
    try:
        return max(0, int(float(raw) * 1024 * 1024)) if raw else DEFAULT_MB * 1024 * 1024
    except ValueError:
        log.warning("FLEET_VISION_CACHE_MB=%r is not a number; using %d", raw, DEFAULT_MB)
        return DEFAULT_MB * 1024 * 1024


def fingerprint(model: Any, preparation: str) -> str:
    """sha256 over the parameters that make image features (all but the language model's)
    and how pixels are prepared: equal fingerprints encode an image to equal features."""
    from mlx.utils import tree_flatten

    digest = hashlib.sha256(preparation.encode())
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        if name.startswith("language_model."):
            continue
        digest.update(name.encode())
        digest.update(str(value.dtype).encode())
        digest.update(memoryview(value))
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class EncodeTiming:
    """How long a task's images took to become features (cache reads and encodes), for the
    runner's `encode images` span."""

    task_id: str
    started: float  # unix seconds
    ended: float
    images: int
    cached: int


EncodeHook = Callable[[EncodeTiming], None]


@dataclass
class CacheCounts:
    hits: int = 0
    misses: int = 0


class VisionCache:
    def __init__(self, directory: Path | None, model: str, fp: str, max_bytes: int) -> None:
        """`directory`: the node's features directory (None: memory only)."""
        self.max_bytes = max_bytes
        self.fp = fp
        self.counts = CacheCounts()
        self._entries: OrderedDict[str, Any] = OrderedDict()  # sha -> features, LRU first
        self._bytes = 0
        self._dir = directory / fp if directory is not None and max_bytes else None
        if self._dir is not None and directory is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(key_file(directory, model), fp.encode())

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def get(self, sha: str) -> Any | None:
        """The features of image `sha`, from memory or the node's directory, or None. Counts a
        hit or a miss."""
        if not self.enabled:
            return None
        features = self._entries.get(sha)
        if features is not None:
            self._entries.move_to_end(sha)
        elif (features := self._read(sha)) is not None:
            self._remember(sha, features)
        if features is None:
            self.counts.misses += 1
        else:
            self.counts.hits += 1
        return features

    def put(self, sha: str, features: Any) -> None:
        if not self.enabled:
            return
        self._remember(sha, features)
        if self._dir is not None:
            import mlx.core as mx

            path = entry(self._dir.parent, self.fp, sha)
            partial = path.with_name(f".{sha}.{os.getpid()}.tmp{SUFFIX}")
            try:
                mx.save_safetensors(str(partial), {"features": features})
                os.replace(partial, path)
            except OSError as exc:  # a full disk costs the sharing, not the answer
                partial.unlink(missing_ok=True)
                log.warning("vision cache: %s not written: %s", path, exc)
            self._prune_dir()

    def _read(self, sha: str) -> Any | None:
        if self._dir is None:
            return None
        path = entry(self._dir.parent, self.fp, sha)
        if not path.is_file():
            return None
        import mlx.core as mx

        try:
            features = mx.load(str(path))["features"]
            os.utime(path)  # its mtime is its last use (the directory's LRU order)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            log.warning("vision cache: dropping unreadable %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return None
        return features

    def _remember(self, sha: str, features: Any) -> None:
        if sha in self._entries:
            self._bytes -= self._entries.pop(sha).nbytes
        self._entries[sha] = features
        self._bytes += features.nbytes
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes

    def _prune_dir(self) -> None:
        """Keep the directory within twice the memory budget, least recently used out."""
        if self._dir is None:
            return
        files = [(item.stat().st_mtime, item.stat().st_size, Path(item.path))
                 for item in os.scandir(self._dir)
                 if item.name.endswith(SUFFIX) and not item.name.startswith(".")]
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= 2 * self.max_bytes:
                return
            path.unlink(missing_ok=True)
            total -= size


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)
