"""The vision cache's bounds: memory by bytes, least recently used out (a read counts as a
use); the node's directory within twice that, oldest use out; 0 turns it off; the budget
setting read as MB."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from fleet.bus.vision_layout import entry, key_file
from fleet.runner.vision_cache import VisionCache, budget_bytes

A, B, C = "a" * 64, "b" * 64, "c" * 64


def features() -> mx.array:
    return mx.zeros((1, 10, 10), dtype=mx.float32)  # 400 bytes


def test_memory_is_bounded_by_bytes_least_recently_used_out() -> None:
    cache = VisionCache(None, "tiny-vlm", "fp", max_bytes=1000)  # two entries fit
    cache.put(A, features())
    cache.put(B, features())
    assert cache.get(A) is not None  # A is now the most recently used
    cache.put(C, features())
    assert cache.total_bytes == 800
    assert cache.get(B) is None and cache.get(A) is not None and cache.get(C) is not None
    assert (cache.counts.hits, cache.counts.misses) == (3, 1)


def test_the_directory_keeps_twice_the_budget_and_names_the_fingerprint(tmp_path: Path) -> None:
    cache = VisionCache(tmp_path, "tiny-vlm", "fp", max_bytes=1000)
    assert key_file(tmp_path, "tiny-vlm").read_text() == "fp"
    for sha in (A, B, C, "d" * 64, "e" * 64, "f" * 64):
        cache.put(sha, features())
    kept = sorted(p.name[:1] for p in (tmp_path / "fp").iterdir())
    on_disk = sum(p.stat().st_size for p in (tmp_path / "fp").iterdir())
    assert on_disk <= 2000 and "f" in kept and "a" not in kept
    fresh = VisionCache(tmp_path, "tiny-vlm", "fp", max_bytes=1000)  # another runner
    assert fresh.get("f" * 64) is not None and entry(tmp_path, "fp", "f" * 64).is_file()


def test_zero_turns_the_cache_off(tmp_path: Path) -> None:
    cache = VisionCache(tmp_path, "tiny-vlm", "fp", max_bytes=0)
    cache.put(A, features())
    assert cache.get(A) is None and not cache.enabled and not (tmp_path / "fp").exists()


@pytest.mark.parametrize(("value", "expected"), [
    (None, 512 * 1024**2), ("0", 0), ("1.5", int(1.5 * 1024**2)), ("lots", 512 * 1024**2),
])
def test_the_budget_is_read_in_mb(value: str | None, expected: int) -> None:
    environ = {} if value is None else {"FLEET_VISION_CACHE_MB": value}
    assert budget_bytes(environ) == expected
