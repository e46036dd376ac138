"""Which token events ride on their task's terminal (issue 23): one FLEET_OUT message a task
fewer, when its runner reported them together.

The worker reads a runner's pipe a chunk at a time (fleet.wire.framing.take_frames), and a
step that ends a task usually writes its last token event and its terminal in the same chunk.
Those token events then go into the terminal (`TaskFinished.last_tokens`), stored with it in
one message: a stored stream cannot have the terminal without them, nor them without it.
Nothing is held back to wait for a terminal: only frames already read together ride, so a
stream's tokens reach their readers no later than before.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.wire.events import TaskFinished
from fleet.wire.pipe import RunnerReport
from fleet.wire.token_frames import TokenFrame

# A terminal carries at most this many token events, of at most this many bytes together
# (well under a NATS message's 1 MiB with the terminal's own fields): a step writes one
# event a task, so more than one rides only after a slow read.
MAX_TAIL_EVENTS = 4
MAX_TAIL_BYTES = 16 * 1024

Report = RunnerReport | TokenFrame


def with_tails(reports: Sequence[Report]) -> list[tuple[Report, tuple[TokenFrame, ...]]]:
    """Pure. The reports of one read, in order, each with the token events that ride on it:
    a terminal takes the token events of its own task written directly before it (the
    nearest, up to MAX_TAIL_EVENTS and MAX_TAIL_BYTES), which then are no reports of their own;
    every other report rides alone."""
    out: list[tuple[Report, tuple[TokenFrame, ...]]] = []
    for report in reports:
        if type(report) is not TaskFinished:
            out.append((report, ()))
            continue
        tail: list[TokenFrame] = []
        size = 0
        while out and len(tail) < MAX_TAIL_EVENTS:
            last, _ = out[-1]
            if type(last) is not TokenFrame or last.task_id != report.task_id:
                break
            size += len(last.body)
            if size > MAX_TAIL_BYTES:
                break
            tail.append(last)
            out.pop()
        tail.reverse()
        out.append((report, tuple(tail)))
    return out
