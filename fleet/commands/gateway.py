"""`fleet gateway`: the gateway's app composed with what is mounted on it. The gateway package
never imports the dashboard; this module does, and hands its `mount` to the app factory, so
the HTTP side's dependency is one-way (dashboard -> fleet/gateway/surface.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.config import Settings, settings_of

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from fleet.gateway.app import AddRoutes

# The gateway and the dashboard are imported when a command serves them, not when `fleet`
# builds its parser: every `fleet` process (each worker among them) paid ~0.3 s of CPU for
# them at start (python -X importtime, 2026-12-04).


def mounts() -> tuple[AddRoutes, ...]:
    """What `fleet gateway` and `fleet up` serve besides the API: the dashboard at /ui."""
    from fleet.dashboard import mount as mount_dashboard

    return (mount_dashboard,)


def build_app(settings: Settings) -> Starlette:
    """The app `fleet gateway` serves: the API and the dashboard."""
    from fleet.gateway import app as gateway_app

    return gateway_app.build_app(settings, mounts())


async def serve(
    settings: Settings, ready: asyncio.Event | None = None, sock: socket.socket | None = None
) -> None:
    """fleet.gateway.app.serve with the dashboard mounted."""
    from fleet.gateway import app as gateway_app

    await gateway_app.serve(settings, ready, sock, mounts())


async def run_gateway(settings: Settings, listen_fd: int | None = None) -> None:
    from fleet import gc_policy
    from fleet.aio import started
    from fleet.proc import Exit

    gc_policy.serving_thresholds()
    # `fleet up` (split) hands its child the socket it bound: fleet/commands/up_gateway.py.
    sock = socket.socket(fileno=listen_fd) if listen_fd is not None else None
    ready = asyncio.Event()
    # This coroutine owns the serving task: it cancels it on a stop and awaits its end.
    serving = started(serve(settings, ready, sock=sock), "gateway serving")
    # The first SIGINT/SIGTERM stops it gracefully; a second one, or the deadline, ends it.
    Exit().install().on_stop(serving.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        waiting = started(ready.wait(), "gateway ready")
        try:
            await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if ready.is_set():
            gc_policy.freeze_startup()  # the app is built and serves
        await serving


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvloop

    uvloop.run(run_gateway(settings_of(args), getattr(args, "listen_fd", None)))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gateway", help="the OpenAI-compatible HTTP gateway over the task subjects"
    )
    parser.set_defaults(func=cmd_gateway)
    # Not for people: `fleet up` passes the listening socket it bound to its gateway child.
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
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
    from fleet.gateway.keys import add_key

    settings = settings_of(args)
    path = Path(args.file or settings.api_keys_file or settings.data_dir / "api_keys.jsonl")
    key = add_key(path.expanduser(), args.tenant, args.operator)
    role = " (operator)" if args.operator else ""
    print(f"tenant {args.tenant}{role}: key added to {path} (only its sha256 is stored)")
    print(f"  export FLEET_API_KEYS_FILE={path}   # for the gateway")
    print(f"  Authorization: Bearer {key}")
    print("This is the only time the key is shown.")
    return 0
