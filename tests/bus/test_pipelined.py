"""Pipelined requests (fleet.bus.pipelined) on a real server: each answer reaches its own
caller, and anything but an answer raises, for the caller's retried call to take over."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from fleet.bus.pipelined import pipelined_for


async def test_answers_reach_their_own_callers(provisioned_nc: Client) -> None:
    async def echo(msg: Msg) -> None:
        await msg.respond(b"re:" + msg.data)

    await provisioned_nc.subscribe("echo.*", cb=echo)
    pipe = pipelined_for(provisioned_nc)
    assert pipelined_for(provisioned_nc) is pipe  # one per connection
    answers = await asyncio.gather(*(pipe.request(f"echo.{n % 3}", str(n).encode())
                                     for n in range(200)))
    assert [a.data for a in answers] == [f"re:{n}".encode() for n in range(200)]
    assert not pipe._waiting  # nothing left behind
    # Handed on as they were read: the inbox subscription holds no message, no byte.
    assert pipe._sub is not None
    assert (pipe._sub.pending_msgs, pipe._sub.pending_bytes) == (0, 0)


async def test_no_responders_and_no_answer_raise(provisioned_nc: Client) -> None:
    pipe = pipelined_for(provisioned_nc)
    with pytest.raises(NoRespondersError):
        await pipe.request("nobody.here", b"x")

    async def silent(msg: Msg) -> None:
        pass

    await provisioned_nc.subscribe("silent", cb=silent)
    with pytest.raises(TimeoutError):
        await pipe.request("silent", b"x", timeout=0.2)
    assert not pipe._waiting


async def test_a_request_sent_ahead_is_answered_when_asked_for_and_forgotten_if_not(
    provisioned_nc: Client,
) -> None:
    """`send` publishes at once and `answer` reads the answer later (it may have come
    already); a sent request nobody will wait for leaves nothing behind once forgotten."""
    async def echo(msg: Msg) -> None:
        await msg.respond(b"re:" + msg.data)

    await provisioned_nc.subscribe("ahead.*", cb=echo)
    pipe = pipelined_for(provisioned_nc)
    first = await pipe.send("ahead.1", b"a")
    second = await pipe.send("ahead.2", b"b")
    await provisioned_nc.flush()  # both are out (and likely answered) before anyone waits
    assert (await pipe.answer(second)).data == b"re:b"
    assert (await pipe.answer(first)).data == b"re:a"
    unheard = await pipe.send("nobody.listens", b"c")
    pipe.forget(unheard)
    assert not pipe._waiting
