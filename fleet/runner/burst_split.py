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

Nor below SPLIT_MIN_TOKENS new tokens in all (what the prompts leave to read past their
cached prefixes): the first group gains only the reading of the rest's few tokens, while the
rest lose three steps. Issue 23's burst of eight with one cached system prompt leaves ~29
tokens a prompt, 232 in all; read 5 + 3 (with the company window, fleet/runner/company.py,
they arrive together) its first tokens came at 0.89-1.11 s and 1.76-2.15 s against the
peer's p50 of ~1.8 s, and its aggregate was 0.98x the peer's (0.98x-1.00x in three quiet
runs): the TTFT had room to give, the aggregate none. The same burst with unique system
prompts (~140 tokens a prompt, 1,120 in all) is still split.
"""

from __future__ import annotations

SPLIT_MIN = 3  # a burst of this many new prompts or more is read in two groups
SPLIT_MIN_TOKENS = 512  # ... when they leave at least this many tokens to read in all


def first_group(queued: int, new_tokens: int) -> int:
    """How many of `queued` new prompts, arriving together with `new_tokens` to read past
    their cached prefixes, to read first: just over half, so that the median request is in
    the first group; all of them when they are few or short."""
    if queued < SPLIT_MIN or new_tokens < SPLIT_MIN_TOKENS:
        return queued
    return queued // 2 + 1


def prompts_to_start(
    *, queued: int, resumed: int, reading: int, group_waiting: int, held: int, limit: int,
    new_tokens: int,
) -> int:
    """How many of the generator's queued prompts, from the front, may start this step.

    queued: inserted, not yet started; resumed: among them at the front, lone tasks that had
    already started (they continue at once: never held back); reading: prompts being read
    (the generator's prompt batch); group_waiting: tasks of a burst's first group still
    without their first token; held: the rest of that burst, still queued (they start
    together, not split again); limit: the engine's prefill batch size, which bounds the
    prompts read together; new_tokens: what the queued prompts that are not resumed
    leave to read past their cached prefixes.
    """
    if group_waiting:
        return 0  # the rest of the burst waits for the first group's first tokens
    room = max(0, limit - reading)
    if reading == 0 and not held:  # nothing else being read: the queued prompts are a burst
        return min(room, resumed + first_group(queued - resumed, new_tokens))
    return min(room, queued)
