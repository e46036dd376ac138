"""Load-test helpers: raw HTTP/1.1 over asyncio sockets (thousands of clients cost the test
little), and a stack of one model behind a `fleet gateway` process."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from tests.gateway_process import GatewayProcess
from tests.integration.harness import (
    WorkerProcess,
    client,
    place_and_wait,
    seed_models,
    wait_node,
)


def request_bytes(method: str, path: str, body: bytes = b"", key: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
    if key:
        head += f"authorization: Bearer {key}\r\n"
    if body:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def status_of(address: str, raw: bytes, bodies: dict[int, bytes] | None = None) -> int:
    """Send one request on a fresh connection; its status (0 if the connection failed).
    `bodies` keeps the first answer seen for each status, to say why in a failure."""
    try:
        reader, writer = await connect(address)
    except OSError:
        return 0
    try:
        writer.write(raw)
        await writer.drain()
        answer = await reader.read()
    except OSError:
        return 0
    finally:
        writer.close()
    parts = answer.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    if bodies is not None:
        bodies.setdefault(status, answer[-600:])
    return status


async def statuses(
    address: str, raws: list[bytes], bodies: dict[int, bytes] | None = None
) -> Counter[int]:
    return Counter(await asyncio.gather(*(status_of(address, raw, bodies) for raw in raws)))


async def open_stream(
    address: str, path: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A GET whose response stays open (SSE): the connection and the response head."""
    reader, writer = await connect(address)
    writer.write(request_bytes("GET", path))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


@contextmanager
def one_model_stack(
    root: Path, model: str, model_dir: Path, slots: int
) -> Iterator[tuple[str, str]]:
    """nats-server, one `fleet worker` with `model` placed and ready (`slots` wide) and one
    `fleet gateway` process: (the NATS URL, the gateway's base URL)."""
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as nats_server:
        worker_dir = root / "worker"
        seed_models(worker_dir, {model: model_dir})
        worker = WorkerProcess(nats_server.url, worker_dir).start()
        gateway = GatewayProcess(nats_server.url, root / "gateway")
        try:

            async def start() -> str:
                nc = await client(nats_server.url)
                node = await wait_node(nc, worker_dir)
                await place_and_wait(nc, get_card(model), node, slots=slots)
                await nc.close()
                return await gateway.listening()

            yield nats_server.url, asyncio.run(start())
        finally:
            gateway.stop()
            worker.kill()
