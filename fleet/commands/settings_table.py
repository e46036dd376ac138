"""The README's table of settings, made from their declarations (`fleet.config`) and the
commands that read them (`fleet.cli`), so it cannot drift from `--help`.

    .venv/bin/python -m fleet.commands.settings_table          # rewrite README.md's table
    .venv/bin/python -m fleet.commands.settings_table --check  # exit 1 if it is not current
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from fleet import config
from fleet.cli import ALIASES, COMMAND_SETTINGS, HELP_ORDER

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = ("<!-- settings table: made by `python -m fleet.commands.settings_table`; "
         "edit fleet/config.py -->")
END = "<!-- end of settings table -->"


def shown_default(name: str) -> str:
    text = config.declared(name).shown_default
    if text:
        return f"`{text}`"
    value: Any = config.default_of(name)
    if isinstance(value, bool):
        return "on" if value else "off"
    return "—" if value in (None, "", ()) else f"`{value}`"


def flag_cell(name: str) -> str:
    options = f"`--[no-]{config.flag(name)[2:]}`" if config.is_switch(name) else (
        f"`{config.flag(name)}`")
    by_alias: dict[str, list[str]] = {}
    for command, aliases in ALIASES.items():
        for alias in aliases.get(name, ()):
            by_alias.setdefault(alias, []).append(command)
    for alias, commands in by_alias.items():
        options += f" (`{alias}` on {', '.join(commands)})"
    return options


def commands_cell(name: str) -> str:
    if name in config.GENERAL:
        return "all"
    if name in config.CONNECTION:
        return "all that connect"
    readers = [command for command, names in COMMAND_SETTINGS.items() if name in names]
    readers.sort(key=lambda c: HELP_ORDER.index(c) if c in HELP_ORDER else len(HELP_ORDER))
    return ", ".join(readers)


def table() -> str:
    rows = ["| flag | environment | default | what | commands |", "|---|---|---|---|---|"]
    for name in config.NAMES:
        what = config.description(name).replace("|", "\\|")
        rows.append(f"| {flag_cell(name)} | `{config.env_var(name)}` | {shown_default(name)} "
                    f"| {what} | {commands_cell(name)} |")
    return "\n".join(rows)


def with_table(readme: str) -> str:
    """`readme` with the text between the markers replaced by the current table."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.DOTALL)
    if not pattern.search(readme):
        raise SystemExit(f"README.md has no settings table markers ({BEGIN} ... {END})")
    return pattern.sub(lambda _: f"{BEGIN}\n{table()}\n{END}", readme, count=1)


def main(argv: list[str]) -> int:
    current = README.read_text()
    wanted = with_table(current)
    if "--check" in argv:
        if wanted != current:
            print("README.md's settings table is not current: run "
                  "`.venv/bin/python -m fleet.commands.settings_table`", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
