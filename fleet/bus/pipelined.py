"""Requests whose answers come back to one inbox subscription: the per-task broker calls of
the worker's hot path (a claim's create, its events look-up, a finished task's confirmed ack).

nats-py's `request` and its KV / JetStream layers cost a task's way to its runner 45-90 us of
CPU a call on the 2-core machine (a nuid token, `wait_for`, a JSON parse with the standard
library, a retry closure and a permission watcher a call); one publish with a reply subject of
our own and a future cost 15-40 us (bench/README.md, "Plumbing at rate", issue 23). The calls
of one fetched batch's intakes go out as they are made, nothing awaited between them, so
nats-py's flusher sends them together, and their answers come back through one subscription.

This is the fast path only: `request` raises on anything but an answer (no answer in time, no
responders, the connection gone) and its callers fall back to their retried call, which
decides as before. A publish the server refuses for permissions is never answered: its
caller's fallback reports it (fleet.bus.denials).
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.js.api import Header

FAST_TIMEOUT_S = 2.0  # then the caller's retried call takes over

_BY_CONNECTION: weakref.WeakKeyDictionary[Client, Pipelined] = weakref.WeakKeyDictionary()


def pipelined_for(nc: Client) -> Pipelined:
    """The connection's one Pipelined (its inbox subscription is made at the first call)."""
    found = _BY_CONNECTION.get(nc)
    if found is None:
        found = _BY_CONNECTION[nc] = Pipelined(nc)
    return found


class Pipelined:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._opening: asyncio.Lock | None = None
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()

    async def _open(self) -> None:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._sub is None:
                prefix = self.nc.new_inbox()
                sub = await self.nc.subscribe(f"{prefix}.*")
                # No callback: nats-py's read loop puts each answer straight into this
                # queue, which hands it to its waiter (a callback runs a loop pass later, in
                # the subscription's own task: one pass of each answer's way, issue 23).
                sub._pending_queue = _Handing(sub, self._answer)
                self._sub, self._prefix = sub, prefix

    def _answer(self, msg: Msg) -> None:
        waiter = self._waiting.pop(msg.subject, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)

    async def request(
        self, subject: str, payload: bytes, headers: Mapping[str, str] | None = None,
        timeout: float = FAST_TIMEOUT_S,
    ) -> Msg:
        """The answer to `payload` on `subject`; raises TimeoutError, NoRespondersError or the
        connection's error."""
        return await self.answer(await self.send(subject, payload, headers), timeout)

    async def send(
        self, subject: str, payload: bytes, headers: Mapping[str, str] | None = None,
    ) -> Sent:
        """Publish the request now and return at once; `answer` waits for its answer. A
        request sent before its caller is ready to wait has its round trip under way
        meanwhile (a fetched task's claim, sent before the loop takes the task in)."""
        if self._sub is None:
            await self._open()
        reply = f"{self._prefix}.{next(self._tokens)}"
        waiter: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[reply] = waiter
        try:
            await self.nc.publish(subject, payload, reply=reply,
                                  headers=dict(headers) if headers else None)
        except BaseException:
            self._waiting.pop(reply, None)
            raise
        return Sent(reply, waiter)

    async def answer(self, sent: Sent, timeout: float = FAST_TIMEOUT_S) -> Msg:
        """The answer to a sent request, as `request` returns it."""
        try:
            if sent.waiter.done():  # sent ahead and answered: no timer to arm and cancel
                answer = sent.waiter.result()
            else:
                async with asyncio.timeout(timeout):
                    answer = await sent.waiter
        finally:
            self._waiting.pop(sent.reply, None)
        if answer.headers and answer.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            raise NoRespondersError
        return answer

    def forget(self, sent: Sent) -> None:
        """A sent request whose answer nobody will wait for."""
        self._waiting.pop(sent.reply, None)


class _Handing(asyncio.Queue[Msg]):
    """A subscription's queue that keeps nothing: each message nats-py's read loop puts is
    handed on at once (its pending size, counted as it was put, given back), so the
    subscription never holds a message and its drain has none to wait for."""

    def __init__(self, sub: Subscription, hand: Callable[[Msg], None]) -> None:
        super().__init__()
        self._sub = sub
        self._hand = hand

    def put_nowait(self, item: Msg) -> None:
        self._sub._pending_size -= len(item.data)
        self._hand(item)


@dataclass(frozen=True)
class Sent:
    reply: str
    waiter: asyncio.Future[Msg]


def stream_answer(answer: bytes) -> dict[str, Any] | None:
    """Pure. A JetStream API answer read raw (a PubAck, or its error), None when it is not
    one (no responders' empty status message, say): the fast paths' callers read it."""
    try:
        reply = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    return reply if isinstance(reply, dict) else None
