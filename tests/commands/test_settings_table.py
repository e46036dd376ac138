"""Settings are declared once (fleet/config.py): the flags, `--help`, the environment names
and README's table all come from the declarations, and the README's table is current."""

from __future__ import annotations

from fleet import config
from fleet.cli import COMMAND_SETTINGS
from fleet.commands import settings_table


def test_the_readme_settings_table_is_current() -> None:
    readme = settings_table.README.read_text()
    assert settings_table.with_table(readme) == readme, (
        "run `.venv/bin/python -m fleet.commands.settings_table`")


def test_every_setting_is_declared_with_a_meaning_and_a_known_group() -> None:
    for name in config.NAMES:
        declared = config.declared(name)
        assert declared.help.strip(), name
        assert declared.groups and set(declared.groups) <= set(config.GROUPS), name


def test_every_setting_is_read_by_some_command_and_names_its_variable_and_flag() -> None:
    read = {name for names in COMMAND_SETTINGS.values() for name in names}
    assert set(config.NAMES) <= read
    assert len({config.env_var(name) for name in config.NAMES}) == len(config.NAMES)
    assert config.env_var("gateway_keep_alive_s") == "FLEET_GATEWAY_KEEP_ALIVE_S"
    assert config.flag("gateway_keep_alive_s") == "--gateway-keep-alive-s"


def test_a_new_row_appears_when_a_setting_is_declared() -> None:
    table = settings_table.table()
    assert table.count("\n| `--") == len(config.NAMES)
    assert "| `--[no-]auto-place` | `FLEET_AUTO_PLACE` | on |" in table
    assert "`--gateway-timeout-s` (`--timeout` on gateway)" in table
    assert "| `--data-dir` | `FLEET_DATA_DIR` | `~/.local/share/fleet` |" in table
