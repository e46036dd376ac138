"""How many of a burst's prompts the text engine reads first, and when the rest may start.

A prefill step is not interruptible, and every prompt read in it waits for the whole step
before its first token. Issue 23's burst of eight requests with one cached system prompt
(smollm2-135m, ~29 new tokens each, 2 cores): read together, all eight got their first token
after the whole batch's prefill (1.15-1.28 s of it in-process), and a request that arrived
while a lone task ran waited for that one too (through Fleet's HTTP path: one at 0.37-0.51 s,
seven at 1.99-2.25 s, against mlx_lm.server's 1.67-1.87 s; loaded runs).

So when several new prompts are waiting and no other prompt is being read, just over half of
them (the first to arrive) are read first, and the rest start only once those have their
first token: the engine's next step would otherwise read the rest's prompts before it
decodes the first group's first token (the batch generator decodes, then reads, in one
step). A lone task that had started before the others arrived (solo.py) continues ahead of
them, in the first group; the rest of the burst then start together, not split again (split
again, the last of them waited three steps longer once more: 5 + 2 + 1 in a bench). The
trade, in-process, a lone task then seven (load 0.6-1, 2 repetitions each, interleaved):
time to first token p50 1.73 -> 1.15 s and mean 1.70 -> 1.52 s, but the last of the eight
1.73 -> 2.15 s and the burst's tokens 2 % slower in all (the rest start three steps later).
Below SPLIT_MIN new prompts there is nothing to gain: the step's fixed costs dominate.
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
    *, queued: int, resumed: int, reading: int, group_waiting: int, held: int, limit: int
) -> int:
    """How many of the generator's queued prompts, from the front, may start this step.

    queued: inserted, not yet started; resumed: among them at the front, lone tasks that had
    already started (they continue at once: never held back); reading: prompts being read
    (the generator's prompt batch); group_waiting: tasks of a burst's first group still
    without their first token; held: the rest of that burst, still queued (they start
    together, not split again); limit: the engine's prefill batch size, which bounds the
    prompts read together.
    """
    if group_waiting:
        return 0  # the rest of the burst waits for the first group's first tokens
    room = max(0, limit - reading)
    if reading == 0 and not held:  # nothing else being read: the queued prompts are a burst
        return min(room, resumed + first_group(queued - resumed))
    return min(room, queued)
