"""How many of a burst's prompts the text engine reads first, and when the rest may start.

On a CPU a prefill step is compute-bound: eight prompts read together take about as long as
reading them one group after another, and every one of them waits for the whole step before
its first token. Issue 23's burst of eight requests with one cached system prompt (smollm2-135m,
~29 new tokens each, 2 cores): the batch of eight read in ~1.0 s and all eight got their first
token after ~1.25 s in-process; mlx_lm.server, which happened to read seven and then one, had
its time to first token p50 at seven's cost.

So when several prompts reach an engine with nothing running, a little more than half of them
(the first to arrive) are read first, and the rest start only once those have their first
token: the engine's next step would otherwise read the rest's prompts before it decodes the
first group's first token (the batch generator decodes, then reads, in one step). The first
group's first tokens come at about their own prefill's cost, the median request's among them;
the rest wait about as long as before plus a step or two, and the burst's tokens take about as
long in all (the same prompts are read, and the first group decodes while the rest read).
Below SPLIT_MIN prompts there is nothing to gain: the step's fixed costs dominate.
"""

from __future__ import annotations

SPLIT_MIN = 3  # a burst of this many prompts or more, onto an idle engine, is read in two groups


def first_group(queued: int) -> int:
    """How many of `queued` prompts, arriving at an engine with nothing running, to read first:
    just over half, so that the median request is in the first group."""
    if queued < SPLIT_MIN:
        return queued
    return queued // 2 + 1


def prompts_to_start(
    *, queued: int, reading: int, running: int, group_waiting: int, limit: int
) -> int:
    """How many queued prompts may start their prefill this step.

    queued: inserted, not yet started; reading: prompts being read (the generator's prompt
    batch); running: tasks already reading or decoding (`reading` among them); group_waiting:
    tasks of a burst's first group still without their first token; limit: the engine's
    prefill batch size, which bounds the prompts read together.
    """
    if group_waiting:
        return 0  # the rest of the burst waits for the first group's first tokens
    room = max(0, limit - reading)
    if running == 0:
        return min(room, first_group(queued))
    return min(room, queued)
