"""`fleet`: parse flags, build Settings, call one entry point per subcommand.

Every setting a command reads is a flag of that command, accepted before the command or after
it (`fleet --nats-url X up` and `fleet up --nats-url X`); its `--help` names the environment
variable and the default. The table below says which settings each command reads.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Iterator

from fleet import config
from fleet.errors import FleetError, InvalidSetting, NatsUnavailable
from fleet.telemetry import setup

# Each module adds its subcommands with register(subparsers); handlers are set as `func`.
COMMAND_MODULES = (
    "fleet.commands.core",
    "fleet.commands.stack",
    "fleet.commands.tasks",
    "fleet.commands.batches",
    "fleet.commands.demo",
    "fleet.models.cli",
    "fleet.bus.images_cli",
    "fleet.commands.gateway",
    "fleet.commands.bench",
    "fleet.commands.trace",
)

# The commands whose processes make spans (a runner sets up its own, exporting via its worker).
TRACED_COMMANDS = ("worker", "gateway", "up", "demo", "submit")

_CLIENT = config.GENERAL + config.CONNECTION
# The settings each command reads (a command not named here reads only config.GENERAL).
COMMAND_SETTINGS: dict[str, tuple[str, ...]] = {
    "up": _CLIENT + config.WORKER + config.GATEWAY + config.EMBEDDED + config.UP,
    "worker": _CLIENT + config.WORKER,
    "gateway": _CLIENT + config.GATEWAY,
    "nats": _CLIENT + config.EMBEDDED,
    "demo": (*config.GENERAL, "gateway_port", "nats_port", "slots"),
    "instances": _CLIENT,
    "models": _CLIENT,
    "submit": _CLIENT,
    "follow": _CLIENT,
    "cancel": _CLIENT,
    "images": _CLIENT,
    "trace": _CLIENT,
    "batches": _CLIENT,
}
# Short names a command has always accepted for a setting.
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "up": {"gateway_host": ("--host",), "gateway_port": ("--port",),
           "up_processes": ("--processes",)},
    "gateway": {"gateway_host": ("--host",), "gateway_port": ("--port",),
                "gateway_timeout_s": ("--timeout",)},
    "nats": {"nats_port": ("--port",)},
    "demo": {"gateway_port": ("--port",)},
}
NATS_HINT = (
    "point fleet at a running server with --nats-url URL (or FLEET_NATS_URL); "
    "`fleet up` or `fleet nats` starts one here"
)


HELP_ORDER = (
    "demo", "up", "worker", "gateway", "nats", "models", "instances", "submit", "follow",
    "cancel", "images", "trace", "bench", "schemas", "version",
)
SETTINGS_HELP = (
    "Settings (--nats-url URL, --data-dir DIR, --log-level LEVEL, ...) go before or after the "
    "command, or in FLEET_* environment variables; `fleet COMMAND --help` lists the ones that "
    "command reads, with their variables and defaults. Start with `fleet demo` or `fleet up`."
)


def fleet_version() -> str:
    import importlib.metadata as metadata  # ~70 ms of CPU: only when a version is asked for

    try:
        return metadata.version("fleet")
    except metadata.PackageNotFoundError:
        return "unknown"


class PrintVersion(argparse.Action):
    """`--version`, looked up when given: argparse's own action takes the text up front, and
    every `fleet` process (each worker among them) builds this parser."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 help: str = "show the version and exit") -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"fleet {fleet_version()}")  # on stdout, as argparse's own action prints it
        parser.exit()


def setting_help(name: str) -> str:
    default = config.default_of(name)
    shown = "none" if default in (None, "", ()) else default
    return f"{config.description(name)} (env {config.env_var(name)}; default {shown})"


def add_settings(
    parser: argparse.ArgumentParser, names: tuple[str, ...],
    aliases: dict[str, tuple[str, ...]] | None = None, *, top: bool = False,
) -> None:
    """Flags for `names`, each stored under the setting's own name. After the command their
    default is SUPPRESS, so a flag given before the command is not overwritten by absence.
    Before it (`top`) they parse but stay out of `fleet --help`: each command's help lists
    the ones it reads."""
    group = parser.add_argument_group("settings (before or after the command)")
    taken = set(parser._option_string_actions)
    for name in dict.fromkeys(names):
        options = [o for o in (config.flag(name), *(aliases or {}).get(name, ())) if o not in taken]
        if not options:
            continue
        default = None if top else argparse.SUPPRESS
        shown = argparse.SUPPRESS if top else setting_help(name)
        if config.is_switch(name):
            group.add_argument(*options, dest=name, action=argparse.BooleanOptionalAction,
                               default=default, help=shown)
        else:
            group.add_argument(*options, dest=name, default=default, help=shown,
                               metavar=name.upper().removeprefix("GATEWAY_"))


def subcommand_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every parser below it (verbs such as `fleet images ls`)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from subcommand_parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet", usage="fleet [SETTINGS] COMMAND [ARGS]",
        description="A NATS JetStream driven worker fleet for AI models.", epilog=SETTINGS_HELP,
    )
    parser.add_argument("--version", action=PrintVersion)
    add_settings(parser, config.NAMES, top=True)
    parser._positionals.title = "commands"  # listed before the options
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       prog="fleet")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    # Listed as people meet them: starting a stack first, tools last.
    subparsers._choices_actions.sort(key=lambda action: HELP_ORDER.index(action.dest)
                                     if action.dest in HELP_ORDER else len(HELP_ORDER))
    for command, sub in subparsers.choices.items():
        names = COMMAND_SETTINGS.get(command, config.GENERAL)
        for each in subcommand_parsers(sub):
            add_settings(each, names, ALIASES.get(command))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = config.settings_of(args)
    except FleetError as exc:
        print(f"fleet: {exc.message}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command in TRACED_COMMANDS:
        setup(f"fleet-{args.command}")
    handler: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return handler(args) or 0
    except NatsUnavailable as exc:
        print(f"fleet: {exc.message}\nhint: {NATS_HINT}", file=sys.stderr)
        return 1
    except InvalidSetting as exc:  # found only once the command ran (a port already taken)
        print(f"fleet: {exc.message}", file=sys.stderr)
        return 2
    except FleetError as exc:
        print(f"fleet: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
