"""Token events of a task that reached the gateway together, rendered as one event.

When a stream's reader falls behind its task (many streams on one gateway), several token
events wait for it at once. The relay (fleet.gateway.relay) then renders them as one
multi-token event (the shape a runner's coalescing makes: fleet.wire.events.TokenChunk), so a
client gets one SSE chunk with their text joined instead of one chunk each: the gateway
builds and the client parses one chunk where it did several. Only events that are already
here are joined (a reader that keeps up sees every event alone: nothing waits for a run to
fill), and only a renderer whose output does not depend on where the events were cut opts in
(`merges_tokens`): chat and text completions, whose SSE `id:` is then the run's last event
index, so a resume `after` it starts right after the run. The Responses API numbers every
delta (`sequence_number`) and a resume re-renders the stored events one by one, so it keeps
them apart. An event with logprobs stays alone (each token's logprobs are its own).

Pure functions of the items; the relay decides when a run ends (the next item not here yet).
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.bus.task_events import Indexed
from fleet.wire.events import TokenChunk

MAX_RUN = 64  # events joined at most (the relay's lines in one write: the same bound)


def mergeable(item: Indexed) -> bool:
    """A token event that may be joined to its neighbours: one without logprobs."""
    event = item.event
    return isinstance(event, TokenChunk) and event.logprob is None and not event.top_logprobs


def joins(last: Indexed, item: Indexed) -> bool:
    """Whether `item` continues the run that ends with `last`: the same task, the next
    position in the task's events and the next token index (nothing between them)."""
    before, event = last.event, item.event
    return (
        mergeable(item)
        and isinstance(before, TokenChunk)
        and isinstance(event, TokenChunk)
        and event.task_id == before.task_id
        and item.index == last.index + 1
        and event.index == before.next_index
    )


def merged(run: Sequence[Indexed]) -> Indexed:
    """One item for a run of joined token events: the first's index, time and token id, every
    token id, the text joined; its position is the run's last (what a resume goes after).
    Its `raw` is empty: no event with these bytes was ever stored."""
    if len(run) == 1:
        return run[0]
    first = run[0].event
    assert isinstance(first, TokenChunk)
    ids: list[int] = []
    texts: list[str] = []
    for item in run:
        event = item.event
        assert isinstance(event, TokenChunk)
        ids += event.ids
        texts.append(event.text)
    # model_copy skips validation: the run is checked above (`joins`), and the result is a
    # valid multi-token event (token_ids start with token_id, no logprobs, two or more ids).
    joined = first.model_copy(update={"token_ids": ids, "text": "".join(texts)})
    return Indexed(run[-1].index, joined, b"")
