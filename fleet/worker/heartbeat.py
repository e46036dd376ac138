"""This node's heartbeat in FLEET_NODES, and the record of its own KV round trips that
liveness decisions weigh (fleet.worker.liveness): a worker that could not write its own key
lately judges no other node dead.

The heartbeat also lists the ack subjects of the task messages this node holds
(`NodeInfo.held_acks`), and the worker answers probes on `fleet.alive.<node>` while its
process lives: together they let the sweeper see this node die within a second or two and
hand its tasks on (fleet.worker.deathwatch).

A newly taken message is listed before its task can run: the worker takes it in (its claim)
beside `list_held`, which asks for a beat at once and returns when a beat that lists the
subject is stored, and hands the task to a runner only after both (issue 24); a fetched
message's listing is put from the fetch itself (`list_ahead`), beside its claim's create,
so that stored beat is usually there when the intake ends (issue 23). The heartbeat
used to find new holds by polling every 50 ms, and a worker killed before the poll left its
just-taken task to AckWait (30 s). What is left of that window is the time from the
server's delivery to the stored beat: the client's read of the message and one KV round trip,
plus up to LIST_GAP_S when beats follow each other (measured in
tests/worker/test_held_listing.py), in which no token of the task is made. JetStream offers
nothing to close it (docs/faults.md). Requests that arrive together share one beat (one put
in flight at a time, LIST_GAP_S apart at least), so a burst of tasks costs a few puts, not
one each.

A listing beat re-puts the node record the last full beat built, with the held list and the
time renewed (`rebuilds`): building it reads psutil's memory, the host and the models (~50 us
and four file opens), and one listing beat a task at light load spent that on the worker's
loop between a task's fetch and its dispatch (issue 23). The slow-changing facts are then at
most HEARTBEAT_S old, as they were between beats before any task arrived."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.kv_calls import bucket_max_age
from fleet.bus.pipelined import Sent, pipelined_for, stream_answer
from fleet.bus.records import NodeRecords, RunnerRecords
from fleet.bus.replies import inbox_reply
from fleet.bus.retry import BROKER_BUDGET_S
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo, RunnerRecord
from fleet.wire.codec import encode
from fleet.worker.liveness import (
    LinkHealth,
    beat_failed,
    beat_succeeded,
    gap_seen,
    trusts_absences,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 3.0
# A task message held since the last beat is listed within HELD_CHECK_S (a death in that
# window leaves it to AckWait); a burst of new ones is listed at most every HELD_GAP_S.
HELD_CHECK_S = 0.05
HELD_GAP_S = 0.25
# Beats asked for by `list_held` go out at once, then at most one per LIST_GAP_S (a sustained
# stream of new tasks: at most ~500 small puts a second, each listing all that arrived
# meanwhile; one put is in flight at a time, so a burst shares one anyway). It was 10 ms, and
# a client sending its next task as the last one finished (a cycle under 10 ms) waited out
# the rest of the gap in every intake: publish -> task_accepted 8-9 ms against 4-5 ms with
# 20 ms between tasks (issue 23, bench/README.md "Plumbing at rate").
LIST_GAP_S = 0.002
# How long an intake waits for its listing: a broker too slow for that (an election) must not
# stall intake; the message is then listed by a later beat, and until then AckWait guards it.
LIST_WAIT_S = 1.0
NODE_TTL_S = 15.0  # FLEET_NODES' max age in ops/jetstream; read from the bucket at start
# A message listed from its fetch (`list_ahead`) stays listed by that for this long: by then
# the worker's loop holds it (the held list has it) or it has ended.
AHEAD_LISTED_S = LIST_WAIT_S


class Heartbeat:
    def __init__(
        self, nc: Client, nodes: KeyValue, runners: KeyValue, node_id: str,
        info: Callable[[], NodeInfo], records: Callable[[], list[RunnerRecord]],
    ) -> None:
        self.nc = nc
        self.nodes = nodes
        self.runners = runners
        self.node_records, self.runner_records = NodeRecords(nodes), RunnerRecords(runners)
        self.node_id = node_id
        self.info = info
        self.records = records  # re-put each round, so their keys outlive their TTL
        self.health = LinkHealth()
        self.ttl_s = NODE_TTL_S
        self.wake = asyncio.Event()  # set to beat now (our own key was seen to expire)
        self._reconnects = 0
        # The ack subjects of the task messages this node holds (set by the worker).
        self.held: Callable[[], list[str]] = list
        self._listed: frozenset[str] = frozenset()  # what the last beat listed
        self._listing: frozenset[str] = frozenset()  # what the beat in flight lists
        self._asked = asyncio.Event()  # set by `list_held`: a listing is wanted now
        self._beaten = asyncio.Event()  # replaced after each beat: `list_held` waits on it
        self._built: tuple[NodeInfo, float] | None = None  # the last record built, and when
        self._ahead: dict[str, float] = {}  # fetched, not yet held: subject -> when fetched
        # A listing put `list_ahead` sent, and the record it put: the next beat reads its
        # answer. Sent only while `forever` runs (that beat comes) and no beat is under way.
        self._sent: tuple[Sent, NodeInfo] | None = None
        self._running = False
        self._beating = False
        self._last_put = float("-inf")  # when the last beat's put (or one sent ahead) began

    async def read_ttl(self, js: JetStreamContext) -> None:
        """How long a silent node's key lives: the bucket's max age (the TTL of record)."""
        try:
            max_age = await bucket_max_age(js, subjects.NODES_BUCKET)
        except Exception as exc:
            log.warning("node bucket TTL unknown (%s); assuming %.0f s", exc, NODE_TTL_S)
            return
        self.ttl_s = max_age or NODE_TTL_S

    def trusts_absences(self) -> bool:
        """Whether an absent heartbeat key is evidence of a dead node, now."""
        return trusts_absences(self.health, time.monotonic(), self.ttl_s, HEARTBEAT_S)

    def gap(self) -> None:
        """A reconnect or a restarted watch: what we saw before may have holes."""
        self.health = gap_seen(self.health)

    async def beat(self, budget_s: float = HEARTBEAT_S, *, records: bool = True) -> None:
        """One round; its outcome is the evidence `trusts_absences` weighs. `records`: a full
        beat (every HEARTBEAT_S): the node record is built afresh and the runner records are
        re-put too."""
        reconnects = self.nc.stats.get("reconnects", 0)
        if reconnects != self._reconnects:
            # Reconnected since the last round, however briefly: what we watched has holes.
            self._reconnects = reconnects
            self.gap()
        self._beating = True
        try:
            if not self.nc.is_connected:
                raise ConnectionError("not connected to NATS")
            sent: Sent | None = None
            if self._sent is not None:  # its put is out already: its answer is read here
                (sent, info), self._sent = self._sent, None
            else:
                self._last_put = now = time.monotonic()
                info = self._record(records, now)
            self._listing = frozenset(info.held_acks)
            try:
                await self._put(info, budget_s, sent)
                self._listed = self._listing
            finally:
                self._listing = frozenset()
                beaten, self._beaten = self._beaten, asyncio.Event()
                beaten.set()
        except Exception as exc:
            if self.health.failures == 0:
                log.warning("heartbeat failed (%s); no node is judged dead until it is back "
                            "for %.0f s", exc, self.ttl_s)
            self.health = beat_failed(self.health)
            return
        finally:
            self._beating = False
        if self.health.failures:
            log.info("heartbeat back after %d failed round(s)", self.health.failures)
        self.health = beat_succeeded(self.health, time.monotonic())
        for record in self.records() if records else ():
            try:
                await self.put_runner(record, budget_s)
            except Exception as exc:
                log.warning("runner record %s not refreshed: %s", record.runner_id, exc)

    def _record(self, full: bool, now: float) -> NodeInfo:
        """The node record a beat puts at `now`: built afresh when `full` or the last build
        is old (`rebuilds`), else the last one with the held list and the time renewed."""
        held, self._ahead = listing(self.held(), self._ahead, now)
        if self._built is None or rebuilds(full, self._built[1], now, HEARTBEAT_S):
            self._built = self.info(), now
        return self._built[0].model_copy(update={"held_acks": held, "at": time.time()})

    async def _put(self, info: NodeInfo, budget_s: float, sent: Sent | None = None) -> None:
        """The node's key written: one pipelined publish (fleet.bus.pipelined, as a claim's
        create), and anything but a stored answer within LIST_WAIT_S falls back to the
        retried put (NodeRecords.put) for what is left of `budget_s`. The KV layer's put
        (a retry closure, a permission watcher task, nats-py's request) was most of a listing
        beat's ~175 us of the loop's CPU, one beat a task at light load (issue 23). `sent`:
        the put of `info`, sent ahead (`list_ahead`): its answer is read as the put's."""
        began = time.monotonic()
        fast = pipelined_for(self.nc)
        try:
            answer = await (fast.answer(sent, LIST_WAIT_S) if sent is not None else fast.request(
                f"{self.nodes._pre}{self.node_id}", encode(info), timeout=LIST_WAIT_S))
            if stored(answer.data):
                return
        except Exception as exc:  # the retried put takes over (and says why if it fails)
            log.debug("heartbeat: the fast put had no answer (%r)", exc)
        await self.node_records.put(
            info, budget_s=max(0.0, budget_s - (time.monotonic() - began)))

    async def list_ahead(self, fetched: Iterable[str | None]) -> None:
        """List freshly fetched messages (their ack subjects) from now, before the worker's
        loop takes them in and holds them, and send the listing's put here, beside their
        claims' creates (fleet.worker.claims.Claims.ahead), when no beat is under way and
        the gap between puts allows: the next beat reads its answer, and the intake's
        `list_held` finds it stored or in flight (issue 23: at light load the put was sent
        ~1 ms after the fetch, its answer the last the intake waited for). Never raises."""
        now = time.monotonic()
        wanted = False
        for subject in fetched:
            if subject:
                self._ahead[subject] = now
                wanted = wanted or asks(subject, self._listed, self._listing)
        if not wanted:
            return
        self._asked.set()
        if (not self._running or self._beating or self._sent is not None
                or listing_wait(now, self._last_put) > 0 or not self.nc.is_connected):
            return  # the beat asked for puts it
        try:
            info = self._record(False, now)
            sent = await pipelined_for(self.nc).send(
                f"{self.nodes._pre}{self.node_id}", encode(info))
        except Exception as exc:  # the beat asked for puts it
            log.debug("heartbeat: the listing was not sent ahead (%r)", exc)
            return
        self._sent, self._listing, self._last_put = (sent, info), frozenset(info.held_acks), now

    async def put_runner(self, record: RunnerRecord, budget_s: float = BROKER_BUDGET_S) -> None:
        """A runner's record written as the node's is (`_put`): one pipelined publish, and
        the retried put (RunnerRecords.put) for anything but a stored answer. The status
        writer (fleet.worker.cluster) puts one as a runner leaves Ready and one as it comes
        back, two a task at light load; the KV layer's put cost ~165 us of the loop's CPU
        against ~85 (a real nats-server, LOADED; issue 23)."""
        began = time.monotonic()
        try:
            answer = await pipelined_for(self.nc).request(
                f"{self.runners._pre}{record.runner_id}", encode(record), timeout=LIST_WAIT_S)
            if stored(answer.data):
                return
        except Exception as exc:  # the retried put takes over (and says why if it fails)
            log.debug("runner record %s: the fast put had no answer (%r)", record.runner_id, exc)
        await self.runner_records.put(
            record, budget_s=max(0.0, budget_s - (time.monotonic() - began)))

    def taken_in(self, subject: str | None) -> None:
        """The worker's loop holds this fetched message now (its intake began): the held list
        lists it from here on, so it is listed from its fetch no more. Else one taken and
        settled between two beats stayed listed, settled, for AHEAD_LISTED_S: under batches
        hundreds at a time, in every beat's record."""
        if subject:
            self._ahead.pop(subject, None)

    def ask_to_list(self, subject: str | None) -> None:
        """Ask for a beat that lists `subject` now, without waiting for it: a caller that
        has its own round trip to make meanwhile (an intake's claim) then awaits `list_held`,
        and finds it listed, with no task of its own to race the two (issue 23)."""
        if asks(subject, self._listed, self._listing):
            self._asked.set()

    async def list_held(self, subject: str | None) -> float | None:
        """Until a stored beat lists `subject` (a held message's ack subject): the seconds
        that took, or None when LIST_WAIT_S passed first (a later beat lists it)."""
        began = time.monotonic()
        if not subject:
            return 0.0
        while subject not in self._listed:
            left = began + LIST_WAIT_S - time.monotonic()
            if left <= 0:
                log.info("held message not listed within %.1f s; a later beat lists it",
                         LIST_WAIT_S)
                return None
            beaten = self._beaten  # set when the beat in flight (or the next) is stored
            if asks(subject, self._listed, self._listing):
                self._asked.set()
            await set_within(beaten, left)
        return time.monotonic() - began

    async def forever(self) -> None:
        """Beat every HEARTBEAT_S, at once when our own key was seen to expire or a listing
        is asked for (`list_held`), and within HELD_CHECK_S of a held message nobody asked
        to list (a poll, for any hold that does not ask); answer probes meanwhile."""
        alive = await self.nc.subscribe(subjects.alive(self.node_id), cb=self._answer)
        last_full = time.monotonic()
        self._running = True
        try:
            while True:
                await set_within(self._asked, HELD_CHECK_S)
                now = time.monotonic()
                if (self._asked.is_set() and self._sent is None
                        and (wait := listing_wait(now, self._last_put)) > 0):
                    await asyncio.sleep(wait)  # the gap between puts
                    now = time.monotonic()
                asked, full = self._asked.is_set() or self._sent is not None, (
                    self.wake.is_set() or now - last_full >= HEARTBEAT_S)
                if full or asked or (now - self._last_put >= HELD_GAP_S
                                     and newly_held(self.held(), self._listed)):
                    self.wake.clear()
                    self._asked.clear()
                    last_full = now if full else last_full
                    await self.beat(records=full)  # a new hold: the node's key alone
        finally:
            self._running = False
            with contextlib.suppress(Exception):
                await alive.unsubscribe()

    async def _answer(self, msg: Msg) -> None:
        """A probe: any answer says this process lives (only on an inbox: a capability)."""
        if (reply := inbox_reply(msg.reply)) is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(reply, b"")


def listing_wait(now: float, last: float, gap: float = LIST_GAP_S) -> float:
    """Pure. How long an asked-for beat waits before its put: none once the last beat began
    `gap` ago or more, else the rest of the gap (puts at most one a gap)."""
    return max(0.0, last + gap - now)


def asks(subject: str | None, listed: frozenset[str], listing: frozenset[str]) -> bool:
    """Pure. Whether a beat must be asked for to list `subject`: not when the last stored
    beat listed it, nor while the beat in flight lists it (its end is awaited instead). An
    intake's wait that found the asked beat still in flight asked for a second one, and at
    light load every task cost two puts of the node record (issue 23)."""
    return bool(subject) and subject not in listed and subject not in listing


def stored(answer: bytes) -> bool:
    """Pure. Whether the stream's answer to a put is a PubAck (a sequence, no error)."""
    reply = stream_answer(answer)
    return reply is not None and reply.get("error") is None and bool(reply.get("seq"))


def rebuilds(full: bool, built_at: float, now: float, period: float = HEARTBEAT_S) -> bool:
    """Pure. Whether a beat builds the node record afresh (memory, host, models, runners)
    rather than re-put the last one built with its held list and time renewed: a full beat
    does, and so does any beat once the last build is `period` old (a listing beat never
    carries facts older than one full beat's period, even when full beats were put off)."""
    return full or now - built_at >= period


def listing(held: list[str], ahead: dict[str, float], now: float,
            keep: float = AHEAD_LISTED_S) -> tuple[list[str], dict[str, float]]:
    """Pure. What a beat at `now` lists, and what stays listed from its fetch
    (`Heartbeat.list_ahead`): the held messages, then those fetched less than `keep` ago
    that are not held (yet). One the held list has leaves `ahead`, listed by that from
    then on, so `ahead` stays a few entries however many tasks pass."""
    if not ahead:
        return held, ahead
    known = set(held)
    left = {subject: at for subject, at in ahead.items()
            if subject not in known and now - at < keep}
    return held + list(left), left


def newly_held(held: list[str], listed: frozenset[str]) -> bool:
    """Pure. Whether a message is held that the last beat did not list (one that ended since
    is harmless there: a nak of a settled message does nothing)."""
    return any(subject not in listed for subject in held)
