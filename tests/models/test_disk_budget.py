"""The models disk budget: which models to evict (pure, table) and eviction on real dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleet.config import load_settings
from fleet.errors import DiskBudgetExceeded
from fleet.models.disk import Held, choose_evictions, held_models, make_room, room_for_models

A, B, C = Held("a", 40, 1.0), Held("b", 30, 2.0), Held("c", 20, 3.0)


@pytest.mark.parametrize(
    ("held", "placed", "needed", "limit", "evicted"),
    [
        ([A, B], set(), 10, 0, []),  # no budget
        ([A, B], set(), 30, 100, []),  # fits as is
        ([A, B, C], set(), 30, 100, ["a"]),  # least recently used first
        ([A, B, C], {"a"}, 30, 100, ["b"]),  # a placed model stays
        ([A, B, C], set(), 80, 100, ["a", "b"]),
        ([A, B, C], {"a", "b", "c"}, 30, 100, None),  # everything is placed: refused
        ([], set(), 200, 100, None),  # bigger than the whole budget
    ],
)
def test_choose_evictions(
    held: list[Held], placed: set[str], needed: int, limit: int, evicted: list[str] | None
) -> None:
    assert choose_evictions(held, placed, needed, limit) == evicted


@pytest.mark.parametrize(
    ("placed", "limit", "room"),
    [
        ({"a"}, 0, None),  # no budget: no bound advertised
        (set(), 100, 100),  # everything held may be evicted
        ({"a"}, 100, 60),
        ({"a", "b", "c"}, 100, 10),
        ({"a", "b", "c"}, 50, 0),  # over the budget already: nothing more fits
    ],
)
def test_room_for_models(placed: set[str], limit: int, room: int | None) -> None:
    assert room_for_models([A, B, C], placed, limit) == room


def test_the_limit_is_a_setting_from_flag_or_env() -> None:
    assert load_settings({}, env={}).models_disk_limit == 0
    assert load_settings({}, env={"FLEET_MODELS_DISK_LIMIT": "500"}).models_disk_limit == 500
    flags = {"models_disk_limit": "700"}
    assert load_settings(flags, env={"FLEET_MODELS_DISK_LIMIT": "500"}).models_disk_limit == 700


def test_make_room_deletes_the_oldest_unplaced_model(tmp_path: Path) -> None:
    for age, name in enumerate(["old", "placed", "new"]):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "w.safetensors").write_bytes(b"x" * 100)
        os.utime(folder, (age, age))
    (tmp_path / ".fetching-x").mkdir()  # in progress: not a model held
    assert {h.model for h in held_models(tmp_path)} == {"old", "placed", "new"}
    assert make_room(tmp_path, "incoming", 100, {"placed"}, limit=350) == ["old"]
    assert not (tmp_path / "old").exists() and (tmp_path / "placed").exists()
    with pytest.raises(DiskBudgetExceeded, match="budget is 350"):
        make_room(tmp_path, "huge", 300, {"placed", "new"}, limit=350)
