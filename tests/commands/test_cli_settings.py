"""Settings as people type them: before or after the command, listed in each `--help` with
their environment variable and default; `fleet --version`; a missing NATS fails at once with
a hint; `fleet submit` without a prompt is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleet import config
from fleet.cli import COMMAND_SETTINGS, build_parser, fleet_version, subcommand_parsers
from tests.ports import free_port

FLEET = Path(sys.executable).parent / "fleet"

# The words each command needs besides settings (a verb, a positional argument).
REQUIRED: dict[str, list[str]] = {
    "instances": ["list"], "images": ["ls"], "follow": ["t-1"], "cancel": ["t-1"],
    "trace": ["t-1"], "submit": ["hello"], "models": ["list"], "batches": ["list"],
}


def settings_for(argv: list[str]) -> config.Settings:
    return config.settings_of(build_parser().parse_args(argv), )


@pytest.mark.parametrize("command", sorted(COMMAND_SETTINGS))
def test_a_setting_is_accepted_before_and_after_every_command(
    command: str, tmp_path: Path
) -> None:
    rest = REQUIRED.get(command, [])
    names = COMMAND_SETTINGS[command]
    flags = ["--data-dir", str(tmp_path)]
    if "nats_url" in names:
        flags += ["--nats-url", "nats://127.0.0.1:4999"]
    before = settings_for([*flags, command, *rest])
    after = settings_for([command, *rest, *flags])
    assert before == after
    assert after.data_dir == tmp_path.resolve()
    if "nats_url" in names:
        assert after.nats_url == "nats://127.0.0.1:4999"


def test_fleet_up_takes_nats_url_data_dir_and_port_after_the_command(tmp_path: Path) -> None:
    argv = ["up", "--nats-url", "nats://h:1", "--data-dir", str(tmp_path), "--port", "8123"]
    settings = settings_for(argv)
    assert (settings.nats_url, settings.data_dir, settings.gateway_port) == (
        "nats://h:1", tmp_path.resolve(), 8123)
    assert settings_for(["--nats-url", "nats://h:1", "up"]).nats_url == "nats://h:1"


def test_a_flag_after_the_command_beats_one_before_and_both_beat_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_SLOTS", "2")
    assert settings_for(["worker"]).slots == 2
    assert settings_for(["--slots", "3", "worker"]).slots == 3
    assert settings_for(["--slots", "3", "worker", "--slots", "5"]).slots == 5


def test_gateway_aliases_and_booleans(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(["gateway", "--host", "0.0.0.0", "--port", "9000", "--timeout", "7",
                             "--gateway-protect-metrics"])
    assert (settings.gateway_host, settings.gateway_port, settings.gateway_timeout_s) == (
        "0.0.0.0", 9000, 7.0)
    assert settings.gateway_protect_metrics is True
    assert settings_for(["worker", "--no-auto-place"]).auto_place is False
    assert settings_for(["nats", "--port", "4333"]).nats_port == 4333


def test_every_command_help_lists_its_settings_with_env_var_and_default() -> None:
    commands = {
        name: sub for name, sub in next(
            a for a in build_parser()._actions if hasattr(a, "choices") and a.choices
        ).choices.items()
    }
    for command, names in COMMAND_SETTINGS.items():
        for parser in subcommand_parsers(commands[command]):
            text = " ".join(parser.format_help().split())
            for name in names:
                assert config.flag(name) in text, (command, name)
                assert config.env_var(name) in text, (command, name)
    assert "default 8000" in " ".join(commands["gateway"].format_help().split())


def test_fleet_version_flag() -> None:
    result = subprocess.run([str(FLEET), "--version"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0
    assert result.stdout.strip() == f"fleet {fleet_version()}"


@pytest.mark.parametrize("argv", [["submit", "hi"], ["follow", "t-1"], ["instances", "list"]])
def test_a_command_pointed_at_no_nats_fails_at_once_with_a_hint(argv: list[str]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    result = subprocess.run([str(FLEET), *argv, "--nats-url", url], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "cannot reach NATS" in result.stderr
    assert "--nats-url" in result.stderr


def test_submit_without_a_prompt_is_refused_before_connecting() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    result = subprocess.run([str(FLEET), "submit", "--nats-url", url], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "needs a prompt" in result.stderr


def test_a_bad_setting_is_a_usage_error_naming_the_flag() -> None:
    result = subprocess.run([str(FLEET), "worker", "--slots", "many"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "--slots: 'many'" in result.stderr


async def test_follow_of_an_unknown_task_says_so_at_once(
    provisioned_nc: object, nats_url: str
) -> None:
    # The default --timeout is 300 s: within the 60 s here only by not waiting at all.
    result = subprocess.run([str(FLEET), "follow", "no-such-task", "--nats-url", nats_url],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "no events are stored for task no-such-task: unknown, expired" in result.stderr
    assert "--wait" in result.stderr


async def test_follow_wait_waits_for_a_task_with_no_events_then_gives_up(
    provisioned_nc: object, nats_url: str
) -> None:
    result = subprocess.run(
        [str(FLEET), "follow", "no-such-task", "--wait", "--timeout", "1", "--nats-url",
         nats_url], capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 1
    assert "no events are stored for task no-such-task yet: waiting up to 1 s" in result.stderr
