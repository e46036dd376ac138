"""The oldest nats-server Fleet runs on (issue 31, item 7): checked at connect, a typed error
naming the version and why."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fleet.bus.connect import connect
from fleet.bus.server_version import MINIMUM, too_old
from fleet.errors import NatsUnavailable, ServerTooOld


@pytest.mark.parametrize(("version", "old"), [
    ((2, 12, 6), True), ((2, 12, 7), False), ((2, 11, 99), True), ((2, 13, 0), False),
    ((2, 15, 1), False), ((1, 99, 99), True), ((3, 0, 0), False),
])
def test_too_old(version: tuple[int, int, int], old: bool) -> None:
    assert too_old(version) is old


async def test_the_bundled_server_is_new_enough(nats_url: str) -> None:
    nc = await connect(nats_url, "test-version")
    try:
        found = nc.connected_server_version
        assert (found.major, found.minor, found.patch) >= MINIMUM
    finally:
        await nc.close()


@pytest.fixture
async def old_server() -> AsyncIterator[str]:
    """A peer that speaks just enough of the NATS protocol to say it is 2.12.6: the oldest
    bundled binary is new, so an old server's greeting is played here (a fault injection,
    as the fault engine is for runners)."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"OLD","version":"2.12.6","proto":1,"headers":true,'
                     b'"max_payload":1048576}\r\n')
        await writer.drain()
        while line := await reader.readline():
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"nats://127.0.0.1:{port}"


async def test_an_older_server_is_refused_with_the_version_and_why(old_server: str) -> None:
    with pytest.raises(ServerTooOld) as refused:
        await connect(old_server, "test-version")
    assert isinstance(refused.value, NatsUnavailable)  # what a process start already handles
    assert "nats-server 2.12.6" in refused.value.message
    assert "older than 2.12.7" in refused.value.message and "ACL" in refused.value.message
