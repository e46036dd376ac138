"""Standing pull requests: when a class's durable is known to hold nothing a pull could take.

A pull request that waits on the server (a long wait's, fleet.worker.pulls) is handed the
next task of its class the moment one is stored, redeliveries included. So while such a
request of this worker is open and has brought nothing, the class holds no task waiting for
a pull: a `no_wait` pull of it would come back empty, one broker round trip later. A fetch
skips that pull (the class is *covered*) and waits for what the request brings instead.

Where the round trips were (issue 23, light load, one task at a time): the worker's next
fetch starts as it dispatches a task, and a round of `no_wait` pulls (interactive, default,
batch, one after another) was still out when the next task came, so that task waited for
the round and then for the long wait it ends in. The class that answered the last wait has
a request of its own posted again at once (`stands`), the other classes still have the
requests their cancelled waits left; with all three covered a fetch sends no pull at all
and a task is delivered as it is stored.

Covered ends before the request does on the server: at its expiry by this process's clock
(the server counts from later, when the request reaches it), and at any reconnect since it
was posted (a restarted server has forgotten it). Where a request is gone early anyway (its
consumer's leader changed), a task waits at most until that expiry, as a long wait would.

Pure: the clock and the connection's reconnect count are passed in; tested with tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Cover:
    """An open pull request of one class: until when it waits (this process's monotonic
    clock) and the connection's reconnect count when it was posted."""

    until: float
    reconnects: int


class Step(StrEnum):
    SKIP = "skip"  # no slot for the class in this pull
    COVERED = "covered"  # an open request of ours would have brought any task: no pull
    PULL = "pull"  # ask the durable for what it holds now (and take what waits here first)


def covered(cover: Cover | None, held: int, now: float, reconnects: int) -> bool:
    """Whether the class's durable holds no task a pull could take: a request of ours is
    open (not expired, not lost to a reconnect) and has brought nothing (`held`: what it and
    earlier requests brought that no pull took yet)."""
    return (cover is not None and held == 0 and now < cover.until
            and reconnects == cover.reconnects)


def round_step(wanted: int, is_covered: bool) -> Step:
    """What a fetch's round does with one class."""
    if wanted <= 0:
        return Step.SKIP
    return Step.COVERED if is_covered else Step.PULL


def stands(delivered: bool, free_left: int) -> bool:
    """Whether a class gets a standing request after a fetch: its wait brought a task (its
    request is spent) and the worker has a slot left for another of the class, so a task
    held by the request always has a slot to go to (or is taken at this worker's next pull,
    or given back at the request's expiry, as a cancelled wait's)."""
    return delivered and free_left > 0
