"""Real processes for integration tests: `fleet worker` subprocesses against a real
nats-server, and small async helpers that wait on events (never on the clock)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.bus.connect import connect, js_publish
from fleet.bus.provision import provision
from fleet.models.catalog import custom_cards_dir
from fleet.placement import place
from fleet.runner.fault_engine import fault_card
from fleet.wire import subjects
from fleet.wire.cluster import ModelCard, RunnerRecord
from fleet.wire.codec import decode_events, decode_model, encode
from fleet.wire.events import OutputEvent, TaskFinished
from fleet.wire.tasks import ChatMessage, Task, TextGeneration

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def hello(task_id: str) -> TextGeneration:
    """A four-token greedy chat task for tiny-llm."""
    return TextGeneration(
        task_id=task_id, model="tiny-llm", max_tokens=4, temperature=0.0,
        messages=[ChatMessage(role="user", content="hello")],
    )


def seed_models(data_dir: Path, links: dict[str, Path]) -> None:
    """Point a fresh data dir at models built once per session (no rebuild per worker)."""
    models = data_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    for model_id, path in links.items():
        target = models / model_id
        if not target.exists():
            target.symlink_to(path, target_is_directory=True)


def add_fault_card(data_dir: Path, model_id: str = "fault-llm") -> ModelCard:
    """A custom card selecting the fault-injection engine (a plumbing test double)."""
    card = fault_card(model_id).model_copy(update={"source": str(data_dir)})
    folder = custom_cards_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{model_id}.json").write_bytes(encode(card))
    return card


# A test's worker holds a task this long before JetStream hands it to another. The default
# (fleet/config.py, seconds) is short so a dead worker's tasks move on soon; under a CPU hog a
# live worker's beats (every AckWait/4) were once late for it, and a test that kills nothing
# saw its task delivered twice (two trace ids, a takeover). Tests of takeovers ask for a short
# one (FLEET_ACK_WAIT_S, e.g. tests/integration/continuing.ENV).
STEADY_ACK_WAIT = {"FLEET_ACK_WAIT_S": "30"}
# The product's default, for the tests of what a standby runner is for (tests/conftest.py turns
# standbys off for the rest).
STANDBY = {"FLEET_STANDBY_RUNNER": "1"}


class WorkerProcess:
    def __init__(self, nats_url: str, data_dir: Path, **env: str) -> None:
        self.data_dir = data_dir
        self.env = {
            **os.environ, "FLEET_NATS_URL": nats_url, "FLEET_DATA_DIR": str(data_dir),
            # Tests place what they need; the demand tests turn placement on demand back on.
            "MLX_DISABLE_COMPILE": "1", "FLEET_AUTO_PLACE": "0", **STEADY_ACK_WAIT, **env,
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir / "worker.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "worker"], env=self.env, cwd=REPO,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return self

    @property
    def node_id(self) -> str:
        return (self.data_dir / "node_id").read_text().strip()

    def kill(self) -> None:
        """SIGKILL the worker and its runners (one process group), as a power loss would."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return (self.data_dir / "worker.log").read_text(errors="replace")


async def client(nats_url: str) -> Client:
    nc = await connect(nats_url, "test-client")
    await provision(nc)
    return nc


async def wait_node(nc: Client, data_dir: Path, timeout: float = 30.0) -> str:
    """The worker's node id, once its heartbeat is in FLEET_NODES. Watched, and read directly
    whenever the watch is quiet for a while: a watch opened while a cluster's stream leader
    moves can take its ordered consumer's reset (two missed idle heartbeats) to deliver again."""
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    node_file = data_dir / "node_id"
    deadline = time.monotonic() + timeout
    watcher = await kv.watchall()
    try:
        while time.monotonic() < deadline:
            entry = await _next(watcher, min(deadline, time.monotonic() + QUIET_WATCH_S))
            if not node_file.exists():
                continue
            node = node_file.read_text().strip()
            if entry is not None and entry.value and entry.key == node:
                return node
            if entry is None and await _heartbeat_of(kv, node):
                return node
    finally:
        await watcher.stop()
    log = (data_dir / "worker.log")
    tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else ["(no log)"]
    raise TimeoutError(f"no heartbeat from the worker in {data_dir}; its log ends:\n"
                       + "\n".join(tail))


QUIET_WATCH_S = 2.0


async def wait_capabilities(nc: Client, nodes: Iterable[str], timeout: float = 60.0) -> None:
    """Until FLEET_CAPABILITIES (what a gateway's catalogue reads) holds a record of each of
    `nodes` and the sweeper's keeper mark: the sweeper writes them after it hears the nodes'
    heartbeats, so a test that waited for the heartbeats alone can find a gateway that does
    not know a node yet (a 503 for a model only both nodes together can hold)."""
    kv = await nc.jetstream().key_value(subjects.CAPABILITIES_BUCKET)
    wanted = {subjects.capabilities_key(node) for node in nodes} | {subjects.CAPABILITIES_KEEPER}
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    watcher = await kv.watchall()
    try:
        while not wanted <= seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"FLEET_CAPABILITIES lacks {sorted(wanted - seen)}")
            entry = await _next(watcher, min(deadline, time.monotonic() + QUIET_WATCH_S))
            if entry is not None and entry.value:
                seen.add(entry.key)
            elif entry is not None:
                seen.discard(entry.key)
    finally:
        await watcher.stop()


async def _heartbeat_of(kv: KeyValue, node: str) -> bool:
    try:
        return bool((await kv.get(node)).value)
    except (NatsError, TimeoutError):  # not there yet, or the bucket's leader is moving
        return False


async def _next(watcher: KeyValue.KeyWatcher, deadline: float) -> KeyValue.Entry | None:
    try:
        return await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
    except TimeoutError:
        return None


async def place_and_wait(
    nc: Client, card: ModelCard, node_id: str, slots: int = 4, timeout: float = 120.0
) -> RunnerRecord:
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    await place(nc.jetstream(), card, node_id=node_id, slots=slots)
    return await wait_runner(watcher, card.id, ("ready",), timeout)


async def serving(
    nats_url: str, worker: WorkerProcess, card: ModelCard, slots: int = 4
) -> tuple[Client, RunnerRecord]:
    """A client connection once `card` is placed on `worker` and its runner is ready."""
    nc = await client(nats_url)
    record = await place_and_wait(nc, card, await wait_node(nc, worker.data_dir), slots=slots)
    return nc, record


async def wait_runner(
    watcher: KeyValue.KeyWatcher, model: str, states: Iterable[str], timeout: float = 120.0,
    other_than: str | None = None,
) -> RunnerRecord:
    deadline = time.monotonic() + timeout
    wanted = set(states)
    try:
        while time.monotonic() < deadline:
            entry = await _next(watcher, deadline)
            if entry is None or not entry.value:
                continue
            record = decode_model(RunnerRecord, entry.value)
            if record.runner_id == other_than:
                continue
            if record.model == model and record.status.state in wanted:
                return record
    finally:
        await watcher.stop()
    raise TimeoutError(f"no runner of {model} reached {wanted}")


async def until_key(
    kv: KeyValue, key: str, accept: Callable[[bytes], T | None], timeout: float = 120.0,
) -> T:
    """What `accept` makes of the key's value once it takes one (watched: the value now, then
    each write); TimeoutError naming the last value seen."""
    seen: bytes | None = None
    watcher = await kv.watch(key)
    try:
        async with asyncio.timeout(timeout):
            while True:
                entry = await watcher.updates(timeout=timeout)
                if entry is None or not entry.value:
                    continue
                seen = entry.value
                if (taken := accept(seen)) is not None:
                    return taken
    except TimeoutError:
        raise TimeoutError(f"{key} not as awaited {timeout} s on; last seen: {seen!r}") from None
    finally:
        await watcher.stop()


async def submit(nc: Client, task: Task) -> None:
    await js_publish(nc.jetstream(), subjects.tasks(task.model), task, msg_id=task.task_id)


async def events_of(nc: Client, task_id: str, timeout: float = 120.0) -> list[OutputEvent]:
    """Every event of a task from FLEET_OUT, up to and including its TaskFinished."""
    found: list[OutputEvent] = []
    done = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            found.append(event)
            if isinstance(event, TaskFinished):
                done.set()

    sub = await nc.jetstream().subscribe(
        subjects.out(task_id), stream=subjects.OUT_STREAM, ordered_consumer=True, cb=on_event
    )
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return found


async def run_task(nc: Client, task: Task, timeout: float = 120.0) -> list[OutputEvent]:
    """Publish a task and return all its events, its terminal one last."""
    collector = asyncio.create_task(events_of(nc, task.task_id, timeout))
    await submit(nc, task)
    return await collector


def finished(events: list[OutputEvent]) -> TaskFinished:
    terminal = [e for e in events if isinstance(e, TaskFinished)]
    assert len(terminal) == 1, f"expected exactly one task_finished, got {len(terminal)}"
    return terminal[0]


def text_of(events: list[OutputEvent]) -> str:
    return "".join(getattr(e, "text", "") for e in events if e.type == "token")


async def until_queue_empty(js: JetStreamContext, timeout: float = 30.0) -> None:
    """Every task message was acked, terminated or removed: the work queue is empty."""
    async with asyncio.timeout(timeout):
        while (await js.stream_info(subjects.TASKS_STREAM)).state.messages:
            await asyncio.sleep(0.1)  # polling the stream's state, bounded by the timeout


@contextmanager
def fault_worker_stack(root: Path, model: str = "fault-llm") -> Iterator[tuple[str, WorkerProcess]]:
    """A nats-server and one `fleet worker` with the fault engine's card for `model` under
    `root`: (the NATS URL, the worker). A module's shared stack for plumbing tests."""
    from fleet.bus.embedded import EmbeddedNats

    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as server:
        data = root / "worker"
        data.mkdir()
        add_fault_card(data, model)
        worker = WorkerProcess(server.url, data).start()
        try:
            yield server.url, worker
        finally:
            worker.kill()
