"""Settings: flags beat FLEET_* environment variables beat defaults; values are typed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from fleet.config import Settings, load_settings
from fleet.errors import InvalidSetting

DEFAULTS = Settings()


@pytest.mark.parametrize(
    ("name", "var", "env_value", "flag_value", "expected_env", "expected_flag"),
    [
        ("nats_url", "FLEET_NATS_URL", "nats://env:4222", "nats://flag:4222",
         "nats://env:4222", "nats://flag:4222"),
        ("gateway_host", "FLEET_GATEWAY_HOST", "0.0.0.0", "::1", "0.0.0.0", "::1"),
        ("gateway_port", "FLEET_GATEWAY_PORT", "9001", 9002, 9001, 9002),
        ("nats_port", "FLEET_NATS_PORT", "14222", 24222, 14222, 24222),
        ("log_level", "FLEET_LOG_LEVEL", "debug", "warning", "debug", "warning"),
        ("slots", "FLEET_SLOTS", "8", 2, 8, 2),
        ("gateway_timeout_s", "FLEET_GATEWAY_TIMEOUT_S", "12.5", 3, 12.5, 3.0),
        ("input_wait_s", "FLEET_INPUT_WAIT_S", "0.25", "7", 0.25, 7.0),
        ("max_deliver", "FLEET_MAX_DELIVER", "5", 6, 5, 6),
        ("ack_wait_s", "FLEET_ACK_WAIT_S", "45", 60.5, 45.0, 60.5),
        ("auto_place", "FLEET_AUTO_PLACE", "off", True, False, True),
    ],
)
def test_flag_beats_env_beats_default(
    name: str, var: str, env_value: str, flag_value: Any, expected_env: Any, expected_flag: Any
) -> None:
    assert getattr(load_settings({}, env={}), name) == getattr(DEFAULTS, name)
    assert getattr(load_settings({}, env={var: env_value}), name) == expected_env
    both = load_settings({name: flag_value}, env={var: env_value})
    assert getattr(both, name) == expected_flag
    assert type(getattr(both, name)) is type(expected_flag)


def test_env_strings_are_coerced_to_the_field_types() -> None:
    settings = load_settings(env={
        "FLEET_GATEWAY_PORT": "8123", "FLEET_ACK_WAIT_S": "2", "FLEET_DATA_DIR": "/srv/fleet",
        "FLEET_IMAGE_CACHE_BYTES": "1048576", "FLEET_API_KEYS": "k1,,k2",
    })
    assert settings.gateway_port == 8123 and isinstance(settings.gateway_port, int)
    assert settings.ack_wait_s == 2.0 and isinstance(settings.ack_wait_s, float)
    assert settings.data_dir == Path("/srv/fleet")
    assert settings.image_cache_bytes == 1 << 20
    assert settings.api_keys == ("k1", "k2")


def test_flags_given_as_none_fall_through_to_env() -> None:
    settings = load_settings(
        {"nats_url": None, "gateway_port": None}, env={"FLEET_NATS_URL": "nats://env:1"}
    )
    assert settings.nats_url == "nats://env:1"
    assert settings.gateway_port == DEFAULTS.gateway_port


def test_an_empty_env_var_counts_as_unset() -> None:
    settings = load_settings(env={"FLEET_NATS_URL": "", "FLEET_GATEWAY_PORT": ""})
    assert settings.nats_url is None
    assert settings.gateway_port == DEFAULTS.gateway_port


def test_a_zero_flag_is_a_value_not_a_missing_flag() -> None:
    settings = load_settings({"nats_port": 0}, env={"FLEET_NATS_PORT": "4333"})
    assert settings.nats_port == 0


def test_flags_that_are_not_settings_are_ignored() -> None:
    settings = load_settings({"command": "up", "func": print}, env={})
    assert settings == load_settings({}, env={})


def test_api_keys_flag_accepts_a_list() -> None:
    settings = load_settings({"api_keys": ["a", "", "b"]}, env={"FLEET_API_KEYS": "env-key"})
    assert settings.api_keys == ("a", "b")


def test_relative_data_dir_is_resolved_to_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    from_flag = load_settings({"data_dir": "stack-a"}, env={"FLEET_DATA_DIR": "stack-b"})
    from_env = load_settings({}, env={"FLEET_DATA_DIR": "stack-b/../stack-c"})
    assert from_flag.data_dir == tmp_path.resolve() / "stack-a"
    assert from_env.data_dir == tmp_path.resolve() / "stack-c"
    assert from_flag.data_dir.is_absolute()


def test_home_in_data_dir_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = load_settings({"data_dir": Path("~/fleet-data")}, env={})
    assert settings.data_dir == tmp_path.resolve() / "fleet-data"


def test_default_data_dir_follows_xdg_data_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert load_settings({}, env={}).data_dir == tmp_path / "fleet"


def test_paths_derive_from_the_data_dir() -> None:
    settings = load_settings({"data_dir": "/data"}, env={})
    assert settings.models_dir == Path("/data/models")
    assert settings.images_dir == Path("/data/images")
    assert settings.nats_store_dir == Path("/data/nats")


def test_url_is_the_given_nats_url_or_the_embedded_port() -> None:
    assert load_settings({"nats_port": 5222}, env={}).url == "nats://127.0.0.1:5222"
    given = load_settings({"nats_port": 5222}, env={"FLEET_NATS_URL": "nats://far:4222"})
    assert given.url == "nats://far:4222"


def test_two_stacks_get_separate_settings_from_their_flags() -> None:
    env = {"FLEET_GATEWAY_PORT": "8000"}
    one = load_settings({"data_dir": "/d1", "gateway_port": 8001, "nats_port": 4223}, env=env)
    two = load_settings({"data_dir": "/d2", "gateway_port": 8002, "nats_port": 4224}, env=env)
    assert (one.nats_store_dir, one.gateway_port, one.url) != (
        two.nats_store_dir, two.gateway_port, two.url
    )


def test_settings_are_frozen() -> None:
    settings = load_settings(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.gateway_port = 1  # type: ignore[misc]


def test_load_settings_reads_the_process_environment_when_no_env_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_SLOTS", "7")
    assert load_settings().slots == 7


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("Yes", True), ("0", False),
                                               ("false", False), ("OFF", False)])
def test_switches_read_the_usual_spellings(raw: str, expected: bool) -> None:
    assert load_settings(env={"FLEET_AUTO_PLACE": raw}).auto_place is expected


def test_a_switch_that_is_neither_on_nor_off_is_one_clear_error() -> None:
    with pytest.raises(InvalidSetting, match="FLEET_AUTO_PLACE: 'maybe'"):
        load_settings(env={"FLEET_AUTO_PLACE": "maybe"})
