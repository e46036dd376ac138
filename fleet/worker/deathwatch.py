"""Seeing a worker die in about a second, from the broker's view of its connection, without
ever taking a slow worker for a dead one.

Every worker answers requests on `fleet.alive.<node>` (a core subscription, one per process,
fleet.worker.heartbeat). While its process lives, its TCP connection holds that subscription
open: a request there is answered, or, when the worker is loaded or paused (SIGSTOP, a frozen
VM), simply not answered in time. When the process dies the kernel closes its socket, the
server drops its subscriptions at once, and a request gets NATS "no responders" straight away.
So the probe's outcome has three values, and only one of them is evidence:

    outcome          meaning                                   verdict
    answered         alive                                     alive
    silent           alive but slow, or paused, or cut off     alive (AckWait guards it)
    no_responders    its subscription is gone                  dead, once it persists

A subscription is also gone for a moment while its worker reconnects (a server restarted or a
cluster member lost): "no responders" must persist for CONFIRM_S, and a prober whose own
connection is fresh (it reconnected less than LINK_STABLE_S ago) trusts none, since a broker
restart disconnects everyone at once. When many probed nodes go missing together the broker
is the likelier cause than their deaths: they must stay missing for MASS_CONFIRM_S instead.

Who probes (fleet.worker.sweeper): the holder of the sweeper lease probes every node whose
heartbeat says it holds task messages (one request per busy node per PROBE_S, none per task),
and the holder of the sentinel lease probes the sweeper's holder alone. A node declared dead
has the task messages its last heartbeat listed nak'd (`held_acks`), so JetStream hands each
to another worker at once, which takes it over with the fence (fleet.worker.takeover). A
message is listed in a stored heartbeat before its task's work starts (fleet.worker.heartbeat,
`list_held`); only one whose taker died in the milliseconds between the server's delivery
and that beat goes when AckWait runs out (30 s): nothing of its task had started then.

A wrong verdict costs a seam, never a wrong answer: the nak'd holder, if it lived, is fenced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from nats.aio.client import Client
from nats.errors import NoRespondersError

from fleet.bus.replies import task_ack
from fleet.bus.task_queue import nak_held
from fleet.wire import subjects

log = logging.getLogger(__name__)

PROBE_S = 0.5  # how often the watcher probes each busy node
PROBE_TIMEOUT_S = 1.0  # an answer later than this is "silent": alive, or paused
CONFIRM_S = 1.0  # "no responders" for this long (and twice at least) means dead
LINK_STABLE_S = 5.0  # the prober's own connection must be this old to trust an absence
MASS_SHARE = 0.5  # more than this share of the probed nodes missing together: suspect NATS
MASS_CONFIRM_S = 15.0  # then they must stay missing this long (a node's heartbeat TTL)
# A nak is retried only this long (the watcher's round waits on it); a message left un-nak'd
# is redelivered when its AckWait runs out.
NAK_BUDGET_S = 2.0
MAX_PROBES_PER_S = 500  # one watcher's budget: a larger fleet is probed less often


class Probe(StrEnum):
    ANSWERED = "answered"
    SILENT = "silent"
    NO_RESPONDERS = "no_responders"


@dataclass(frozen=True)
class Absence:
    """Since when, and how many probes in a row, a node has had no subscription."""

    since: float
    count: int = 1


def observe(absence: Absence | None, probe: Probe, now: float) -> Absence | None:
    """Pure. The node's absence after one more probe: any sign of life clears it."""
    if probe is not Probe.NO_RESPONDERS:
        return None
    if absence is None:
        return Absence(since=now)
    return Absence(since=absence.since, count=absence.count + 1)


def dead_nodes(
    absences: Mapping[str, Absence], probed: int, now: float, link_since: float | None,
    self_id: str,
) -> set[str]:
    """Pure. The nodes to declare dead now. `probed`: how many nodes this round probed;
    `link_since`: when the prober's own connection last came up (None: it is down)."""
    if link_since is None or now - link_since < LINK_STABLE_S:
        return set()
    missing = [node for node in absences if node != self_id]
    mass = len(missing) > 1 and len(missing) > MASS_SHARE * max(probed, 1)
    confirm = MASS_CONFIRM_S if mass else CONFIRM_S
    return {
        node for node in missing
        # Counted from the link's return at the earliest: before it, the absence may be
        # this prober's own reconnect.
        if absences[node].count >= 2 and now - max(absences[node].since, link_since) >= confirm
    }


def probe_period(targets: int) -> float:
    """Pure. Seconds between probe rounds: PROBE_S, or longer where the busy nodes would
    cost the watcher more than MAX_PROBES_PER_S requests (2 s at 1,000 busy nodes)."""
    return max(PROBE_S, targets / MAX_PROBES_PER_S)


def acks_to_nak(held_acks: Iterable[str]) -> list[str]:
    """Pure. The subjects of a dead node's heartbeat that are acks of FLEET_TASKS deliveries
    (a subject read from a message is a capability: nothing else is published to)."""
    return [subject for subject in held_acks if task_ack(subject) is not None]


# What a watcher probes: node id -> the ack subjects its last heartbeat listed (busy nodes only).
Targets = Callable[[], Awaitable[Mapping[str, list[str]]]]


async def probe(nc: Client, node_id: str) -> Probe:
    """One request on the node's alive subject. Anything but "no responders" is no evidence
    of death (a timeout, or this prober's own connection failing)."""
    try:
        await nc.request(subjects.alive(node_id), b"", timeout=PROBE_TIMEOUT_S)
    except NoRespondersError:
        return Probe.NO_RESPONDERS
    except Exception:  # timed out, or our own link failed: not the node's death
        return Probe.SILENT
    return Probe.ANSWERED


class DeathWatch:
    """Probes `targets()` every PROBE_S and naks the held messages of each node found dead.
    Runs while this worker holds a lease that makes it a watcher (fleet.worker.sweeper)."""

    def __init__(self, nc: Client, node_id: str, targets: Targets, name: str,
                 on_dead: Callable[[str], None] = lambda node: None,
                 link_since: Callable[[], float | None] | None = None) -> None:
        self.nc, self.node_id, self.targets, self.name = nc, node_id, targets, name
        self.on_dead = on_dead  # the sweeper's failover moves its instances at once
        # Since when this worker's own KV round trips have gone through (its heartbeat's
        # LinkHealth.ok_since; None: failing now), so a watch that starts on a long-settled
        # link (a lease changing hands) trusts absences at once. Without it, from the start.
        self.link_since = link_since
        self.absences: dict[str, Absence] = {}
        self.declared: set[str] = set()  # dead, its messages nak'd: not again
        self.naks = 0  # sent (for tests and logs)
        self.probed = 0  # nodes probed in the last round
        self._reconnects = nc.stats.get("reconnects", 0)
        self._down = False
        self._own_since = float("-inf") if link_since is not None else time.monotonic()

    async def forever(self) -> None:
        while True:
            try:
                await self.round(time.monotonic())
            except Exception as exc:  # a broker outage: the next round tries again
                log.warning("%s: death watch round failed: %s", self.name, exc)
            # The probe period, not synchronisation.
            await asyncio.sleep(probe_period(self.probed))

    def _link(self, now: float) -> float | None:
        """When this prober's own connection last came up (None: down now)."""
        reconnects = self.nc.stats.get("reconnects", 0)
        if not self.nc.is_connected:
            self._down = True
            return None
        if self._down or reconnects != self._reconnects:
            self._down, self._reconnects, self._own_since = False, reconnects, now
        if self.link_since is None:
            return self._own_since
        settled = self.link_since()
        return None if settled is None else max(self._own_since, settled)

    async def round(self, now: float) -> set[str]:
        """One probe of every target; the nodes declared dead in this round."""
        targets = {node: acks for node, acks in (await self.targets()).items()
                   if node != self.node_id}
        nodes = list(targets)
        self.probed = len(nodes)
        outcomes = await asyncio.gather(*(probe(self.nc, node) for node in nodes))
        now = time.monotonic()
        link_since = self._link(now)
        absences = {}
        for node, outcome in zip(nodes, outcomes, strict=True):
            if (absence := observe(self.absences.get(node), outcome, now)) is not None:
                absences[node] = absence
        self.absences = absences
        self.declared &= set(absences)  # a node seen again may be declared again later
        dead = dead_nodes(absences, len(nodes), now, link_since, self.node_id) - self.declared
        for node in sorted(dead):
            self.on_dead(node)
            await self._hand_on(node, targets[node], now - absences[node].since)
        self.declared |= dead
        return dead

    async def _hand_on(self, node: str, held: list[str], absent_s: float) -> None:
        subjects_ = acks_to_nak(held)
        log.warning("%s: node %s is gone (no subscription for %.1f s): handing on its %d task "
                    "message(s)", self.name, node, absent_s, len(subjects_))
        for subject in subjects_:
            try:
                await nak_held(self.nc, subject, what=f"nak {subject} of dead node {node}",
                               budget_s=NAK_BUDGET_S)
                self.naks += 1
            except Exception as exc:  # left to AckWait
                log.warning("%s: nak of %s failed: %s", self.name, subject, exc)
