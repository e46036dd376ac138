"""Long-running roles: `fleet worker`, `fleet up` (the embedded stack), `fleet instances`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import TYPE_CHECKING

from fleet import gc_policy
from fleet.aio import log_failure
from fleet.bus.auth_gen import as_role, ensure_auth
from fleet.bus.connect import connect_with, redact_urls
from fleet.bus.embedded import EmbeddedNats
from fleet.bus.kv_read import live_values
from fleet.bus.provision import provision
from fleet.bus.weights import FleetModels
from fleet.commands.announce import announce_own_runners, announce_runners, status_text
from fleet.commands.core import check_mflux, secured_config
from fleet.commands.up_gateway import RoleExited, gateway_process
from fleet.config import Settings, settings_of
from fleet.errors import FleetError, InvalidSetting
from fleet.models.catalog import get_card
from fleet.placement import find_instance, place, read_instances, read_nodes, remove
from fleet.placement_replicas import place_replicas
from fleet.proc import Exit, guard_child, run_main
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, RunnerRecord, ShardAssignment

if TYPE_CHECKING:
    from nats.aio.client import Client

    from fleet.worker.main import Worker

log = logging.getLogger(__name__)


def quiet_builders() -> None:
    """Model builds run inside the worker; mflux's saver would draw progress bars on its
    console. tqdm reads this when it is first imported, so set it before any build."""
    os.environ.setdefault("TQDM_DISABLE", "1")


# A clean stop of the worker gets this long before it is cancelled; the process's Exit
# deadline (fleet.proc) bounds the whole stop whatever hangs.
WORKER_STOP_S = 5.0


class StopRequested(Exception):
    """A signal came while the stack was still starting."""


async def wait_for_signal(exit_: Exit, *tasks: asyncio.Task[None]) -> None:
    """Until SIGINT/SIGTERM, or until one of `tasks` ends (then its error is raised)."""
    waiter = asyncio.create_task(exit_.stopping.wait())
    done, _ = await asyncio.wait({waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    for task in done - {waiter}:
        task.result()


async def stop_worker(
    worker: Worker, task: asyncio.Task[None], timeout: float = WORKER_STOP_S
) -> None:
    """A clean stop (runners shut down, unstarted tasks handed back); a cancel if it hangs
    or if the worker never got as far as its loop (still connecting or registering)."""
    if task.done():
        return
    if not worker.ready.is_set():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    worker.stop()
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        log.warning("worker did not stop within %.0f s; cancelling it", timeout)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def run_worker(settings: Settings, exit_: Exit | None = None) -> int:
    from fleet.worker.main import Worker

    exit_ = exit_ or Exit().install()
    if warning := check_mflux():
        log.warning(warning)
    quiet_builders()
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    news = asyncio.create_task(_worker_news(worker), name="fleet-worker-runners")
    news.add_done_callback(_log_failure)
    try:
        await wait_for_signal(exit_, task)
    finally:
        news.cancel()
        await asyncio.gather(news, return_exceptions=True)
        await stop_worker(worker, task)
    return 0


async def _worker_news(worker: Worker) -> None:
    """A standalone worker's console says what `fleet up`'s does of its runners: fetches
    and ready (or failed) runners, this node's only."""
    await worker.ready.wait()
    gc_policy.freeze_startup()  # the worker's startup is done: out of every later collection
    await announce_own_runners(lambda: worker.cluster.records.values())


@contextlib.asynccontextmanager
async def stack(
    settings: Settings, models: list[str], exit_: Exit | None = None, fresh: bool = False
) -> AsyncIterator[Settings]:
    """An embedded nats-server (unless a URL is given), a worker, the gateway; `models`
    placed on this node. Yields the settings the roles use. With `exit_`, a stop requested
    while the stack still starts raises StopRequested after the same clean-up. The embedded
    server keeps its store in the data dir, so the instances placed by an earlier run come
    back: said at start, or removed first with `fresh`."""
    if fresh and settings.nats_url is not None:
        raise InvalidSetting("--fresh clears the instances of the embedded server only; on "
                             "FLEET_NATS_URL remove them with `fleet instances remove ID`")
    from fleet.commands.gateway import serve
    from fleet.gateway.app import listening_socket
    from fleet.worker.main import Worker

    quiet_builders()
    stopping = exit_.stopping if exit_ else asyncio.Event()
    # Its port first: taken, nothing has started yet (no runner left to stop).
    gateway_socket = listening_socket(settings.gateway_host, settings.gateway_port)
    settings = replace(settings, gateway_port=gateway_socket.getsockname()[1])  # 0: picked
    server, guard = None, None
    # An embedded server runs secured when `fleet nats --auth` wrote <data>/auth: then each
    # role below connects as its own NATS user (docs/permissions.md).
    config = secured_config(settings.data_dir) if settings.nats_url is None else None
    if settings.nats_url is None:
        try:
            server = EmbeddedNats(
                settings.nats_store_dir, port=settings.nats_port, config=config,
                log_file=settings.data_dir / "nats.log",
            ).start()
        except BaseException:
            gateway_socket.close()
            raise
        # Even a SIGKILL of this process must not leave the server running.
        guard = guard_child(server.process.pid) if server.process else None
        if exit_:
            exit_.at_forced_exit(lambda: server.stop(timeout=2.0))
        settings = settings_with_url(settings, server.url)
    worker: Worker | None = None
    worker_task: asyncio.Task[None] | None = None
    ending = asyncio.Event()  # set when `fleet up` stops its roles: their end is no failure
    try:
        secured = config is not None
        nc = await connect_with(as_role(settings, "operator", secured), "fleet-up")
        try:
            await provision(nc, replicas=settings.replicas)
            if server is not None:
                await _restore_or_clear(nc, fresh)
            # The worker and the gateway are children of one task group: one that fails (or
            # ends) at any time, before it is ready or while it serves, cancels what waits
            # here and fails `fleet up` with its error (_roles).
            async with _roles() as roles:
                gateway_task: asyncio.Task[None] | None = None
                try:
                    worker = Worker(as_role(settings, "worker", secured))
                    worker_task = roles.create_task(_worker_role(worker, ending))
                    await _ready(worker.ready.wait(), stopping)
                    for model in models:
                        await _place_here(nc, settings, model, worker.cluster.node_id)
                    gateway_ready = asyncio.Event()
                    gateway_settings = as_role(settings, "gateway", secured)
                    if settings.up_processes == "split":  # fleet/commands/up_gateway.py
                        serving = gateway_process(
                            gateway_settings, gateway_socket, gateway_ready,
                            exit_.at_forced_exit if exit_ else None)
                    else:
                        serving = serve(gateway_settings, gateway_ready, gateway_socket)
                    gateway_task = roles.create_task(_role("gateway", serving, ending))
                    await _ready(gateway_ready.wait(), stopping)
                    await _ready(serves_requests(settings), stopping)
                    yield as_role(settings, "operator", secured)
                finally:  # before the group ends: the worker stops cleanly, not cancelled
                    ending.set()
                    if gateway_task is not None:
                        gateway_task.cancel()
                        await asyncio.gather(gateway_task, return_exceptions=True)
                    if worker_task is not None:  # cancelled, it stops cleanly (_worker_role)
                        worker_task.cancel()
                        await asyncio.gather(worker_task, return_exceptions=True)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
    finally:
        gateway_socket.close()  # served and closed already, or never served
        if server:
            server.stop()
        if guard:
            guard.release()


async def _restore_or_clear(nc: Client, fresh: bool) -> None:
    """Before the worker starts: the instances an earlier `fleet up` placed on this data dir
    are named (they start again), or removed with --fresh."""
    js = nc.jetstream()
    earlier = await read_instances(js)
    if not earlier:
        return
    named = ", ".join(f"{i.instance_id} ({i.model})" for i in earlier)
    if fresh:
        for instance in earlier:
            await remove(js, instance.instance_id)
        log.info("--fresh: removed %d instance(s) placed before: %s", len(earlier), named)
    else:
        log.info("restoring %d instance(s) placed before on this data dir: %s; to start "
                 "without them: fleet up --fresh", len(earlier), named)


async def _place_here(nc: Client, settings: Settings, model: str, node_id: str) -> None:
    """Place `model` on this node, or keep the instance the fleet has of it already."""
    js = nc.jetstream()
    card = await card_of(nc, model, settings)
    if existing := await find_instance(js, card.id):
        nodes = ",".join(shard.node_id for shard in existing.shards)
        alive = {node.node_id for node in await read_nodes(js)}
        if all(shard.node_id in alive for shard in existing.shards):
            log.info("kept existing instance %s on node %s", existing.instance_id, nodes)
        else:
            log.warning(
                "kept existing instance %s on node %s, which is not alive: it moves to a live "
                "node once the worker has seen that node silent for its heartbeat TTL",
                existing.instance_id, nodes,
            )
        return
    instance = await place(js, card, node_id=node_id, slots=settings.slots)
    log.info("placed %s as %s on node %s", model, instance.instance_id, node_id)


async def card_of(nc: Client, model: str, settings: Settings) -> ModelCard:
    """The fleet's card of `model` (FLEET_MODELS: added on any machine), else a local one."""
    return await FleetModels(nc).get(model) or get_card(model, settings.data_dir)


@contextlib.asynccontextmanager
async def _roles() -> AsyncIterator[asyncio.TaskGroup]:
    """An asyncio.TaskGroup whose failure is raised as the one error that caused it (a
    role's FleetError, StopRequested), not as an ExceptionGroup; any other is logged."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as failed:
        first, *others = _leaves(failed)
        for other in others:
            log.error("fleet up: also failed: %r", other, exc_info=other)
        raise first from None


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


async def _role(name: str, run: Awaitable[None], ending: asyncio.Event) -> None:
    """A role of the group: its end before `fleet up` stops it is a failure."""
    await run
    if not ending.is_set():
        raise RuntimeError(f"the {name} ended while `fleet up` ran")


async def _worker_role(worker: Worker, ending: asyncio.Event) -> None:
    """The worker as a role: cancelled by its group (the gateway failed), it still stops
    cleanly once it got as far as its loop (stop_worker: runners stopped, tasks handed back)."""
    # Owned by this role: awaited here, so its failure fails the group; during the stop,
    # where stop_worker does not raise what it ended with, a failure is logged.
    running = asyncio.create_task(_role("worker", worker.run(), ending), name="fleet-up worker")
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        ending.set()  # its end from here on is the stop's, not a failure
        running.add_done_callback(log_failure)
        await stop_worker(worker, running)
        raise


async def _ready(waiting: Awaitable[object], stopping: asyncio.Event) -> None:
    """Until `waiting` is done (a role's readiness); StopRequested when a stop is requested
    first. A role that fails meanwhile cancels this (its task group does)."""
    async with asyncio.TaskGroup() as group:
        ready = group.create_task(_awaited(waiting))
        stop = group.create_task(stopping.wait())
        await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        ready_first = ready.done()
        ready.cancel()
        stop.cancel()
    if not ready_first:
        raise StopRequested()


async def _awaited(waiting: Awaitable[object]) -> None:
    await waiting


# How long `fleet up` waits for its gateway's /healthz before it says it serves anyway.
GATEWAY_HEALTHY_S = 60.0


async def serves_requests(settings: Settings) -> None:
    """Until the gateway's own /healthz answers 200 (connected to NATS, streams present):
    `fleet up` announces that it serves only then. Its listening socket accepts at once, but
    under load its NATS connection came a second later and a first request got 503 (a test
    of `fleet up --auth` did). Past GATEWAY_HEALTHY_S it warns and goes on: /healthz says why."""
    import httpx

    host = settings.gateway_host if settings.gateway_host not in ("", "0.0.0.0", "::") \
        else "127.0.0.1"
    url = f"http://{host}:{settings.gateway_port}/healthz"
    deadline = asyncio.get_running_loop().time() + GATEWAY_HEALTHY_S
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).status_code == 200:
                    return
            if asyncio.get_running_loop().time() > deadline:
                log.warning("the gateway is not healthy after %.0f s: see %s", GATEWAY_HEALTHY_S,
                            url)
                return
            await asyncio.sleep(0.1)  # a readiness probe's pace


def settings_with_url(settings: Settings, url: str) -> Settings:
    return replace(settings, nats_url=url)


async def run_up(
    settings: Settings, models: list[str], exit_: Exit | None = None, fresh: bool = False
) -> int:
    exit_ = exit_ or Exit().install()
    try:
        async with stack(settings, models, exit_, fresh) as running:
            gc_policy.freeze_startup()  # worker and gateway serve: out of later collections
            print(started_text(running), file=sys.stderr, flush=True)
            news = asyncio.create_task(announce_runners(running), name="fleet-up-runners")
            news.add_done_callback(_log_failure)
            try:
                await wait_for_signal(exit_)
            finally:
                news.cancel()
                await asyncio.gather(news, return_exceptions=True)
    except StopRequested:
        log.info("stopped while starting")
    except RoleExited as exc:  # its own status, not 1: what ended it says why
        print(f"fleet: {exc.message}", file=sys.stderr, flush=True)
        return exc.status
    return 0


def started_text(running: Settings) -> str:
    """What `fleet up` prints once it serves: where everything is (no secret of a URL)."""
    base = f"http://{running.gateway_host}:{running.gateway_port}"
    return "\n".join([
        f"fleet up: NATS {redact_urls(running.urls)}, data {running.data_dir}",
        f"  OpenAI API  {base}/v1",
        f"  dashboard   {base}/ui",
        f"  API docs    {base}/docs",
    ])


def _log_failure(task: asyncio.Task[None]) -> None:
    """Runner news is a courtesy: its failure is logged and the stack runs on."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("runner announcements stopped: %s", exc)


async def instances_cmd(settings: Settings, args: argparse.Namespace) -> int:
    nc = await connect_with(settings, "fleet-cli")
    js = nc.jetstream()
    try:
        if args.action == "place":
            card = await card_of(nc, args.model, settings)
            if getattr(args, "shards", 1) > 1:
                if args.replicas != 1:
                    raise InvalidSetting("--shards and --replicas do not combine (yet)")
                placed = [await place(js, card, slots=args.slots, shards=args.shards)]
            else:
                placed = await place_replicas(
                    js, card, args.replicas, node_id=args.node, slots=args.slots
                )
            for instance in placed:
                print(f"placed {instance.instance_id} on "
                      f"{', '.join(shard_text(s) for s in instance.shards)}")
        elif args.action == "remove":
            if not any(i.instance_id == args.instance_id for i in await read_instances(js)):
                raise FleetError(f"no instance {args.instance_id} is placed (removed already, "
                                 "or never placed): `fleet instances list` shows them")
            await remove(js, args.instance_id)
            print(f"removed {args.instance_id}")
        else:
            runners = await live_values(js, subjects.RUNNERS_BUCKET, RunnerRecord)
            for inst in await read_instances(js):
                print(instance_lines(inst, runners))
    finally:
        await nc.close()
    return 0


def shard_text(shard: ShardAssignment) -> str:
    if shard.world_size == 1:
        return shard.node_id
    return f"{shard.node_id} (rank {shard.rank}, layers {shard.start_layer}-{shard.end_layer})"


def instance_lines(inst: Instance, runners: list[RunnerRecord]) -> str:
    """One line per instance; a sharded one adds a line per shard: node, layers, state."""
    mine = [r for r in runners if r.instance_id == inst.instance_id]
    nodes = ",".join(s.node_id for s in inst.shards)
    if not inst.sharded:
        # A runner record once placed; a download record before that.
        states = "; ".join(status_text(r.status) for r in mine) or "pending"
        return f"{inst.instance_id:32} {inst.model:20} slots={inst.slots} nodes={nodes} {states}"
    lines = [f"{inst.instance_id:32} {inst.model:20} slots={inst.slots} "
             f"shards={len(inst.shards)} nodes={nodes}"]
    for shard in inst.shards:
        states = "; ".join(
            status_text(r.status) for r in mine if r.node_id == shard.node_id
        ) or "pending"
        lines.append(f"  rank {shard.rank}  {shard.node_id:24} layers {shard.start_layer}-"
                     f"{shard.end_layer}  {states}")
    return "\n".join(lines)


# An environment variable only (fleet/models/store.py reads it), so said here in words.
MODEL_SOURCES_HELP = (
    "FLEET_MODEL_SOURCES (comma-separated; default local,fleet): where this worker may get "
    "weights it lacks: `local` builds or converts the built-in models here, `fleet` fetches "
    "what `fleet models add` published to FLEET_WEIGHTS. `fleet` alone: fetch only."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="run the node agent", epilog=MODEL_SOURCES_HELP)
    # run_main: signals stop it within its grace in every state, and it exits without
    # native teardown (see fleet.proc).
    p.set_defaults(func=lambda a: run_main(lambda exit_: run_worker(
        settings_of(a), exit_
    )))

    p = subparsers.add_parser("up", help="embedded NATS + worker + gateway on this machine",
                              epilog=MODEL_SOURCES_HELP)
    p.add_argument("--models", default="smollm2-135m,tiny-flux2", help="comma-separated ids")
    p.add_argument("--auth", action="store_true", help="run the embedded server secured: "
                   "generate <data>/auth unless there (once there, `fleet up` uses it anyway)")
    p.add_argument("--fresh", action="store_true", help="start without the instances an "
                   "earlier `fleet up` placed on this data dir (the embedded server keeps them "
                   "and they start again otherwise)")
    p.set_defaults(func=lambda a: run_main(lambda exit_: run_up(
        ensure_auth(settings_of(a), a.auth),
        [m for m in a.models.split(",") if m], exit_, a.fresh,
    )))

    p = subparsers.add_parser("instances", help="place, list or remove model instances")
    sub = p.add_subparsers(dest="action", required=True)
    place_p = sub.add_parser("place")
    place_p.add_argument("--model", required=True)
    place_p.add_argument("--node", help="node id (default: the live node with most memory)")
    place_p.add_argument("--slots", type=int, default=0,
                         help="tasks per text runner (0: sized from the engine and memory)")
    place_p.add_argument("--replicas", type=int, default=1,
                         help="runners of the model, one instance each, spread over nodes")
    place_p.add_argument("--shards", type=int, default=1,
                         help="split the model's layers over this many nodes (one instance, a "
                         "pipeline over mx.distributed)")
    sub.add_parser("list")
    remove_p = sub.add_parser("remove")
    remove_p.add_argument("instance_id")
    p.set_defaults(func=lambda a: asyncio.run(instances_cmd(settings_of(a), a)))

