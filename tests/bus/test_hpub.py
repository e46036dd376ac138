"""fleet.bus.hpub: the header block and HPUB Fleet encodes itself, byte for byte, and what a
real server's subscriber reads of a message published so (the same as nats-py's publish)."""

from __future__ import annotations

import asyncio

import nats
import nats.errors as nats_errors
import pytest

from fleet.bus.hpub import header_block, header_lines, hpub_command, publish_command


@pytest.mark.parametrize(("headers", "lines"), [
    ({}, b""),
    ({"Nats-Msg-Id": "t1-token-0"}, b"Nats-Msg-Id: t1-token-0\r\n"),
    ({"A": "1", "b-c": " x "}, b"A: 1\r\nb-c: x\r\n"),  # trimmed, as nats-py trims
    ({"A": "x\r\nPUB evil 1"}, b"A: x  PUB evil 1\r\n"),  # a line break cannot end the block
    ({" K ": "v"}, b"K: v\r\n"),
])
def test_header_lines(headers: dict[str, str], lines: bytes) -> None:
    assert header_lines(headers) == lines


@pytest.mark.parametrize("key", ["", "a b", "a:b", "é"])
def test_a_key_that_is_no_token_is_refused(key: str) -> None:
    with pytest.raises(ValueError):
        header_lines({key: "v"})


def test_the_block_and_the_command() -> None:
    block = header_block(b"A: 1\r\n", b"", b"B: 2\r\n")
    assert block == b"NATS/1.0\r\nA: 1\r\nB: 2\r\n\r\n"
    assert hpub_command("s.t", "_INBOX.x.1", block, b"hello") == (
        b"HPUB s.t _INBOX.x.1 24 29\r\nNATS/1.0\r\nA: 1\r\nB: 2\r\n\r\nhello\r\n"
    )


async def test_a_subscriber_reads_what_nats_py_publish_would_have_sent(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    got: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()
    await nc.subscribe("out.*", cb=got.put)
    headers = {"Nats-Msg-Id": "t1-token-0", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16
               + "-01"}
    await nc.publish("out.a", b"body", reply="r.1", headers=headers)
    block = header_block(header_lines(headers))
    await publish_command(nc, hpub_command("out.b", "r.1", block, b"body"), 4)
    theirs, ours = [await asyncio.wait_for(got.get(), 5) for _ in range(2)]
    assert (ours.data, ours.reply, ours.headers) == (theirs.data, theirs.reply, theirs.headers)
    await nc.close()
    with pytest.raises(nats_errors.ConnectionClosedError):  # the errors publish raises
        await publish_command(nc, hpub_command("out.c", "r.1", block, b"body"), 4)


async def test_a_payload_over_the_servers_limit_is_refused_before_sending(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    too_big = b"x" * (nc.max_payload + 1)
    with pytest.raises(nats_errors.MaxPayloadError):
        await publish_command(nc, hpub_command("out.a", "r.1", header_block(), too_big),
                              len(too_big))
    await nc.close()
