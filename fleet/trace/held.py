"""Which finished spans wait for their trace's local roots, so that a task's spans leave in
one `fleet.traces.<trace_id>` message rather than one per flush window they ended in.

A local root is a span this process started with no parent or a parent from another process
(the worker's `process fleet.tasks.<model>`, the gateway's HTTP span). While a trace has one
open here, its finished spans (its children, and a runner's spans re-exported by its worker,
held as the runner wrote them: TraceSpans) are held; when the last one ends they are released
together with it. Nothing is held longer than HOLD_MAX_S, so a long task's spans still show
up while it runs. Pure: the caller passes the time and does the locking and publishing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.trace.records import Spans, count_of, trace_of

HOLD_MAX_S = 1.0  # a long task's finished spans still reach `fleet trace` within ~a second


@dataclass
class HeldTraces:
    roots: dict[str, int] = field(default_factory=dict)  # trace id -> its local roots open
    held: dict[str, list[Spans]] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)  # trace id -> first held at
    count: int = 0  # span records held, all traces (a runner's run counts its records)

    def opened(self, trace_id: str) -> None:
        self.roots[trace_id] = self.roots.get(trace_id, 0) + 1

    def closed(self, trace_id: str) -> list[Spans]:
        """A local root ended: the trace's held records once none is open (else nothing)."""
        open_ = self.roots.get(trace_id, 0) - 1
        if open_ > 0:
            self.roots[trace_id] = open_
            return []
        self.roots.pop(trace_id, None)
        return self._release(trace_id)

    def hold(self, spans: Spans, now: float) -> bool:
        """True: kept until its trace's roots end; False: send it with the next flush."""
        trace_id = trace_of(spans)
        if trace_id not in self.roots:
            return False
        self.held.setdefault(trace_id, []).append(spans)
        self.since.setdefault(trace_id, now)
        self.count += count_of(spans)
        return True

    def due(self, now: float) -> list[Spans]:
        """Records held HOLD_MAX_S or longer; their traces are held no more (a root that ends
        later goes out alone)."""
        late = [t for t, since in self.since.items() if now - since >= HOLD_MAX_S]
        released: list[Spans] = []
        for trace_id in late:
            self.roots.pop(trace_id, None)
            released += self._release(trace_id)
        return released

    def next_due(self) -> float | None:
        return min(self.since.values()) + HOLD_MAX_S if self.since else None

    def release_all(self) -> list[Spans]:
        released = [spans for held in self.held.values() for spans in held]
        self.held.clear()
        self.since.clear()
        self.count = 0
        return released

    def _release(self, trace_id: str) -> list[Spans]:
        self.since.pop(trace_id, None)
        released = self.held.pop(trace_id, [])
        self.count -= sum(count_of(spans) for spans in released)
        return released
