"""`fleet`: parse flags, build Settings, call one entry point per subcommand."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from fleet.errors import FleetError
from fleet.telemetry import setup

# Each module adds its subcommands with register(subparsers); handlers are set as `func`.
COMMAND_MODULES = (
    "fleet.commands.core",
    "fleet.commands.stack",
    "fleet.commands.tasks",
    "fleet.commands.demo",
    "fleet.models.cli",
    "fleet.bus.images_cli",
    "fleet.gateway.cli",
    "fleet.commands.bench",
    "fleet.trace.cli",
)

# The commands whose processes make spans (a runner sets up its own, exporting via its worker).
TRACED_COMMANDS = ("worker", "gateway", "up", "demo", "submit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet", description="A NATS JetStream driven worker fleet for AI models."
    )
    parser.add_argument("--nats-url", help="NATS server URL (env FLEET_NATS_URL)")
    parser.add_argument("--data-dir", type=Path, help="data directory (env FLEET_DATA_DIR)")
    parser.add_argument("--log-level", help="debug, info, warning (env FLEET_LOG_LEVEL)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=(args.log_level or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command in TRACED_COMMANDS:
        setup(f"fleet-{args.command}")
    handler: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return handler(args) or 0
    except FleetError as exc:
        print(f"fleet: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
