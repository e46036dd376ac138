"""The embedded nats-server: starts on a free port, answers, stops cleanly, says so when busy."""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from fleet.bus.embedded import EmbeddedNats
from fleet.errors import EmbeddedServerError

FLEET = Path(sys.executable).parent / "fleet"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that something else is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def accepts_connections(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def round_trip(url: str, subject: str = "fleet.test.ping") -> bytes:
    """Publish one message and receive it back through the server."""
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        sub = await nc.subscribe(subject)
        await nc.publish(subject, b"ping")
        await nc.flush(timeout=5)
        return (await sub.next_msg(timeout=5)).data
    finally:
        await nc.close()


async def test_starts_on_port_0_answers_and_stops_cleanly(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store", port=0).start()
    try:
        assert server.port != 0
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert await round_trip(server.url) == b"ping"
    finally:
        code = server.stop()
    assert code in (0, -signal.SIGTERM)
    assert server.process is not None and server.process.poll() is not None
    assert not accepts_connections(server.port)


async def test_jetstream_is_on_and_stores_under_the_store_dir(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with EmbeddedNats(store, port=0) as server:
        nc = await nats.connect(server.url, connect_timeout=5, allow_reconnect=False)
        try:
            js = nc.jetstream()
            await js.add_stream(name="PROBE", subjects=["probe.>"])
            ack = await js.publish("probe.one", b"kept")
            assert ack.stream == "PROBE"
        finally:
            await nc.close()
    assert (store / "jetstream").is_dir()


def test_stop_twice_is_harmless(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store", port=0).start()
    first = server.stop()
    assert server.stop() == first


def test_port_in_use_is_one_clear_error(tmp_path: Path, busy_port: int) -> None:
    server = EmbeddedNats(tmp_path / "store", port=busy_port)
    with pytest.raises(EmbeddedServerError) as caught:
        server.start()
    message = caught.value.message
    assert f"port {busy_port}" in message and "in use" in message
    assert "\n" not in message and "Traceback" not in message
    assert server.process is None  # nothing was started


def test_fleet_nats_on_a_busy_port_exits_1_with_one_line(tmp_path: Path, busy_port: int) -> None:
    result = subprocess.run(
        [str(FLEET), "--data-dir", str(tmp_path), "nats", "--port", str(busy_port)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fleet: port ") and "in use" in lines[0]
    assert "Traceback" not in result.stderr


def test_a_server_that_dies_at_start_is_reported_at_once_with_its_reason(tmp_path: Path) -> None:
    config = tmp_path / "broken.conf"
    config.write_text("jetstream { this is not { valid\n")
    server = EmbeddedNats(tmp_path / "store", port=0, config=config)
    started = time.monotonic()
    with pytest.raises(EmbeddedServerError, match="did not become ready") as caught:
        server.start(timeout=30)
    assert time.monotonic() - started < 15  # not the whole start timeout
    assert "Parse error" in caught.value.message
    assert server.process is not None and server.process.poll() is not None


async def test_two_servers_with_their_own_stores_run_side_by_side(tmp_path: Path) -> None:
    with (
        EmbeddedNats(tmp_path / "a", port=0) as one,
        EmbeddedNats(tmp_path / "b", port=0) as two,
    ):
        assert one.port != two.port
        replies = await asyncio.gather(round_trip(one.url), round_trip(two.url))
        assert replies == [b"ping", b"ping"]
        nc = await nats.connect(one.url, connect_timeout=5, allow_reconnect=False)
        try:
            await nc.jetstream().add_stream(name="ONLY_ON_ONE", subjects=["one.>"])
        finally:
            await nc.close()
        nc = await nats.connect(two.url, connect_timeout=5, allow_reconnect=False)
        try:
            names = [s.config.name for s in await nc.jetstream().streams_info()]
        finally:
            await nc.close()
        assert "ONLY_ON_ONE" not in names
    assert (tmp_path / "a" / "jetstream").is_dir()
    assert not accepts_connections(one.port) and not accepts_connections(two.port)


def read_line(stream: object, timeout: float) -> str:
    """The next line of a pipe, or a failure after `timeout` seconds."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()  # type: ignore[attr-defined]
    return lines.get(timeout=timeout)


async def test_fleet_nats_serves_until_sigterm_then_exits_0(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [str(FLEET), "--data-dir", str(tmp_path), "nats", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = read_line(process.stdout, timeout=30)
        assert line.startswith("nats-server (JetStream) on nats://127.0.0.1:")
        url = line.split(" on ")[1].split(",")[0]
        port = int(url.rsplit(":", 1)[1])
        assert await round_trip(url) == b"ping"
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=15)
        stderr = process.stderr.read() if process.stderr else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 0, stderr
    assert "Traceback" not in stderr
    assert not accepts_connections(port)
    assert (tmp_path / "nats").is_dir()
