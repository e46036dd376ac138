"""Prefix-aware choice of a runner: pure, `choose_runner(blocks, candidates, weights)`.

Cost of sending a task to a runner, in blocks of prefill, i.e. roughly its time to first
token there: the prompt blocks it would have to prefill (those past the longest prefix it
holds), plus the prefill blocks still queued there (tasks sent there that have not produced
a first token: their prefill runs before or beside ours), plus `decode_blocks` per task
there that is already decoding (one more sequence in each batched step slows ours a little).
A decoding task weighs little: sending a returning conversation away from a runner that is
merely decoding costs its whole history's prefill elsewhere, which is what the first version
(4 blocks per task in flight, whatever it did) got wrong in `fleet bench --only routing`.
The cheapest runner with a free slot wins, so a returning conversation goes home while home
has room and no prefill queued to outweigh what it saves, and a hot prefix spills to the next
runner as soon as home has its prefill queued; a task never waits for a busy runner while
another has a free slot (the plan dispatches only to free slots).

Blocks a runner is prefilling right now (new to it, sent with a task that has no output
yet) are not in its cache yet: a task needing them would prefill them a second time. So a
runner is weighed twice: now (those blocks count as uncached, and blocks being prefilled on
another runner count once more, as the duplicate work they are), and after that prefill
(they count as cached; its queued prefill is already in the cost). When waiting is strictly
cheaper the answer is `Wait`: the task stays queued until the runner's first output, and
then goes there. In `fleet bench --only routing` two runners did 12 full system-prompt
prefills for 16 first turns where one runner did 4, because conversations sharing a system
prompt arrived while it was still being prefilled.

Runners on other nodes are candidates too, as their workers advertise them (FLEET_PREFIXES):
choosing one costs `hand_off_blocks` more (the hop is ~1 ms, but the view of it is up to a
second old), so a remote runner wins only when it saves more than a block of prefill; the
task then travels there whole (fleet.worker.handoff).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHeld:
    """What a runner's prefix cache holds, as the worker last sent it: block hashes, oldest
    first, at most `capacity` (LRU by blocks, like the cache's own byte budget)."""

    order: tuple[int, ...] = ()
    known: frozenset[int] = frozenset()

    def matched(self, blocks: Sequence[int], warming: frozenset[int] = frozenset()) -> int:
        """How many leading blocks of `blocks` this runner holds (not counting `warming`)."""
        count = 0
        for block in blocks:
            if block not in self.known or block in warming:
                break
            count += 1
        return count

    def served(self, blocks: Sequence[int], capacity: int) -> PrefixHeld:
        """After a task with `blocks` ran here: those blocks are the most recent, the leading
        one most of all, so eviction cuts a prompt from its end (a block is worth nothing
        once the one before it is gone)."""
        if not blocks:
            return self
        fresh = set(blocks)
        newest = tuple(reversed(dict.fromkeys(blocks)))
        order = tuple(b for b in self.order if b not in fresh) + newest
        order = order[-capacity:] if capacity > 0 else ()
        return PrefixHeld(order, frozenset(order))


@dataclass(frozen=True)
class Candidate:
    runner_id: str
    free_slots: int
    in_flight: int  # tasks there, prefilling or decoding
    held: PrefixHeld = PrefixHeld()
    node_id: str | None = None  # None: on this node; else the node a hand-off goes to
    prefill_blocks: int = 0  # prefill queued there: blocks of its tasks with no token yet
    prefilling: int = 0  # how many of its tasks in flight have no token yet
    warming: frozenset[int] = frozenset()  # blocks new to it that it is prefilling now


@dataclass(frozen=True)
class Wait:
    """Dispatch nothing yet: `runner_id` is prefilling this prompt's prefix; go there after."""

    runner_id: str


@dataclass(frozen=True)
class Weights:
    decode_blocks: float = 0.5  # one decoding task there costs like this many blocks
    prefix: bool = True  # False: today's rule, the runner with most free slots
    hand_off_blocks: float = 1.0  # passing a task to another node: a tie-breaker for here


def choose_runner(
    blocks: Sequence[int], candidates: Sequence[Candidate], weights: Weights = Weights(),
) -> str | None:
    chosen = choose(blocks, candidates, weights)
    return chosen.runner_id if isinstance(chosen, Candidate) else None


def choose(
    blocks: Sequence[int], candidates: Sequence[Candidate], weights: Weights = Weights(),
) -> Candidate | Wait | None:
    """The cheapest candidate with a free slot (ties: acting now, this node, more free
    slots, the id), or Wait when waiting for a prefill in progress is strictly cheaper."""
    free = [c for c in candidates if c.free_slots > 0]
    if not weights.prefix:
        free = [c for c in free if c.node_id is None]  # today's rule: this node only
        return max(free, key=lambda c: (c.free_slots, c.runner_id), default=None)
    options: list[tuple[tuple[float, bool, bool, int, str], Candidate | Wait]] = []
    for c in free:
        remote = c.node_id is not None
        decoding = max(0, c.in_flight - c.prefilling)
        load = c.prefill_blocks + weights.decode_blocks * decoding
        load += weights.hand_off_blocks if remote else 0.0
        ready = c.held.matched(blocks, c.warming)
        elsewhere = frozenset().union(*(o.warming for o in free if o is not c))
        duplicate = sum(1 for block in blocks[ready:] if block in elsewhere)
        now = len(blocks) - ready + duplicate + load
        options.append(((now, False, remote, -c.free_slots, c.runner_id), c))
        after = c.held.matched(blocks)
        if after > ready:  # its prefill in progress holds more of this prompt
            later = len(blocks) - after + load
            options.append(((later, True, remote, -c.free_slots, c.runner_id),
                            Wait(c.runner_id)))
    return min(options, key=lambda option: option[0], default=(None, None))[1]
