"""How many of a burst's prompts the text engine reads first, and when the rest may start.

On a CPU a prefill step is compute-bound: eight prompts read together take about as long as
reading them one group after another, and every one of them waits for the whole step before
its first token. Issue 23's burst of eight requests with one cached system prompt (smollm2-135m,
~29 new tokens each, 2 cores): the batch of eight read in ~1.0 s and all eight got their first
token after ~1.25 s in-process; mlx_lm.server, which happened to read seven and then one, had
its time to first token p50 at seven's cost.

So when several prompts are waiting and no other prompt is being read, a little more than half
of them (the first to arrive) are read first, and the rest start only once those have their
first token: the engine's next step would otherwise read the rest's prompts before it decodes the
first group's first token (the batch generator decodes, then reads, in one step). The first
group's first tokens come at about their own prefill's cost, the median request's among them;
the rest wait about as long as before plus a step or two, and the burst's tokens take about as
long in all (the same prompts are read, and the first group decodes while the rest read).
Below SPLIT_MIN prompts there is nothing to gain: the step's fixed costs dominate. A lone task
that had started before the others arrived (solo.py) continues ahead of them, in the first
group.
"""

from __future__ import annotations

SPLIT_MIN = 3  # a burst of this many new prompts or more is read in two groups


def first_group(queued: int) -> int:
    """How many of `queued` new prompts, arriving together, to read first: just over half, so
    that the median request is in the first group."""
    if queued < SPLIT_MIN:
        return queued
    return queued // 2 + 1


def prompts_to_start(
    *, queued: int, resumed: int, reading: int, group_waiting: int, limit: int
) -> int:
    """How many of the generator's queued prompts, from the front, may start this step.

    queued: inserted, not yet started; resumed: among them at the front, lone tasks that had
    already started (they continue at once: never held back); reading: prompts being read
    (the generator's prompt batch); group_waiting: tasks of a burst's first group still
    without their first token; limit: the engine's prefill batch size, which bounds the
    prompts read together.
    """
    if group_waiting:
        return 0  # the rest of the burst waits for the first group's first tokens
    room = max(0, limit - reading)
    if reading == 0:  # nothing else being read: the queued prompts are a new burst
        return min(room, resumed + first_group(queued - resumed))
    return min(room, queued)
