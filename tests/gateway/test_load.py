"""Load that used to turn into 503s, against real processes: nats-server, `fleet worker` running
the fault engine (a plumbing double that makes numbered tokens), and `fleet gateway`.

CI-sized by default; FLEET_LOAD_LONG=1 runs the sizes of issue 11's report (FLEET_LOAD_SCALE=N
multiplies them again; they need a file-descriptor limit of about twice the client count).
Every wait is bounded; clients are raw sockets, so thousands cost the test little."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import orjson
import pytest
from load_helpers import connect, open_stream, request_bytes, statuses

from fleet.gateway.owners import TENANTS_BUCKET, task_key
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.records import TaskRecord
from tests.gateway_process import GatewayProcess
from tests.integration.harness import WorkerProcess, add_fault_card, serving

MODEL = "fault-llm"
SCALE = int(os.environ.get("FLEET_LOAD_SCALE", "1"))
LONG = os.environ.get("FLEET_LOAD_LONG", "") not in ("", "0")
Start = Callable[..., Awaitable[str]]


def long_size(clients: int) -> object:
    """The issue's size: opt-in (minutes, and thousands of sockets), skipped where the
    process may not open enough of them rather than failing on EMFILE."""
    reason = "set FLEET_LOAD_LONG=1 to run the issue's sizes"
    if LONG:
        reason = raise_fd_limit(2 * clients + 1000)
    return pytest.param(clients, id="long", marks=[
        pytest.mark.slow, pytest.mark.skipif(bool(reason), reason=reason or "")])


def raise_fd_limit(needed: int) -> str:
    """Raises the soft RLIMIT_NOFILE (inherited by the gateway this test starts); returns
    why the size cannot run here, or ''."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        return f"needs {needed} file descriptors; the hard limit here is {hard}"
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return ""


def chat(tokens: int = 2) -> bytes:
    body = {"model": MODEL, "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"tokens:{tokens}"}]}
    return request_bytes("POST", "/v1/chat/completions", orjson.dumps(body))


@pytest.fixture
async def start_gateway(nats_url: str, tmp_path: Path) -> AsyncIterator[Start]:
    started: list[GatewayProcess] = []

    async def start(**env: str) -> str:
        data_dir = tmp_path / f"gateway{len(started)}"
        add_fault_card(data_dir, MODEL)
        gateway = GatewayProcess(nats_url, data_dir, env)
        started.append(gateway)
        await gateway.listening()
        return gateway.address

    start.processes = started  # type: ignore[attr-defined]
    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture
async def fault_worker(nats_url: str, tmp_path: Path) -> AsyncIterator[None]:
    data_dir = tmp_path / "worker"
    add_fault_card(data_dir, MODEL)
    worker = WorkerProcess(nats_url, data_dir).start()
    try:
        nc, _ = await serving(nats_url, worker, add_fault_card(data_dir, MODEL), slots=16)
        await nc.close()
        yield
    finally:
        worker.kill()


async def out_consumers(nats_url: str) -> int:
    from fleet.bus.connect import connect as nats_connect

    nc = await nats_connect(nats_url, "test-probe")
    try:
        return len(await nc.jetstream().consumers_info(subjects.OUT_STREAM))
    finally:
        await nc.close()


async def record_tasks(nats_url: str, task_ids: list[str]) -> None:
    """What a gateway writes for each task it makes: the ids are known (not 404), and quiet."""
    from fleet.bus.connect import connect as nats_connect

    nc = await nats_connect(nats_url, "test-records")
    try:
        js = nc.jetstream()
        record = encode(TaskRecord(api="chat.completions", model="fault-llm", created=0))
        for task_id in task_ids:
            await js.publish_async(f"$KV.{TENANTS_BUCKET}.{task_key(task_id)}", record)
        await js.publish_async_completed()
    finally:
        await nc.close()


@pytest.mark.parametrize("idle", [pytest.param(2000, id="2000-idle")])
async def test_idle_event_streams_do_not_stop_chats(
    start_gateway: Start, fault_worker: None, nats_url: str, idle: int
) -> None:
    address = await start_gateway(
        FLEET_GATEWAY_EVENTS_IDLE_S="120", FLEET_GATEWAY_MAX_WAITING="10000",
        FLEET_GATEWAY_MAX_CONNECTIONS="10000",
    )
    await record_tasks(nats_url, [f"idle-{index}" for index in range(idle)])
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]] = []
    try:  # every connection is closed whatever fails: 2,000 left open end the next test EMFILE
        for start in range(0, idle, 250):  # connect in waves: the listen backlog is finite
            held += await asyncio.gather(*(
                open_stream(address, f"/v1/tasks/idle-{index}/events")
                for index in range(start, min(idle, start + 250))
            ))
        refused = [(head, await reader.read(400)) for reader, _, head in held
                   if head.split(b" ", 2)[1] != b"200"]
        assert not refused, (len(refused), refused[0])
        async with asyncio.timeout(60):
            answered = await statuses(address, [chat() for _ in range(20)])
        assert answered == {200: 20}, answered
        # one consumer for all waiting requests (the worker's own readers use none here)
        assert await out_consumers(nats_url) <= 2
    finally:
        for _, writer, _ in held:
            writer.close()


@pytest.mark.parametrize(
    "clients",
    [pytest.param(2000, id="2000"),
     long_size(10000 * SCALE)],
)
async def test_concurrent_chats_get_200_or_429_never_503(
    start_gateway: Start, fault_worker: None, clients: int
) -> None:
    # an open gateway: FLEET_GATEWAY_MAX_WAITING is its limit (256 as a key's would be)
    address = await start_gateway(
        FLEET_GATEWAY_MAX_CONNECTIONS=str(clients + 100), FLEET_GATEWAY_MAX_WAITING="256"
    )
    started = time.monotonic()
    bodies: dict[int, bytes] = {}
    async with asyncio.timeout(240):
        answered = await statuses(address, [chat() for _ in range(clients)], bodies)
    took = time.monotonic() - started
    print(f"{clients} concurrent chats in {took:.1f} s: {dict(answered)}")
    assert set(answered) <= {200, 429}, (answered, bodies)
    assert answered[200] >= 1


@pytest.mark.parametrize(
    "clients",
    [pytest.param(1000, id="1000"),
     long_size(18000 * SCALE)],
)
async def test_slow_clients_are_closed_by_timeouts_with_bounded_memory(
    start_gateway: Start, clients: int
) -> None:
    address = await start_gateway(
        FLEET_GATEWAY_HEADER_TIMEOUT_S="2", FLEET_GATEWAY_BODY_TIMEOUT_S="2",
        FLEET_GATEWAY_MAX_CONNECTIONS=str(clients + 100),
    )
    gateway: GatewayProcess = start_gateway.processes[-1]  # type: ignore[attr-defined]
    # warm the gateway up (first request, first 404) before the baseline
    assert await statuses(address, [request_bytes("GET", "/healthz")]) == {200: 1}
    baseline = gateway.rss_mb()
    upload = (request_bytes("POST", "/v1/chat/completions")
              .replace(b"\r\n\r\n", b"\r\ncontent-type: application/json\r\n"
                                    b"content-length: 1048576\r\n\r\n") + b"{" + b" " * 65536)

    async def slow(index: int) -> bytes:
        reader, writer = await connect(address)
        try:
            # half never finish their headers, half never finish a 1 MiB body
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" if index % 2 else upload)
            await writer.drain()
            return await reader.read()  # the gateway must close it
        except ConnectionResetError:  # closed with part of the upload unread: also a close
            return b"reset"
        finally:
            writer.close()

    started = time.monotonic()
    clients_done = []
    for start in range(0, clients, 500):
        clients_done.append(asyncio.gather(*(
            slow(i) for i in range(start, min(clients, start + 500))
        )))
    sampler = PeakRss(gateway)
    async with asyncio.timeout(60 + clients / 200):
        answers = [a for wave in await asyncio.gather(*clients_done) for a in wave]
    took = time.monotonic() - started
    peak = sampler.stop()
    after = gateway.rss_mb()
    print(f"{clients} slow clients closed in {took:.1f} s; gateway RSS {baseline:.0f} MB → "
          f"peak {peak:.0f} MB → {after:.0f} MB")
    # Every connection was closed by the gateway: a slow body with a 408 (or a reset, when
    # the upload was unread), a slow header silently. Under a flood a body's headers may
    # arrive past the header timeout (the test's one client process sends them late): then
    # it is closed like a slow header.
    # How many bodies' headers made it in time depends on the machine's load (at load 10 one
    # run saw 236 of 500): what is certain is that only a body is answered 408, that some
    # were, and that every other connection was closed.
    cut = [i for i, a in enumerate(answers) if a.startswith(b"HTTP/1.1 408")]
    assert all(a in (b"", b"reset") for a in answers if not a.startswith(b"HTTP/1.1 408"))
    assert cut and all(i % 2 == 0 for i in cut), cut  # the even clients sent the uploads
    assert after - baseline < 64 + clients / 100, (baseline, after)
    assert "Traceback" not in gateway.log()


class PeakRss:
    """The gateway's largest RSS while it runs (sampled every 0.2 s: a measurement, not a
    synchronisation)."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.gateway = gateway
        self.peak = gateway.rss_mb()
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.gateway.rss_mb())
            await asyncio.sleep(0.2)

    def stop(self) -> float:
        self._task.cancel()
        self.peak = max(self.peak, self.gateway.rss_mb())
        return self.peak
