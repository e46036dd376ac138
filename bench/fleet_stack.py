"""Fleet under test: `fleet up` in a process of its own, and a client that speaks NATS directly.

`fleet up` runs the embedded nats-server (a child process), the worker and the gateway in one
process, and the worker spawns one runner subprocess per model. The benchmark is a separate
process, as a client of mlx_lm.server is, so neither server shares an event loop with its load.

The NATS path subscribes (core NATS) to `fleet.out.<task_id>` before it publishes the task
with an awaited JetStream ack, so nothing can be missed and no JetStream consumer is created
per request; the gateway, by contrast, reads FLEET_OUT through an ordered consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.procs import free_port, stop_group
from bench.workload import Request, StreamResult, closed_loop
from fleet.bus.connect import connect, js_publish
from fleet.models.catalog import add_custom_card
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import decode_events, decode_model
from fleet.wire.events import TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration

READY_TIMEOUT_S = 300.0
# `fleet up` exits in ~1 s when idle since start, but after serving tasks it can hang on SIGTERM
# for 30 s ("nats: timeout"): a benchmark does not wait for that, it kills the process group.
STOP_GRACE_S = 5.0
CLOSE_TIMEOUT_S = 5.0


def seed_data_dir(data_dir: Path, models: dict[str, Path], custom: dict[str, Path]) -> None:
    """A fresh data dir whose models/ links to the built models (built-in ids) and whose custom
    cards point at model directories (ids the catalog does not ship)."""
    models_dir = data_dir / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    for model_id, path in models.items():
        link = models_dir / model_id
        if not link.exists():
            link.symlink_to(path, target_is_directory=True)
    for model_id, path in custom.items():
        add_custom_card(data_dir, model_id, path)


class FleetStack:
    def __init__(self, data_dir: Path, models: list[str], slots: int, env: dict[str, str],
                 api_key: str | None = None, cwd: Path | None = None) -> None:
        self.data_dir = data_dir
        self.models = models
        self.slots = slots
        self.env = env
        # A key the gateway takes when the env names a keys file (its /models needs one then).
        self.api_key = api_key
        # The checkout `fleet up` runs from (`python -m` puts it first on sys.path): another
        # commit's worktree, for an A/B in one run (bench.dispatch_ab); None: this one.
        self.cwd = cwd
        self.nats_port = free_port()
        self.gateway_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.nc: Client | None = None
        self.startup_s: float | None = None
        self.stop_s: float | None = None
        # runner id -> model, from the ready records: a runner started from a standby process
        # (fleet/worker/standby.py) has only its id on its command line, not its spec.
        self.runner_models: dict[str, str] = {}
        # model -> the slots its runner took (with `slots` 0, the product's default width)
        self.runner_slots: dict[str, int] = {}

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    async def start(self) -> Client:
        began = time.perf_counter()
        with (self.data_dir / "fleet-up.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fleet.cli", "--data-dir", str(self.data_dir),
                 "--log-level", "warning", "up", "--models", ",".join(self.models),
                 "--port", str(self.gateway_port), "--nats-port", str(self.nats_port),
                 # The plumbing phase queues tasks for models it never serves on purpose.
                 "--slots", str(self.slots), "--no-auto-place"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=self.cwd,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        self.nc = await self._connect(deadline)
        for model in self.models:
            record = await wait_runner_ready(self.nc, model, deadline, alive=self.check_alive)
            self.runner_models[record.runner_id] = model
            self.runner_slots[model] = record.slots
        await self._gateway_up(deadline)
        self.startup_s = time.perf_counter() - began
        return self.nc

    async def _connect(self, deadline: float) -> Client:
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(Exception):
                nc = await connect(self.nats_url, "fleet-bench", connect_timeout=1.0)
                await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)  # provisioned yet?
                return nc
            await asyncio.sleep(0.2)  # polling a starting process, bounded by the deadline
        raise TimeoutError("fleet up: NATS did not come up in time")

    async def _gateway_up(self, deadline: float) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(headers=headers) as client:
            while time.monotonic() < deadline:
                self.check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.base_url}/models")).is_success:
                        return
                await asyncio.sleep(0.1)  # polling a starting process, bounded by the deadline
        raise TimeoutError("fleet up: the gateway did not answer in time")

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"fleet up exited; see {self.data_dir / 'fleet-up.log'}")

    def processes(self) -> dict[str, psutil.Process]:
        """`up` (worker + gateway, or the worker alone beside a `gateway` process of its
        own), `nats` (nats-server) and `runner:<model>` by pid."""
        assert self.process is not None
        root = psutil.Process(self.process.pid)
        found = {"up": root}
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmdline = " ".join(child.cmdline())
                if "nats-server" in cmdline:
                    found["nats"] = child
                elif "--listen-fd" in cmdline:  # `fleet up --processes split`'s gateway
                    found["gateway"] = child
                elif "fleet.runner.main" in cmdline:
                    model = next((m for m in self.models if f'"id":"{m}"' in cmdline), None) \
                        or next((m for r, m in self.runner_models.items() if r in cmdline), "?")
                    found.setdefault(f"runner:{model}", child)
        return found

    async def stop(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):  # a client whose server died may never close
                await asyncio.wait_for(self.nc.close(), CLOSE_TIMEOUT_S)
        if self.process is None or self.process.poll() is not None:
            return
        self.stop_s = await asyncio.to_thread(stop_group, self.process, STOP_GRACE_S)


async def wait_runner_ready(
    nc: Client, model: str, deadline: float, node_id: str | None = None,
    alive: Callable[[], None] | None = None,
) -> RunnerRecord:
    """The first ready record of `model` (on `node_id`, if given). `alive` raises when the
    process that should bring the runner up has died: then no wait is worth finishing."""
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    try:
        while (left := deadline - time.monotonic()) > 0:
            if alive is not None:
                alive()
            try:
                entry = await watcher.updates(timeout=max(0.05, min(left, 1.0)))
            except TimeoutError:
                continue
            if entry is None or not entry.value:
                continue
            record = decode_model(RunnerRecord, entry.value)
            wanted = node_id is None or record.node_id == node_id
            if record.model == model and record.status.state == "ready" and wanted:
                return record
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watcher.stop(), CLOSE_TIMEOUT_S)
    raise TimeoutError(f"no runner of {model} became ready")


def text_task(task_id: str, model: str, request: Request) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model=model,
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in request.messages],  # type: ignore[arg-type]
        max_tokens=request.max_tokens, temperature=0.0, logit_bias=request.logit_bias,
    )


class NatsPath:
    """Fleet over NATS directly: publish the task, read `fleet.out.<task_id>`."""

    name = "fleet_nats"

    def __init__(self, nc: Client, model: str, timeout_s: float = 600.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.model = model
        self.timeout_s = timeout_s
        self.latencies: list[float] | None = None  # set to a list to collect token delivery

    async def stream(self, request: Request, t0: float) -> StreamResult:
        task_id = f"bench-{secrets.token_hex(8)}"
        result = StreamResult(start_s=time.perf_counter() - t0)
        done = asyncio.Event()
        counted = 0

        async def on_event(msg: Msg) -> None:
            nonlocal counted
            now = time.perf_counter() - t0
            for event in decode_events(msg.data):  # a terminal may carry the last tokens
                if isinstance(event, TokenChunk):
                    if self.latencies is not None:
                        self.latencies.append(time.time() - event.at)
                    result.first_s = now if result.first_s is None else result.first_s
                    result.last_s = now
                    counted += 1
                elif isinstance(event, TaskAccepted):
                    result.extra["accepted_s"] = now
                elif isinstance(event, TaskFinished):
                    if event.usage is not None:
                        result.tokens = event.usage.completion_tokens
                        result.prompt_tokens = event.usage.prompt_tokens
                    if event.stats is not None and event.stats.time_to_first_token_s is not None:
                        # Admitted by the engine -> its first token, on the runner's clock.
                        result.extra["runner_ttft_s"] = event.stats.time_to_first_token_s
                    if event.status != "completed":
                        result.error = f"{event.status}: {event.message}"
                    done.set()

        sub = await self.nc.subscribe(subjects.out(task_id), cb=on_event)
        try:
            task = text_task(task_id, self.model, request)
            await js_publish(self.js, subjects.tasks(self.model), task, msg_id=task_id)
            await asyncio.wait_for(done.wait(), self.timeout_s)
        except TimeoutError:
            result.error = "timed out"
        finally:
            await sub.unsubscribe()
        result.tokens = result.tokens or counted
        result.extra["chunks"] = counted
        return result

    async def burst(self, requests: list[Request]) -> list[StreamResult]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(self.stream(r, t0) for r in requests)))

    async def clients(self, queues: list[list[Request]]) -> list[StreamResult]:
        return await closed_loop(self.stream, queues)
