"""Counting what a fault did to the tasks: a pure function of the stored events.

Every task of a fault run asks for an exact number of tokens from an engine that always makes
them, so a task that ended `completed` must have stored tokens 0..expected-1, each once, and a
usage that agrees. The test never cancels anything, so any `cancelled` is spurious.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from fleet.bus.task_log import ordered
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk, token_indexes

# Failures a broker fault may cause without breaking the bar: the task ends, honestly, once.
ALLOWED_FAILURES = ("worker_lost", "runner_crashed", "output_lost")


@dataclass(frozen=True)
class Stored:
    """One event as FLEET_OUT holds it, with the server's time of storing it."""

    event: OutputEvent
    stored_at: float
    seq: int = 0  # stream sequence in FLEET_OUT


@dataclass
class FaultCounts:
    tasks: int = 0
    completed: int = 0
    lost: int = 0  # no terminal by the deadline, and no worker ever took it
    hung: int = 0  # no terminal by the deadline after a worker took it (accepted or tokens)
    late: int = 0  # a terminal, stored after the deadline (broker's return + 60 s)
    duplicate_terminals: int = 0  # tasks with more than one task_finished
    completed_with_gap: int = 0  # completed with missing/extra token indexes or a short usage
    duplicate_tokens: int = 0  # tasks that stored some token index twice
    spurious_cancelled: int = 0
    worker_lost: int = 0  # allowed, counted: failed/worker_lost
    runner_crashed: int = 0  # allowed, counted: failed/runner_crashed
    output_lost: int = 0  # allowed, counted: failed/output_lost (output not storable whole)
    other_failed: int = 0  # failed for any other reason (not allowed)
    # Diagnostics, not in the bar: output_lost although every token was stored (the whole
    # output was there, so ending it failed was avoidable), and tokens stored out of order.
    output_lost_but_whole: int = 0
    tokens_out_of_order: int = 0
    tokens_superseded: int = 0  # a continuation made again what an attempt stored past a hole
    output_after_terminal: int = 0  # tokens stored after the task's terminal (a second runner)
    workers_dead: int = 0  # worker processes that are not running at the end
    last_terminal_after_return_s: float | None = None
    examples: dict[str, list[str]] = field(default_factory=dict)  # kind -> a few task ids

    @property
    def bad(self) -> dict[str, int]:
        """The counts the issue's bar wants at zero."""
        names = ("lost", "hung", "late", "duplicate_terminals", "completed_with_gap",
                 "duplicate_tokens", "spurious_cancelled", "other_failed", "workers_dead")
        return {name: getattr(self, name) for name in names if getattr(self, name)}

    def note(self, kind: str, task_id: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        examples = self.examples.setdefault(kind, [])
        if len(examples) < 5:
            examples.append(task_id)


def tally(
    expected: dict[str, int],
    stored: dict[str, list[Stored]],
    *,
    returned_at: float,
    deadline_s: float = 60.0,
) -> FaultCounts:
    """Counts for the tasks of `expected` (task id -> its token count) from the events stored
    per task, in stream order."""
    counts = FaultCounts(tasks=len(expected))
    deadline = returned_at + deadline_s
    for task_id, tokens in expected.items():
        events = stored.get(task_id, [])
        terminals = [s for s in events if isinstance(s.event, TaskFinished)]
        if not terminals:
            started = any(isinstance(s.event, TaskAccepted | TokenChunk) for s in events)
            counts.note("hung" if started else "lost", task_id)
            continue
        if len(terminals) > 1:
            counts.note("duplicate_terminals", task_id)
        first = terminals[0]
        after = first.stored_at - returned_at
        latest = counts.last_terminal_after_return_s
        counts.last_terminal_after_return_s = after if latest is None else max(latest, after)
        if first.stored_at > deadline:
            counts.note("late", task_id)
        # Every token index stored (a token event may carry several tokens), and as a client
        # reads them (fleet.bus.task_log.ordered): a continuation supersedes what an earlier
        # attempt stored beyond the hole it resumes at, and that is no duplicate.
        raw = token_indexes(s.event for s in events)
        indexes = token_indexes(ordered((s.event for s in events), release_held=True))
        if len(indexes) != len(set(indexes)) or stored_twice([s.event for s in events]):
            counts.note("duplicate_tokens", task_id)
        elif len(raw) != len(indexes):
            counts.note("tokens_superseded", task_id)
        if raw != sorted(raw):
            counts.note("tokens_out_of_order", task_id)
        after_end = events[events.index(first) + 1:]
        if any(isinstance(s.event, TokenChunk) for s in after_end):
            counts.note("output_after_terminal", task_id)
        _judge(counts, task_id, first.event, indexes, tokens)
    return counts


def stored_twice(events: list[OutputEvent]) -> bool:
    """Whether some token index is stored twice by one attempt, or a continuation stored an
    index below the one it resumed at (both a failed dedupe). An index a continuation makes
    again at or past where it resumed supersedes the earlier attempt's copy: no duplicate."""
    resumed, seen = 0, set[int]()
    for event in events:
        if isinstance(event, TaskAccepted) and event.attempt > 0:
            resumed, seen = event.continued_from, set()
        elif isinstance(event, TokenChunk):
            for index in range(event.index, event.next_index):
                if index in seen or index < resumed:
                    return True
                seen.add(index)
    return False


def _judge(
    counts: FaultCounts, task_id: str, end: OutputEvent, indexes: list[int], expected: int
) -> None:
    assert isinstance(end, TaskFinished)
    if end.status == "completed":
        counts.completed += 1
        usage = end.usage.completion_tokens if end.usage else -1
        unique = sorted(set(indexes))
        if unique != list(range(expected)) or usage != expected:
            counts.note("completed_with_gap", task_id)
    elif end.status == "cancelled":
        counts.note("spurious_cancelled", task_id)
    elif end.reason is not None and end.reason.value in ALLOWED_FAILURES:
        counts.note(end.reason.value, task_id)
        if end.reason.value == "output_lost" and sorted(set(indexes)) == list(range(expected)):
            counts.note("output_lost_but_whole", task_id)
    else:
        counts.note("other_failed", f"{task_id}:{end.reason}")


def history(events: list[Stored], returned_at: float) -> str:
    """One task's stored events in a line: runs of tokens folded, times relative to the
    broker's return, so a failure's story reads at a glance."""
    parts: list[str] = []
    run: list[int] = []

    def fold() -> None:
        if run:
            parts.append(f"tok {run[0]}" if len(run) == 1 else f"tok {run[0]}-{run[-1]}")
            run.clear()

    for stored in events:
        event = stored.event
        if isinstance(event, TokenChunk) and (not run or event.index == run[-1] + 1):
            run.extend(range(event.index, event.next_index))
            continue
        fold()
        if isinstance(event, TokenChunk):
            run.extend(range(event.index, event.next_index))
        elif isinstance(event, TaskAccepted):
            parts.append(f"accepted {event.node_id} d{event.delivery}")
        elif isinstance(event, TaskFinished):
            parts.append(f"{event.status}/{event.reason or event.finish_reason}"
                         f" {event.node_id or ''}@{stored.stored_at - returned_at:+.1f}s")
        else:
            parts.append(event.type)
    fold()
    return "; ".join(parts)


def describe(counts: FaultCounts) -> str:
    shown = {k: v for k, v in vars(counts).items() if v not in (0, None, {})}
    return " ".join(f"{k}={v}" for k, v in shown.items())


def longest_silence(
    arrivals: dict[str, list[float]], ended: set[str], start: float, end: float
) -> float:
    """The longest time within [start, end] that a running task's stream went without an event
    (arrival times per task, as a live reader saw them). A task runs from its first event to
    its terminal; one not `ended` by the time of its last arrival still runs at `end`."""
    longest = 0.0
    for task_id, times in arrivals.items():
        if not times:
            continue
        seen = sorted(times)
        if task_id not in ended and seen[-1] < end:
            seen.append(end)
        for earlier, later in itertools.pairwise(seen):
            longest = max(longest, min(later, end) - max(earlier, start))
    return longest
