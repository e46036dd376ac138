"""Long-running roles: `fleet worker`, `fleet up` (the embedded stack), `fleet instances`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fleet.bus.connect import connect
from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import provision
from fleet.commands.core import check_mflux, settings_from
from fleet.config import Settings
from fleet.models.catalog import get_card
from fleet.placement import place, read_instances, remove

if TYPE_CHECKING:
    from fleet.worker.main import Worker

log = logging.getLogger(__name__)


def quiet_builders() -> None:
    """Model builds run inside the worker; mflux's saver would draw progress bars on its
    console. tqdm reads this when it is first imported, so set it before any build."""
    os.environ.setdefault("TQDM_DISABLE", "1")


async def wait_for_signal(*tasks: asyncio.Task[None]) -> None:
    """Until SIGINT/SIGTERM, or until one of `tasks` ends (then its error is raised)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    for task in done - {waiter}:
        task.result()


async def stop_worker(worker: Worker, task: asyncio.Task[None], timeout: float = 30.0) -> None:
    """A clean stop (runners shut down, unstarted tasks handed back); a cancel if it hangs."""
    if task.done():
        return
    worker.stop()
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        log.warning("worker did not stop within %.0f s; cancelling it", timeout)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def run_worker(settings: Settings) -> None:
    from fleet.worker.main import Worker

    if warning := check_mflux():
        log.warning(warning)
    quiet_builders()
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    try:
        await wait_for_signal(task)
    finally:
        await stop_worker(worker, task)


@contextlib.asynccontextmanager
async def stack(settings: Settings, models: list[str]) -> AsyncIterator[Settings]:
    """An embedded nats-server (unless a URL is given), a worker, the gateway; `models`
    placed on this node. Yields the settings the roles use."""
    from fleet.gateway.cli import serve
    from fleet.worker.main import Worker

    quiet_builders()
    server = None
    if settings.nats_url is None:
        server = EmbeddedNats(
            settings.nats_store_dir, port=settings.nats_port,
            log_file=settings.data_dir / "nats.log",
        ).start()
        settings = settings_with_url(settings, server.url)
    try:
        nc = await connect(settings.url, "fleet-up")
        await provision(nc)
        worker = Worker(settings)
        worker_task = asyncio.create_task(worker.run())
        await _first(worker.ready.wait(), worker_task)
        for model in models:
            instance = await place(nc.jetstream(), get_card(model, settings.data_dir),
                                   node_id=worker.cluster.node_id, slots=settings.slots,
                                   if_absent=True)
            log.info("placed %s as %s", model, instance.instance_id)
        gateway_ready = asyncio.Event()
        gateway_task = asyncio.create_task(serve(settings, gateway_ready))
        await _first(gateway_ready.wait(), gateway_task)
        try:
            yield settings
        finally:
            gateway_task.cancel()
            await asyncio.gather(gateway_task, return_exceptions=True)
            await stop_worker(worker, worker_task)
            await nc.close()
    finally:
        if server:
            server.stop()


async def _first(waiting: object, task: asyncio.Task[None]) -> None:
    """Wait for readiness, but surface the role's own error if it dies first."""
    ready = asyncio.ensure_future(waiting)  # type: ignore[arg-type]
    done, _ = await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()
        raise RuntimeError("a role ended before it was ready")


def settings_with_url(settings: Settings, url: str) -> Settings:
    from dataclasses import replace

    return replace(settings, nats_url=url)


async def run_up(settings: Settings, models: list[str]) -> None:
    async with stack(settings, models) as running:
        print(
            f"fleet up: NATS {running.url}, gateway http://{running.gateway_host}:"
            f"{running.gateway_port}/v1, data {running.data_dir}", file=sys.stderr, flush=True,
        )
        await wait_for_signal()


async def instances_cmd(settings: Settings, args: argparse.Namespace) -> int:
    nc = await connect(settings.url, "fleet-cli")
    js = nc.jetstream()
    try:
        if args.action == "place":
            card = get_card(args.model, settings.data_dir)
            instance = await place(js, card, node_id=args.node, slots=args.slots)
            print(f"placed {instance.instance_id} on {instance.shards[0].node_id}")
        elif args.action == "remove":
            await remove(js, args.instance_id)
            print(f"removed {args.instance_id}")
        else:
            for inst in await read_instances(js):
                nodes = ",".join(s.node_id for s in inst.shards)
                print(f"{inst.instance_id:32} {inst.model:20} slots={inst.slots} nodes={nodes}")
    finally:
        await nc.close()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="run the node agent")
    p.add_argument("--slots", type=int, help="concurrent tasks per text runner")
    _auto_place_flag(p)
    p.set_defaults(func=lambda a: asyncio.run(run_worker(
        settings_from(a, slots=a.slots, auto_place=a.auto_place)
    )))

    p = subparsers.add_parser("up", help="embedded NATS + worker + gateway on this machine")
    p.add_argument("--models", default="smollm2-135m,tiny-flux2", help="comma-separated ids")
    p.add_argument("--host", help="gateway host")
    p.add_argument("--port", type=int, help="gateway port")
    p.add_argument("--nats-port", type=int, help="embedded nats-server port")
    p.add_argument("--slots", type=int)
    _auto_place_flag(p)
    p.set_defaults(func=lambda a: asyncio.run(run_up(
        settings_from(a, gateway_host=a.host, gateway_port=a.port, nats_port=a.nats_port,
                      slots=a.slots, auto_place=a.auto_place),
        [m for m in a.models.split(",") if m],
    )))

    p = subparsers.add_parser("instances", help="place, list or remove model instances")
    sub = p.add_subparsers(dest="action", required=True)
    place_p = sub.add_parser("place")
    place_p.add_argument("--model", required=True)
    place_p.add_argument("--node", help="node id (default: the live node with most memory)")
    place_p.add_argument("--slots", type=int, default=4)
    sub.add_parser("list")
    remove_p = sub.add_parser("remove")
    remove_p.add_argument("instance_id")
    p.set_defaults(func=lambda a: asyncio.run(instances_cmd(settings_from(a), a)))


def _auto_place_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-auto-place", dest="auto_place", action="store_false", default=None,
        help="do not place a model because tasks wait for it (FLEET_AUTO_PLACE=0)",
    )
