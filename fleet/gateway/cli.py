"""`fleet gateway --host --port`: the HTTP sidecar on uvicorn with uvloop and httptools.

`serve` is also what `fleet up` runs inside its own event loop, so it owns no signals: whoever
runs the loop stops the gateway by cancelling it, and the gateway then shuts down gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleet.bus.connect import redact_urls
from fleet.config import Settings, settings_of
from fleet.errors import FleetError
from fleet.gateway.http_server import server_options
from fleet.gateway.tenants import add_key

log = logging.getLogger(__name__)

# Open streams get this long to finish when the gateway stops; then they are cut.
GRACEFUL_SHUTDOWN_S = 5


def settings_from(args: argparse.Namespace) -> Settings:
    """The gateway's flags (see fleet.cli: --host, --port, --timeout and every gateway_*
    setting) over FLEET_* over defaults."""
    return settings_of(args)


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before uvicorn starts: from here on connections queue, not fail."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FleetError(
            f"the gateway cannot listen on {host}:{port}: {exc.strerror}; pass --port N "
            "or set FLEET_GATEWAY_PORT"
        ) from None
    sock.listen(2048)
    return sock


async def serve(settings: Settings, ready: asyncio.Event | None = None) -> None:
    import uvicorn

    from fleet.gateway.app import build_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the loop's owner handles signals and cancels us

    sock = listening_socket(settings.gateway_host, settings.gateway_port)
    host, port = sock.getsockname()[:2]
    log.info(
        "gateway listening on http://%s:%d/v1 (NATS %s)", host, port, redact_urls(settings.urls)
    )
    config = uvicorn.Config(
        build_app(settings),
        log_level=settings.log_level.lower(),
        # fleet.gateway.access (fleet/gateway/tracing.py) writes the one line per request.
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **server_options(settings),
    )
    server = Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    if ready is not None:
        ready.set()
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        server.should_exit = True
        # Streams get their grace; a lifespan stuck on a broker that is down gets no more.
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(serving, GRACEFUL_SHUTDOWN_S + 1)
        raise
    finally:
        sock.close()


async def run_gateway(settings: Settings) -> None:
    from fleet.proc import Exit

    serving = asyncio.ensure_future(serve(settings))
    # The first SIGINT/SIGTERM stops it gracefully; a second one, or the deadline, ends it.
    Exit().install().on_stop(serving.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await serving


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvloop

    uvloop.run(run_gateway(settings_from(args)))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gateway", help="the OpenAI-compatible HTTP gateway over the task subjects"
    )
    parser.set_defaults(func=cmd_gateway)
    keys = parser.add_subparsers(dest="gateway_command").add_parser(
        "keys", help="API keys and their tenants (the keys file)"
    )
    add = keys.add_subparsers(dest="keys_command", required=True).add_parser(
        "add", help="make a key for a tenant, print it once, append its hash to the keys file"
    )
    add.add_argument("--tenant", required=True, help="1-64 letters, digits, - or _")
    add.add_argument("--operator", action="store_true",
                     help="the tenant may change the fleet from the dashboard and sees all tasks")
    add.add_argument(
        "--file", help="the keys file (default: FLEET_API_KEYS_FILE, else DATA_DIR/api_keys.jsonl)"
    )
    add.set_defaults(func=cmd_keys_add)


def cmd_keys_add(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    path = Path(args.file or settings.api_keys_file or settings.data_dir / "api_keys.jsonl")
    key = add_key(path.expanduser(), args.tenant, args.operator)
    role = " (operator)" if args.operator else ""
    print(f"tenant {args.tenant}{role}: key added to {path} (only its sha256 is stored)")
    print(f"  export FLEET_API_KEYS_FILE={path}   # for the gateway")
    print(f"  Authorization: Bearer {key}")
    print("This is the only time the key is shown.")
    return 0
