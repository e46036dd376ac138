"""Load-test helpers: `fleet gateway` as a process of its own (so its memory can be measured),
and raw HTTP/1.1 over asyncio sockets (thousands of clients cost the test little)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from tests.integration.harness import (
    REPO,
    WorkerProcess,
    client,
    place_and_wait,
    seed_models,
    wait_node,
)

LISTENING = re.compile(r"gateway listening on http://([^/\s]+)/v1")


class GatewayProcess:
    """`fleet gateway --port 0` with FLEET_* settings from `env`; its address is read from its
    own log line."""

    def __init__(self, nats_url: str, data_dir: Path, **env: str) -> None:
        self.log_path = data_dir / "gateway.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "--nats-url", nats_url, "--data-dir",
             str(data_dir), "gateway", "--port", "0"],
            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env={**os.environ, **env},
        )
        self.address = ""
        self._listening = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stderr
        with self.log_path.open("a") as log:
            for line in self.process.stderr:
                log.write(line)
                log.flush()
                if match := LISTENING.search(line):
                    self.address = match.group(1)
                    self._listening.set()

    async def listening(self, timeout: float = 30.0) -> str:
        if not await asyncio.to_thread(self._listening.wait, timeout):
            raise TimeoutError(f"the gateway did not start: {self.log()}")
        return self.address

    def rss_mb(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


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

            yield nats_server.url, f"http://{asyncio.run(start())}"
        finally:
            gateway.stop()
            worker.kill()
