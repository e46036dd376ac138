"""The continuation chaos run: two workers serve many tasks of 320 tokens while a worker is
SIGKILLed (with its runner) every ~10 s and a fresh one takes its place. Every task must end
exactly once: completed with the same tokens as the same request run without a kill, or
`worker_lost` only where it used up its `max_continuations` (`max_deliveries` only where it
used up FLEET_MAX_DELIVER). Nothing lost, nothing duplicated,
no index gap (counted from what FLEET_OUT stored).

CI runs a short version (32 tasks, at most two kills); FLEET_CONTINUATION_CHAOS=1 the long one
(FLEET_CONTINUATION_TASKS tasks, default 120, kills until every task has ended); see
docs/faults.md for the figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from fleet.models.catalog import get_card
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.continuation import stored_events
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import ENV, NO_EOS, Live, first_after, place_on, run_whole
from tests.integration.harness import WorkerProcess, client, submit, wait_node

CHAOS = os.environ.get("FLEET_CONTINUATION_CHAOS") == "1"
TASKS = int(os.environ.get("FLEET_CONTINUATION_TASKS", "120")) if CHAOS else 32
MAX_KILLS = 10_000 if CHAOS else 2
KILL_EVERY_S = 10.0
MAX_TOKENS = 320
# Each worker death uses a delivery: with FLEET_MAX_DELIVER below max_continuations + 1 a task
# killed often ends max_deliveries before worker_lost; 4 is that bound exactly.
MAX_DELIVER = 4
CHAOS_ENV = {**ENV, "FLEET_MAX_DELIVER": str(MAX_DELIVER)}
SAMPLERS: dict[str, dict[str, object]] = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "seed": 1234},
    "frequency": {"frequency_penalty": 1.2},
    "top-p-logprobs": {"temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": True},
}


def request(task_id: str, sampler: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="tiny-llm", max_tokens=MAX_TOKENS, logit_bias=NO_EOS,
        messages=[ChatMessage(role="user", content=f"Tell me a long story ({sampler})")],
        **{"temperature": 0.0, **SAMPLERS[sampler]},  # type: ignore[arg-type]
    )


@dataclass
class Tally:
    """What became of each task, from its stored events."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, task_id: str) -> None:
        self.counts[kind] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < 5:
            examples.append(task_id)

    def judge(self, task: TextGeneration, events: list[OutputEvent], want: list[int]) -> None:
        task_id = task.task_id
        terminals = [e for e in events if isinstance(e, TaskFinished)]
        continuations = sum(isinstance(e, TaskAccepted) and e.attempt > 0 for e in events)
        self.counts["continued"] += continuations > 0
        tokens = [e for e in events if isinstance(e, TokenChunk)]
        indexes = [t.index + k for t in tokens for k in range(t.count)]  # several an event
        if not terminals:
            return self.note("lost", task_id)
        if len(terminals) > 1:
            self.note("duplicate_terminals", task_id)
        if len(indexes) != len(set(indexes)):
            self.note("duplicate_tokens", task_id)
        if sorted(set(indexes)) != list(range(len(set(indexes)))):
            self.note("gap", task_id)
        end = terminals[0]
        if end.status == "completed":
            ids = [i for t in sorted(tokens, key=lambda t: t.index) for i in t.ids]
            usage = end.usage.completion_tokens if end.usage else -1
            exact = ids == want and usage == len(want)
            return self.note("completed" if exact else "completed_unlike_reference", task_id)
        if end.reason == "worker_lost" and continuations >= task.max_continuations:
            return self.note("worker_lost_at_limit", task_id)
        deliveries = max((e.delivery for e in events if isinstance(e, TaskAccepted)), default=0)
        if end.reason == "max_deliveries" and deliveries >= MAX_DELIVER:
            return self.note("max_deliveries_at_limit", task_id)
        self.note(f"{end.status}/{end.reason}", task_id)


@pytest.mark.timeout(3600 if CHAOS else 420)
async def test_workers_killed_every_10s_lose_and_duplicate_nothing(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    card = get_card("tiny-llm")
    alive: dict[str, WorkerProcess] = {}

    async def add_worker(name: str) -> None:
        worker = start_worker(name, **CHAOS_ENV)
        node = await wait_node(nc, worker.data_dir, timeout=120)
        await place_on(nc, card, node)
        alive[node] = worker

    await asyncio.gather(add_worker("w0"), add_worker("w1"))
    references = {name: await run_whole(nc, request(f"ref-{name}", name)) for name in SAMPLERS}
    want = {name: [i for e in events if isinstance(e, TokenChunk) for i in e.ids]
            for name, events in references.items()}
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    sampler_of = {f"chaos-{i}": list(SAMPLERS)[i % len(SAMPLERS)] for i in range(TASKS)}
    tasks = [request(task_id, sampler) for task_id, sampler in sampler_of.items()]
    started = time.monotonic()
    for task in tasks:
        await submit(nc, task)

    def all_done() -> bool:
        return all(live.done(task.task_id) for task in tasks)

    kills: list[tuple[float, list[str]]] = []  # kill time, tasks then running on the victim
    # The first kill once answers are well under way, then one every KILL_EVERY_S (or as soon
    # after as the replacement is ready: two workers at every kill).
    # A kill continues only tasks whose output began (one that had sent nothing is rerun
    # afresh, attempt 0), so the first waits for a node with one streaming: under load the
    # node running the most may still be prefilling all of them.
    await live.until(lambda: all_done() or (sum(
        live.tokens(task.task_id) >= 40 for task in tasks) >= 4 and any(
        streaming_on(live, tasks, node) for node in alive)), 300)
    while not all_done() and len(kills) < MAX_KILLS:
        victim = max(alive, key=lambda node: (len(streaming_on(live, tasks, node)),
                                              len(running_on(live, tasks, node))))
        kills.append((time.monotonic(), running_on(live, tasks, victim)))
        alive.pop(victim).kill()
        print(f"{kills[-1][0] - started:6.1f} s: killed {victim} with "
              f"{len(kills[-1][1])} tasks running", flush=True)
        await add_worker(f"w{len(kills) + 1}")
        next_kill = kills[-1][0] + KILL_EVERY_S
        with_timeout = max(0.01, next_kill - time.monotonic())
        # The fault's schedule, not a synchronisation: it stops early when every task ended.
        with contextlib.suppress(TimeoutError):
            await live.until(all_done, with_timeout)
    await live.until(all_done, 600)
    elapsed = time.monotonic() - started

    tally = Tally()
    for task in tasks:
        events = await stored_events(nc, nc.jetstream(), task.task_id)
        tally.judge(task, events, want[sampler_of[task.task_id]])
    seams = [
        at - killed_at for killed_at, victims in kills for task_id in victims
        if (at := first_after(live, task_id)) is not None and at > killed_at
    ]
    report = (
        f"continuation chaos: {TASKS} tasks of {MAX_TOKENS} tokens, two workers, "
        f"{len(kills)} worker SIGKILLs ~{KILL_EVERY_S:.0f} s apart, {elapsed:.0f} s; "
        f"{dict(tally.counts)}; seam p50 "
        f"{statistics.median(seams) if seams else float('nan'):.2f} s, max "
        f"{max(seams, default=float('nan')):.2f} s"
    )
    print(f"\n{report}")
    assert kills, "every task ended before the first kill: make them longer"
    bad = {k: v for k, v in tally.counts.items()
           if k not in ("completed", "continued", "worker_lost_at_limit",
                        "max_deliveries_at_limit")}
    assert not bad, f"{report}\nexamples: {tally.examples}"
    at_a_limit = tally.counts["worker_lost_at_limit"] + tally.counts["max_deliveries_at_limit"]
    assert tally.counts["completed"] + at_a_limit == TASKS
    assert tally.counts["continued"] > 0, report
    await nc.close()


def running_on(live: Live, tasks: list[TextGeneration], node: str) -> list[str]:
    return [task.task_id for task in tasks
            if not live.done(task.task_id) and live.node_running(task.task_id) == node]


def streaming_on(live: Live, tasks: list[TextGeneration], node: str) -> list[str]:
    """The tasks running on `node` whose output began (a kill continues these)."""
    return [task_id for task_id in running_on(live, tasks, node) if live.tokens(task_id) > 0]
