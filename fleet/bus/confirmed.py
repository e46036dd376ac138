"""Publishing a sequence of JetStream messages that the stream confirms whole and in order.

Each sequence (one task's events) is sent pipelined: a message goes out at once with a reply
subject of our own, and its PubAck comes back to one inbox. Up to WINDOW messages of a
sequence may wait for their ack; later ones queue, in order, and a pacer task of the
sequence sends them as acks free room. `send` never waits for an ack (the worker's loop
calls it on the token path). Awaiting each ack would cost ~0.7 ms per token (NOTES.md); this
costs one publish and one small reply.

When something breaks (no ack within ACK_TIMEOUT_S, a 503, a reconnect, no connection) the
sequence stops sending new messages and a repair re-sends every unconfirmed one, oldest
first, each awaiting its ack before the next, then resumes: messages wait in order while the
connection is down. Every message carries a Nats-Msg-Id, so a re-send of a message that was
stored after all is acked as a duplicate at its first place.

`settle` tells whether the stream holds the sequence whole: every message confirmed (stored,
or a duplicate of a copy already stored) and none refused. Whole but out of order counts as
whole (`stored_whole`): a repair re-sends a message whose ack was lost after later ones were
stored (a leader change, or a reconnect that flushes nats-py's buffer before the re-send), so
its copy lands after them. Every event a reader puts in order carries its index (readers
read a task in index order: fleet.bus.task_log, whose docstring says how a raw NATS reader does
the same), so only a message that is truly missing fails the task's output.

A sequence whose message the stream refuses for a wrong expected last sequence is fenced: its
writer lost it to another (fleet.worker.takeover). It sends nothing more, `on_fenced` hears of
it once, and `fenced(key)` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, ServiceUnavailableError

from fleet.bus.hpub import hpub_command, publish_command
from fleet.bus.retry import (
    BROKER_BUDGET_S,
    IN_FLIGHT_LAST_SEQUENCE_ERR_CODE,
    is_transient,
    with_retry,
)
from fleet.errors import BrokerUnavailable

log = logging.getLogger(__name__)

WINDOW = 256  # unconfirmed messages per sequence before the next send waits
ACK_TIMEOUT_S = 2.0  # no ack by then: treat the message as lost and repair
ACK_TICK_S = 0.1  # how late a wait for an answer may notice its timeout (_answer)
NO_RESPONDERS = "503"
WRONG_LAST_SEQUENCE = 10071  # an expected-sequence header failed: the sequence is fenced


@dataclass(eq=False)
class _Message:
    subject: str
    body: bytes
    headers: bytes  # the whole header block, encoded (fleet.bus.hpub)
    seq: int | None = None  # the stream sequence once confirmed
    token: str = ""  # the reply token of the latest send
    error: Exception | None = None  # the error answer to the latest send
    refused: str | None = None  # a final refusal by the stream (too big, no permission ...)
    sends: int = 0
    duplicate: bool = False  # the stream already held it (its seq is the first copy's)


@dataclass(eq=False)
class _Sequence:
    key: str
    messages: list[_Message] = field(default_factory=list)
    confirmed: int = 0  # the first index that may be unconfirmed
    epoch: int = -1  # the connection (reconnect count) the pipelined sends went out on
    broken: bool = False
    fenced: bool = False  # the stream refused a message on an expected-sequence header
    repair: asyncio.Task[None] | None = None
    sent: int = 0  # messages[:sent] went out pipelined, in order (the rest queue)
    pacer: asyncio.Task[None] | None = None  # sends what queued behind a full window
    tokens: set[str] = field(default_factory=set)  # the reply tokens of its unanswered sends
    # Set at every answer to one of this sequence's messages (a waiter clears it first).
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def unconfirmed(self) -> list[_Message]:
        while self.confirmed < len(self.messages) and self.messages[self.confirmed].seq:
            self.confirmed += 1
        return [m for m in self.messages[self.confirmed :] if m.seq is None]


class ConfirmedPublisher:
    """Ordered, confirmed sequences of JetStream messages over one connection."""

    def __init__(
        self, nc: Client, *, budget_s: float = BROKER_BUDGET_S,
        on_fenced: Callable[[str], None] | None = None,
    ) -> None:
        self.nc = nc
        self.budget_s = budget_s
        self.on_fenced = on_fenced
        self.dropped = 0  # messages of fenced sequences not sent (for tests and logs)
        self._sequences: dict[str, _Sequence] = {}
        self._waiting: dict[str, tuple[_Sequence, _Message]] = {}  # reply token -> sent
        self._inbox = ""
        self._tokens = 0
        self.repairs = 0  # sequences that had to be re-sent (for metrics and tests)
        self.resent = 0  # messages re-sent by repairs
        self.reordered = 0  # sequences stored whole but out of order (whole: not a problem)
        # The waits for an answer: their deadlines, kept by one ticker (_answer).
        self._deadlines: dict[int, tuple[float, asyncio.Event]] = {}
        self._waits = itertools.count()
        self._ticker: asyncio.TimerHandle | None = None

    async def send(self, key: str, subject: str, body: bytes, headers: bytes) -> None:
        """Queue one message of sequence `key` (`headers`: its header block, encoded by
        fleet.bus.hpub); it goes out now unless the sequence is being repaired, the
        connection is down, or WINDOW messages are unconfirmed (then its pacer sends it in its
        turn). Never waits for an ack."""
        seq = self._sequences.get(key)
        if seq is None:  # not setdefault: a _Sequence (and its Event) costs ~2 us a send
            # A new sequence has nothing sent on an older connection: its epoch is this one.
            seq = self._sequences[key] = _Sequence(key, epoch=self.nc.stats["reconnects"])
        if seq.fenced:  # its writer lost it: nothing more goes out
            self.dropped += 1
            return
        message = _Message(subject, body, headers)
        seq.messages.append(message)
        if seq.pacer is not None and not seq.pacer.done():
            return  # behind a full window: the pacer sends it in its turn
        if seq.broken or not self._connection_ok(seq):
            self._break(seq)
            return
        if self._must_queue(seq):
            seq.unconfirmed()  # moves `confirmed` past what was acked meanwhile
            if self._must_queue(seq):
                seq.pacer = asyncio.create_task(self._pace(seq), name=f"pace {seq.key}")
                seq.pacer.add_done_callback(_log_failure)
                return
        try:
            await self._send(seq, message)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._break(seq)
            return
        seq.sent += 1

    @staticmethod
    def _must_queue(seq: _Sequence) -> bool:
        """The newest message waits: WINDOW are unconfirmed, or older ones still queue."""
        return seq.sent < len(seq.messages) - 1 or seq.sent - seq.confirmed >= WINDOW

    async def _pace(self, seq: _Sequence) -> None:
        """Send what queued behind a full window, in order, as acks free room. An ack that
        does not come within ACK_TIMEOUT_S (lost, or a 503) breaks the sequence: the repair
        re-sends everything unconfirmed, the queued messages included, in order."""
        while not seq.broken and seq.sent < len(seq.messages):
            seq.unconfirmed()
            if seq.sent - seq.confirmed >= WINDOW:
                try:
                    await self._answer(seq, seq.messages[seq.confirmed], ACK_TIMEOUT_S)
                except Exception:
                    self._break(seq)
                    return
                continue
            if not self._connection_ok(seq):
                self._break(seq)
                return
            try:
                await self._send(seq, seq.messages[seq.sent])
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._break(seq)
                return
            seq.sent += 1

    async def settle(self, key: str, budget_s: float | None = None) -> str | None:
        """Wait until every message of `key` is confirmed (repairing as needed, within the
        budget). None when the stream holds them whole and in order; else what went wrong."""
        seq = self._sequences.get(key)
        if seq is None:
            return None
        deadline = time.monotonic() + (self.budget_s if budget_s is None else budget_s)
        if seq.pacer is not None and not seq.pacer.done():  # let it send what queued
            await asyncio.wait({seq.pacer}, timeout=max(0.0, _left(deadline)))
            if not seq.pacer.done():  # out of time: the repair below takes over
                seq.pacer.cancel()
                seq.broken = True
        # Called twice a task (its terminal's turn, then the terminal): one scan when every
        # message is confirmed already, not two (issue 23).
        for message in (waiting := seq.unconfirmed()):
            if seq.fenced:  # lost to another attempt: nothing of it is worth repairing
                return _problem(seq)
            if message.seq is not None or seq.broken or not message.token:
                continue
            with contextlib.suppress(Exception):  # lost or failed: the repair below resends
                await self._answer(seq, message, max(0.0, min(ACK_TIMEOUT_S, _left(deadline))))
            if message.seq is None:
                seq.broken = True
                break
        if waiting and seq.unconfirmed() and not seq.fenced:
            if seq.repair is not None:
                seq.repair.cancel()
                with contextlib.suppress(BaseException):
                    await seq.repair
            seq.broken = True
            await self._repair(seq, deadline)
        problem = _problem(seq)
        if problem is None and stored_whole(_stored_seqs(seq)) is Storage.REORDERED:
            self.reordered += 1
            log.info("output of %s: stored whole, out of order (read in index order)", key)
        return problem

    def fenced(self, key: str) -> bool:
        """Whether the stream refused a message of `key` for a wrong expected sequence."""
        seq = self._sequences.get(key)
        return seq is not None and seq.fenced

    def forget(self, key: str) -> None:
        seq = self._sequences.pop(key, None)
        if seq is None:
            return
        if seq.repair:
            seq.repair.cancel()
        if seq.pacer:
            seq.pacer.cancel()
        # Its own tokens, not a scan of every sequence's (one a finished task, 64 in flight).
        for token in seq.tokens:
            self._waiting.pop(token, None)

    async def close(self) -> None:
        for key in list(self._sequences):
            self.forget(key)
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    def _connection_ok(self, seq: _Sequence) -> bool:
        if not self.nc.is_connected:
            return False
        epoch = self.nc.stats["reconnects"]
        if epoch != seq.epoch:
            if seq.unconfirmed()[:-1]:  # older messages went out on a connection now gone
                return False
            seq.epoch = epoch
        return True

    def _break(self, seq: _Sequence) -> None:
        """Stop pipelining this sequence; a repair re-sends what is unconfirmed, in order."""
        seq.broken = True
        if seq.repair is None or seq.repair.done():
            seq.repair = asyncio.create_task(
                self._repair(seq, time.monotonic() + self.budget_s), name=f"repair {seq.key}"
            )
            seq.repair.add_done_callback(_log_failure)

    async def _repair(self, seq: _Sequence, deadline: float) -> None:
        self.repairs += 1
        try:
            while not seq.fenced and (
                pending := [m for m in seq.unconfirmed() if m.refused is None]
            ):
                for message in pending:
                    if seq.fenced:
                        break
                    if message.seq is not None:
                        continue  # its first ack came in late
                    try:
                        await with_retry(
                            lambda m=message: self._send_and_wait(seq, m),  # type: ignore[misc]
                            what=f"store output {seq.key}", budget_s=max(0.1, _left(deadline)),
                        )
                    except APIError:
                        if message.refused is None:
                            raise
            seq.epoch = self.nc.stats["reconnects"]
            seq.sent = len(seq.messages)
            seq.broken = False
        except BrokerUnavailable as exc:
            log.error("output of %s: %s", seq.key, exc)

    async def _send_and_wait(self, seq: _Sequence, message: _Message) -> None:
        if not self.nc.is_connected:
            raise NatsTimeout  # transient: with_retry waits and tries again
        await self._send(seq, message)
        self.resent += 1
        await self._answer(seq, message, ACK_TIMEOUT_S)

    async def _answer(self, seq: _Sequence, message: _Message, timeout: float) -> None:
        """Wait for the answer to the latest send of `message`: returns once it is stored,
        raises the stream's error answer, or TimeoutError (at most ACK_TICK_S past `timeout`).

        The timeout is no timer of the wait's own (asyncio.timeout's costs ~4.5 us a wait, and
        a finished task waits twice: issue 23): one ticker (_tick) wakes the waits whose
        deadline has passed, as often as ACK_TICK_S while any is open."""
        if message.seq is not None or message.error is not None:
            if message.seq is None and message.error is not None:
                raise message.error
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = next(self._waits)
        self._deadlines[key] = (deadline, seq.progress)
        if self._ticker is None:
            self._ticker = loop.call_later(ACK_TICK_S, self._tick, loop)
        try:
            while message.seq is None and message.error is None:
                if loop.time() >= deadline:
                    raise TimeoutError(f"no answer to a message of {seq.key} in {timeout:.1f} s")
                seq.progress.clear()
                await seq.progress.wait()
        finally:
            del self._deadlines[key]
        if message.seq is None and message.error is not None:
            raise message.error

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake every wait whose deadline has passed (it raises TimeoutError); ticks again
        while any wait is open."""
        self._ticker = None
        if not self._deadlines:
            return
        now = loop.time()
        for deadline, progress in self._deadlines.values():
            if deadline <= now:
                progress.set()
        self._ticker = loop.call_later(ACK_TICK_S, self._tick, loop)

    async def _send(self, seq: _Sequence, message: _Message) -> None:
        if not self._inbox:
            self._inbox = self.nc.new_inbox()
            await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_ack)
        self._tokens += 1
        token = message.token = str(self._tokens)
        message.error = None
        message.sends += 1
        self._waiting[token] = (seq, message)
        seq.tokens.add(token)
        try:
            await publish_command(self.nc, hpub_command(
                message.subject, f"{self._inbox}.{token}", message.headers, message.body,
            ), len(message.body))
        except BaseException:
            self._waiting.pop(token, None)
            seq.tokens.discard(token)
            raise

    async def _on_ack(self, msg: Msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        found = self._waiting.pop(token, None)
        if found is None:
            return
        seq, message = found
        seq.tokens.discard(token)
        error, reply = _ack_of(msg)
        if error is None:
            if message.seq is None:  # an earlier send's late answer counts as well
                message.seq = reply["seq"]
                message.duplicate = bool(reply.get("duplicate"))
        elif token == message.token:  # an earlier send's error is old news
            message.error = error
            if getattr(error, "err_code", None) == WRONG_LAST_SEQUENCE:
                message.refused = str(error)
                self._fence(seq)
            elif getattr(error, "err_code", None) == IN_FLIGHT_LAST_SEQUENCE_ERR_CODE:
                self._break(seq)  # re-sent in order, one at a time, by the repair
            elif not is_transient(error):
                message.refused = str(error)
                log.error("the stream refused an output message on %s: %s", message.subject,
                          error)
        seq.progress.set()


    def _fence(self, seq: _Sequence) -> None:
        if seq.fenced:
            return
        seq.fenced = True
        log.warning("output of %s is fenced: another attempt has taken it over", seq.key)
        if self.on_fenced is not None:
            self.on_fenced(seq.key)


def _ack_of(msg: Msg) -> tuple[Exception, None] | tuple[None, dict[str, Any]]:
    """The stream's answer to a publish: its error, or the PubAck (parsed once)."""
    if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS:
        return ServiceUnavailableError(code=503, description="no responders"), None
    try:
        reply = orjson.loads(msg.data)
    except orjson.JSONDecodeError:
        return APIError(description=f"unreadable ack {msg.data[:80]!r}"), None
    if not isinstance(reply, dict):
        return APIError(description=f"unreadable ack {msg.data[:80]!r}"), None
    if error := reply.get("error"):
        try:
            APIError.from_error(error)  # raises the typed error for the code (503, 400 ...)
        except APIError as exc:
            return exc, None
        return APIError(**error), None
    return None, reply


class Storage(StrEnum):
    """How a sequence's messages are stored, from their confirmed stream sequences."""

    IN_ORDER = "in_order"
    REORDERED = "reordered"  # every message stored, some after a later one: still whole
    MISSING = "missing"  # some message has no stored copy


def stored_whole(seqs: Sequence[int | None]) -> Storage:
    """Pure: whether messages confirmed at these stream sequences (None: never confirmed)
    are stored whole, and in order. Two messages at one sequence are one event sent twice
    under the same Msg-Id (a duplicate): the stream holds it, once, so that is whole too, but
    not in order."""
    stored = [seq for seq in seqs if seq is not None]
    if len(stored) < len(seqs):
        return Storage.MISSING
    if any(later <= earlier for earlier, later in itertools.pairwise(stored)):
        return Storage.REORDERED
    return Storage.IN_ORDER


def _stored_seqs(seq: _Sequence) -> list[int | None]:
    # A message sent once and answered "duplicate" was stored by an earlier attempt of the
    # task (a continued task's dead worker, whose last tokens can land after the stream was
    # read back): that copy, the same event, came first, so it is not a reordering.
    return [m.seq for m in seq.messages if not (m.duplicate and m.sends == 1)]


def _problem(seq: _Sequence) -> str | None:
    """What keeps the stream from holding the sequence whole; None when it does (in order
    or not)."""
    if seq.fenced:
        return "fenced: another attempt has taken the task over"
    if refused := [m.refused for m in seq.messages if m.refused]:
        return f"the stream refused {len(refused)} message(s): {refused[0]}"
    if missing := sum(1 for m in seq.messages if m.seq is None):
        return f"{missing} of {len(seq.messages)} message(s) could not be stored"
    return None


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()):
        log.error("%s failed", task.get_name(), exc_info=exc)
