"""Prefix-aware choice of a runner: pure, `choose_runner(blocks, candidates, weights)`.

Cost of sending a task to a runner, in blocks of prefill, i.e. roughly its time to first
token there: the prompt blocks it would have to prefill (those past the longest prefix it
holds), plus the prefill blocks still queued there (tasks sent there that have not produced
a first token: their prefill runs before or beside ours), plus `decode_blocks` per task
there that is already decoding (one more sequence in each batched step slows ours a little).
A decoding task weighs little: sending a returning conversation away from a runner that is
merely decoding costs its whole history's prefill elsewhere, which is what the first version
(4 blocks per task in flight, whatever it did) got wrong in `fleet bench --only routing`.

Work is not free when the cores are busy. A runner with no task and a spare core on its
node (`Candidate.idle_core`: its worker measures the node's idle CPU) runs a prefill on a
core nobody else would use: only its latency counts, so an idle runner takes work rather than
let it queue elsewhere. Any other runner shares its core with its own tasks: prefill it does
that the best-placed runner would not have to do (it lacks the prefix) delays each of those
tasks as well as this one, so that extra work counts once per task there and once for this
one (`extra_work`: the fleet's sum of delays, not this task's alone). And when no
runner has an idle core (the fleet is saturated), a task may also wait for a runner without
a free slot that holds its prefix (`slot_wait_blocks` for the wait), rather than prefill it
again on a free one: on two runners sharing this machine's two cores, the first-turn burst of
`fleet bench --only routing` otherwise sent a conversation to whichever runner had a slot at
the moment it was pulled, and half the system prompts were prefilled on both runners.

Blocks a runner is prefilling right now (new to it, sent with a task that has no output
yet) are not in its cache yet: a task needing them would prefill them a second time. So a
runner is weighed twice: now (those blocks count as uncached, and for an idle runner blocks
being prefilled on another count once more, as the duplicate work they are), and after that
prefill (they count as cached; its queued prefill is already in the cost). When waiting is
strictly cheaper the answer is `Wait`: the task stays queued until the runner's first output
(or a free slot), and then goes there. Tasks already waiting for a runner count in its
`waiting_blocks`, so waiters do not all pile onto one runner.

Runners on other nodes are candidates too, as their workers advertise them (FLEET_PREFIXES):
choosing one costs `hand_off_blocks` more (the hop is ~1 ms, but the view of it is up to a
second old), so a remote runner wins only when it saves more than a block of prefill; the
task then travels there whole (fleet.worker.handoff). A remote runner without a free slot is
never waited for (its node would decline the hand-off).
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
    spare_core: bool = True  # its node has a core to spare (measured; True: not measured)
    waiting_blocks: float = 0.0  # what the tasks already waiting for it cost there

    @property
    def idle_core(self) -> bool:
        """Work sent here now runs on a core that nothing else uses."""
        return self.in_flight == 0 and self.spare_core


@dataclass(frozen=True)
class Wait:
    """Dispatch nothing yet: `runner_id` is prefilling this prompt's prefix, or holds it and
    has no free slot; go there after."""

    runner_id: str


@dataclass(frozen=True)
class Weights:
    decode_blocks: float = 0.5  # one decoding task there costs like this many blocks
    prefix: bool = True  # False: today's rule, the runner with most free slots
    hand_off_blocks: float = 1.0  # passing a task to another node: a tie-breaker for here
    extra_work: float = 1.0  # per block a busy runner prefills that another would not need
    slot_wait_blocks: float = 2.0  # waiting for a task of a full runner to finish


def choose_runner(
    blocks: Sequence[int], candidates: Sequence[Candidate], weights: Weights = Weights(),
) -> str | None:
    chosen = choose(blocks, candidates, weights)
    return chosen.runner_id if isinstance(chosen, Candidate) else None


Option = tuple[tuple[float, bool, bool, int, str], Candidate | Wait]


def choose(
    blocks: Sequence[int], candidates: Sequence[Candidate], weights: Weights = Weights(),
) -> Candidate | Wait | None:
    """The cheapest candidate with a free slot (ties: acting now, this node, more free
    slots, the id), or Wait when waiting for a prefill in progress, or for a slot of a
    runner that holds the prefix while every runner is busy, is strictly cheaper."""
    if not weights.prefix:
        free = [c for c in candidates if c.free_slots > 0 and c.node_id is None]  # this node
        return max(free, key=lambda c: (c.free_slots, c.runner_id), default=None)
    if len(candidates) == 1:
        # A sole candidate has no cost to compare: its free slot is the answer (or the wait
        # for one of this node's, or none of another's), unless its prefill in progress
        # holds more of the prompt (the wait for that is weighed below). The common case of
        # one runner a model, every plan (issue 23).
        c = candidates[0]
        if c.free_slots <= 0:
            return None if c.node_id is not None else Wait(c.runner_id)
        if not blocks or not c.warming or (
                c.held.matched(blocks) == c.held.matched(blocks, c.warming)):
            return c
    free = [c for c in candidates if c.free_slots > 0]
    saturated = not any(c.idle_core for c in free)
    # The least any runner would prefill, once the prefills in progress are done.
    least = min((len(blocks) - c.held.matched(blocks) for c in candidates), default=0)
    options: list[Option] = []
    for c in candidates:
        remote = c.node_id is not None
        if c.free_slots <= 0 and (remote or not saturated):
            continue
        decoding = max(0, c.in_flight - c.prefilling)
        load = c.prefill_blocks + weights.decode_blocks * decoding
        load += weights.hand_off_blocks if remote else 0.0
        rank = (remote, -c.free_slots, c.runner_id)
        after = len(blocks) - c.held.matched(blocks)
        if c.free_slots <= 0:  # wait for one of its tasks to finish
            later = after + load + c.waiting_blocks + weights.slot_wait_blocks
            options.append(((later, True, *rank), Wait(c.runner_id)))
            continue
        uncached = len(blocks) - c.held.matched(blocks, c.warming)
        options.append(((uncached + load + _charge(blocks, c, free, uncached, least, weights),
                         False, *rank), c))
        if after < uncached:  # its prefill in progress holds more of this prompt
            later = after + load + c.waiting_blocks
            options.append(((later, True, *rank), Wait(c.runner_id)))
    return min(options, key=lambda option: option[0], default=(None, None))[1]


def _charge(blocks: Sequence[int], c: Candidate, free: Sequence[Candidate], uncached: int,
            least: int, weights: Weights) -> float:
    """What prefilling here costs beyond this task's own minimum: for a busy runner, every
    block past what the best-placed runner would prefill, once for this task and once for
    each task in flight there (all of them wait for it: the sum of their delays); for an
    idle one, the blocks another runner is prefilling right now (duplicate work)."""
    if not c.idle_core:  # the task waits for that work, and so does each task there
        return weights.extra_work * max(0, uncached - least) * (1 + c.in_flight)
    elsewhere = frozenset().union(*(o.warming for o in free if o is not c))
    return float(sum(1 for block in blocks[len(blocks) - uncached:] if block in elsewhere))
