"""How much of a lone task's prompt one engine step reads, when more tasks are likely to follow.

A step is not interruptible: a task that arrives while a lone task reads its whole prompt in
one step waits for that step, then joins the batch, where the lone task's remaining tokens are
padded to the newcomers' prompt length. On smollm2-135m (~180-token prompts, 2 CPU cores) eight
closed-loop clients whose next requests reached the runner over ~0.3 s paid one lone prompt
read (~0.9 s) plus its padding in the batch (~0.8 s) before any of them got a first token:
TTFT 8.4 s against 6.5 s for mlx-lm with all eight inserted at once (issue 23).

So when the engine has just been running several tasks together (closed-loop clients, a
burst), a lone task reads its prompt in a ramp: a short first chunk, then chunks as long as
what it has read so far (doubling), up to the engine's prefill step. A task that arrives
meanwhile waits at most about as long as the lone task has run, and the lone task brings at
most that much padding into the batch. A task arriving at an engine that was serving one stream
at a time reads its prompt whole: each extra step costs a pass over the weights (~70 ms on that
model), which a single stream's time to first token would pay for nothing.
"""

from __future__ import annotations

RAMP_FIRST_TOKENS = 16  # the first chunk when company is expected: about two decode steps' time


def expects_company(peak_width: int) -> bool:
    """`peak_width`: the most tasks the engine ran together in its last busy spell (from a
    task admitted to an idle engine until it was idle again)."""
    return peak_width > 1


def chunk_tokens(read: int, first: int, limit: int) -> int:
    """Tokens of the prompt to read in the next step, `read` already read in earlier steps:
    `first`, then as many as already read, never more than `limit` (the caller also stops at
    the end of the segment). `first >= limit` reads in steps of `limit` from the start."""
    return max(1, min(limit, max(first, read)))
