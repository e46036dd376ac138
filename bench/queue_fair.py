"""`fleet bench --only queue`, measure (2) of issue 25: tenant A keeps 10x tenant B's requests
going through the gateway; B's share of the tokens served against its weight share, and B's
time to first token beside A against B alone.

B keeps as many requests going as its weight share of the slots (8 of 16 with equal weights,
11 with B weighing 2 against A's 1): a scheduler that gives each tenant its weighted share
gives B all it asks, so B's share can reach its weight share and its TTFT can stay as alone.
A keeps 10x as many going, so A alone would fill the fleet many times over. Each tenant is a
key in the keys file the `fleet up` under test reads, with its weight in its tenant record
(README, "Priorities and fair tenants"). Every request is streamed (`include_usage`), so its
first token and its tokens are timed at the client.

Where B's first token goes (`Stages`, with the stack's NATS connection): the bench hears each
task as the gateway publishes it (a core subscription to `fleet.tasks.>`) and its runner's
`task_accepted`, so B's TTFT splits into the gateway's admission (sent -> published), the
broker's queue and the worker's dispatch (published -> accepted) and the runner's first token
and its relay (accepted -> first token at the client).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.plumbing_rate import MODEL
from fleet.gateway.keys import key_hash, new_key
from fleet.wire import subjects
from fleet.wire.codec import decode_event, decode_events, sent_task_id
from fleet.wire.events import TaskAccepted, TokenChunk


@dataclass(frozen=True)
class FairPlan:
    alone_s: float = 15.0  # B by itself
    warm_s: float = 10.0  # A and B together before the window: A's head start is served
    window_s: float = 30.0  # what is counted
    weights: tuple[tuple[float, float], ...] = ((1.0, 1.0), (1.0, 2.0))  # (A, B)
    tokens: int = 50
    tokens_per_s: int = 50  # a request holds a slot ~1 s
    rounds: int = 1  # each weight pair measured this many times, pairs interleaved


QUICK_FAIR = FairPlan(alone_s=3.0, warm_s=2.0, window_s=5.0, weights=((1.0, 1.0),),
                      tokens=10, tokens_per_s=20)
HIGH_RATIO = 1.5  # B's TTFT beside A over alone: the target; a round above it shows its stages


def cells_of(plan: FairPlan) -> list[tuple[float, float]]:
    """The (A, B) weights of each run of the plan, run index order (pure): every pair once a
    round, so a change of load during the rounds falls on every pair."""
    return [pair for _ in range(plan.rounds) for pair in plan.weights]


@dataclass
class Served:
    """One streamed request as its client saw it (perf_counter seconds)."""
    sent: float
    first: float | None
    end: float
    tokens: int
    task_id: str = ""


class Stages:
    """When each task was published (seen on `fleet.tasks.>`), accepted by a runner (its
    first `task_accepted` on `fleet.out.<id>`) and had its first token on NATS (the worker
    published it), perf_counter seconds, heard by the bench."""

    def __init__(self) -> None:
        self.published: dict[str, float] = {}
        self.accepted: dict[str, float] = {}
        self.first_out: dict[str, float] = {}
        self.on_lane: set[str] = set()  # published on a tenant lane, not the shared subject
        self.subs: list[Any] = []

    async def start(self, nc: Client) -> None:
        async def on_task(msg: Msg) -> None:
            if (task_id := sent_task_id(msg.data)) is not None:
                self.published.setdefault(task_id, time.perf_counter())
                if subjects.tenant_of_task_subject(msg.subject) is not None:
                    self.on_lane.add(task_id)

        async def on_out(msg: Msg) -> None:
            task_id = msg.subject.rsplit(".", 1)[1]
            if task_id not in self.accepted:
                if isinstance(decode_event(msg.data), TaskAccepted):
                    self.accepted[task_id] = time.perf_counter()
            elif task_id not in self.first_out and any(  # the last may ride the terminal
                    isinstance(event, TokenChunk) for event in decode_events(msg.data)):
                self.first_out[task_id] = time.perf_counter()

        self.subs = [await nc.subscribe("fleet.tasks.>", cb=on_task),
                     await nc.subscribe("fleet.out.*", cb=on_out)]

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()


def stage_p50s_ms(served: list[Served], stages: Stages, start: float,
                  end: float) -> dict[str, float | None]:
    """Median of each stage of the requests sent within [start, end) that were heard at
    every stage (pure): admission, queue (and dispatch), first token (runner and relay); and
    the fraction of them published on a tenant lane (`on_lane`); then the first token split
    where the worker published it: `runner` (accepted -> on NATS: the runner's step, its pipe
    and the worker) and `relay` (NATS -> the client: the gateway and HTTP)."""
    spans: dict[str, list[float]] = {"admission": [], "queue": [], "first_token": []}
    split: dict[str, list[float]] = {"runner": [], "relay": []}
    for s in served:
        published = stages.published.get(s.task_id)
        accepted = stages.accepted.get(s.task_id)
        if s.first is None or published is None or accepted is None or \
                not start <= s.sent < end:
            continue
        spans["admission"].append(published - s.sent)
        spans["queue"].append(accepted - published)
        spans["first_token"].append(s.first - accepted)
        if (out := stages.first_out.get(s.task_id)) is not None:
            split["runner"].append(out - accepted)
            split["relay"].append(s.first - out)
    p50s: dict[str, float | None] = {
        k: round(statistics.median(v) * 1000, 1) if v else None for k, v in spans.items()}
    sent = [s for s in served if start <= s.sent < end and s.task_id in stages.published]
    p50s["on_lane"] = round(sum(s.task_id in stages.on_lane for s in sent) / len(sent), 2) \
        if sent else None
    p50s.update({k: round(statistics.median(v) * 1000, 1) if v else None
                 for k, v in split.items()})
    return p50s


def b_waits(b: list[Served], a: list[Served], stages: Stages, start: float, end: float,
            slots: int) -> dict[str, float | None]:
    """What B's requests sent within [start, end) waited behind (pure), among those heard
    published and accepted: `a_queued_ahead`, the fraction published while a task of A's was
    in the broker (published, not yet accepted); `a_started_meanwhile`, the fraction during
    whose queue stage a task of A's was accepted (a slot went to A while B's waited);
    `full_at_publish`, the fraction published while every slot held a task (accepted, its
    client not yet done: an upper bound, as the client ends after the runner); B's queue
    stage p50 with a task of A's ahead and without, and B's admission and queue p90 (ms)."""
    heard = {s.task_id: (stages.published[s.task_id], stages.accepted[s.task_id], s.end)
             for s in a + b if s.task_id in stages.published and s.task_id in stages.accepted}
    a_spans = [heard[s.task_id] for s in a if s.task_id in heard]
    mine = [(s.sent, *heard[s.task_id]) for s in b
            if start <= s.sent < end and s.task_id in heard]
    if not mine:
        return {}
    ahead = meanwhile = full = 0
    queue_ahead: list[float] = []
    queue_clear: list[float] = []
    for _, published, accepted, _ in mine:
        queued = any(p <= published < q for p, q, _ in a_spans)
        ahead += queued
        meanwhile += any(published < q < accepted for _, q, _ in a_spans)
        full += sum(q <= published < e for _, q, e in heard.values()) >= slots
        (queue_ahead if queued else queue_clear).append(accepted - published)
    return {"a_queued_ahead": round(ahead / len(mine), 2),
            "a_started_meanwhile": round(meanwhile / len(mine), 2),
            "full_at_publish": round(full / len(mine), 2),
            "queue_p50_a_ahead_ms": _ms(queue_ahead), "queue_p50_none_ahead_ms": _ms(queue_clear),
            "admission_p90_ms": _ms([p - sent for sent, p, _, _ in mine], 0.9),
            "queue_p90_ms": _ms([q - p for _, p, q, _ in mine], 0.9)}


def _ms(values: list[float], quantile: float = 0.5) -> float | None:
    """The quantile of `values` (seconds) in ms, the median as statistics.median; None of none."""
    if not values:
        return None
    if quantile == 0.5:
        return round(statistics.median(values) * 1000, 1)
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] * 1000, 1)


def tokens_in(served: list[Served], start: float, end: float) -> float:
    """Tokens served within [start, end) (pure): a request's tokens spread evenly over its
    first token to its end, counted by the part of that span inside the window."""
    total = 0.0
    for s in served:
        if s.first is None or s.tokens == 0:
            continue
        span = s.end - s.first
        if span <= 0:
            total += s.tokens if start <= s.end < end else 0
            continue
        overlap = min(end, s.end) - max(start, s.first)
        total += s.tokens * max(0.0, overlap) / span
    return total


def ttft_p50_ms(served: list[Served], start: float, end: float) -> float | None:
    """Median time to first token of the requests sent within [start, end) (pure)."""
    waits = [s.first - s.sent for s in served if s.first is not None and start <= s.sent < end]
    return round(statistics.median(waits) * 1000, 1) if waits else None


def b_clients(slots: int, weight_a: float, weight_b: float) -> int:
    """B's requests kept going: its weight share of the slots, rounded up (pure)."""
    return max(1, math.ceil(slots * weight_b / (weight_a + weight_b) - 1e-9))


def weight_pairs(text: str) -> tuple[tuple[float, float], ...]:
    """`1:1,1:2` -> ((1.0, 1.0), (1.0, 2.0)) (pure)."""
    pairs = [part.split(":") for part in text.split(",")]
    return tuple((float(a), float(b)) for a, b in pairs)


def tenant_lines(run: int, weight_a: float, weight_b: float) -> list[tuple[str, float]]:
    """The tenants of one run and their weights: fresh names a run, so no counter of an
    earlier run carries over (pure)."""
    return [(f"fair{run}-a", weight_a), (f"fair{run}-b", weight_b)]


async def _one(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> Served:
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", f"{base}/chat/completions", json=body) as response:
        response.raise_for_status()
        task_id = response.headers.get("x-fleet-task-id", "")
        async for line in response.aiter_lines():
            if first is None and '"content":"' in line:
                first = time.perf_counter()
            elif '"completion_tokens"' in line and line.startswith("data: "):
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return Served(sent, first, time.perf_counter(), tokens, task_id)


async def _tenant(base: str, key: str, clients: int, body: dict[str, Any],
                  stop: asyncio.Event, out: list[Served]) -> None:
    """`clients` requests kept going (each client sends its next when its last ends) until
    `stop`; the ones under way then run to their end."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits,
                                 headers={"authorization": f"Bearer {key}"}) as client:
        async def loop() -> None:
            while not stop.is_set():
                out.append(await _one(client, base, body))

        await asyncio.gather(*(loop() for _ in range(clients)))


def write_keys(keys_file: Path, plan: FairPlan) -> dict[str, str]:
    """Append a key for every tenant of the plan's runs, with its weight, to the keys file;
    tenant -> key."""
    keys: dict[str, str] = {}
    with keys_file.open("a") as file:
        for run, (weight_a, weight_b) in enumerate(cells_of(plan)):
            for tenant, weight in tenant_lines(run, weight_a, weight_b):
                keys[tenant] = new_key()
                file.write(json.dumps({"tenant": tenant, "sha256": key_hash(keys[tenant]),
                                       "weight": weight}) + "\n")
    return keys


async def measure_fair(base: str, keys: dict[str, str], run: int, slots: int,
                       plan: FairPlan, nc: Client | None = None) -> dict[str, Any]:
    """B alone, then A and B together (module docstring); with `nc` (the stack's NATS), B's
    TTFT split into its stages alone and beside A."""
    stages = Stages()
    if nc is not None:
        await stages.start(nc)
    try:
        return await _measure_fair(base, keys, run, slots, plan, stages)
    finally:
        await stages.stop()


async def _measure_fair(base: str, keys: dict[str, str], run: int, slots: int,
                        plan: FairPlan, stages: Stages) -> dict[str, Any]:
    (a, weight_a), (b, weight_b) = tenant_lines(run, *cells_of(plan)[run])
    n_b = b_clients(slots, weight_a, weight_b)
    n_a = 10 * n_b
    body = {"model": MODEL, "max_tokens": plan.tokens + 14, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content":
                          f"tokens:{plan.tokens} tokens_per_s:{plan.tokens_per_s}"}]}
    alone: list[Served] = []
    stop = asyncio.Event()
    began = time.perf_counter()
    b_alone = asyncio.ensure_future(_tenant(base, keys[b], n_b, body, stop, alone))
    await asyncio.sleep(plan.alone_s)  # the load runs for this long: a measured span
    stop.set()
    await b_alone
    alone_end = time.perf_counter()

    served: dict[str, list[Served]] = {a: [], b: []}
    stop = asyncio.Event()
    both = [asyncio.ensure_future(_tenant(base, keys[t], n, body, stop, served[t]))
            for t, n in ((a, n_a), (b, n_b))]
    start = time.perf_counter() + plan.warm_s
    end = start + plan.window_s
    await asyncio.sleep(plan.warm_s + plan.window_s)  # the measured span
    stop.set()
    await asyncio.gather(*both)
    drained = time.perf_counter()
    tokens = {t: tokens_in(served[t], start, end) for t in (a, b)}
    total = sum(tokens.values())
    share_b = tokens[b] / total if total else 0.0
    target = weight_b / (weight_a + weight_b)
    alone_p50 = ttft_p50_ms(alone, began, alone_end)
    beside_p50 = ttft_p50_ms(served[b], start, end)
    return {
        "weight_a": weight_a, "weight_b": weight_b, "clients_a": n_a, "clients_b": n_b,
        "tokens_a": round(tokens[a]), "tokens_b": round(tokens[b]),
        "tokens_per_s": round(total / plan.window_s, 1),
        "share_b": round(share_b, 3), "weight_share_b": round(target, 3),
        "share_off_by": round(abs(share_b - target) / target, 3),
        "ttft_b_alone_p50_ms": alone_p50, "ttft_b_beside_a_p50_ms": beside_p50,
        "ttft_a_p50_ms": ttft_p50_ms(served[a], start, end),
        "ttft_ratio": round(beside_p50 / alone_p50, 2) if alone_p50 and beside_p50 else None,
        "requests_b_in_window": sum(start <= s.sent < end for s in served[b]),
        "requests_b_alone": len(alone), "drain_s": round(drained - end, 1),
        "stages_b_alone_p50_ms": stage_p50s_ms(alone, stages, began, alone_end),
        "stages_b_beside_a_p50_ms": stage_p50s_ms(served[b], stages, start, end),
        "stages_a_p50_ms": stage_p50s_ms(served[a], stages, start, end),
        "b_waits": b_waits(served[b], served[a], stages, start, end, slots),
    }


def fair_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per weight pair over its rounds (pure): B's share and B's TTFT ratio as (median, least,
    most), and the rounds whose ratio was above HIGH_RATIO, with B's stages beside A and
    alone and what B's requests waited behind (`b_waits`)."""
    pairs: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, r in enumerate(runs):
        pairs.setdefault(f"{r['weight_a']:g}:{r['weight_b']:g}", []).append((i, r))
    summary: dict[str, dict[str, Any]] = {}
    for pair, rounds in pairs.items():
        ratios = [r["ttft_ratio"] for _, r in rounds if r["ttft_ratio"] is not None]
        summary[pair] = {
            "rounds": len(rounds),
            "share_b": _spread([r["share_b"] for _, r in rounds], 3),
            "ttft_ratio": _spread(ratios, 2),
            "met_ttft": sum(x <= HIGH_RATIO for x in ratios),
            "high": [{"run": i, "ttft_ratio": r["ttft_ratio"],
                      "stages_b_beside_a_p50_ms": r.get("stages_b_beside_a_p50_ms"),
                      "stages_b_alone_p50_ms": r.get("stages_b_alone_p50_ms"),
                      "b_waits": r.get("b_waits")}
                     for i, r in rounds if (r["ttft_ratio"] or 0) > HIGH_RATIO],
        }
    return summary


def _spread(values: list[float], digits: int) -> list[float] | None:
    """(median, least, most), rounded; None of none."""
    if not values:
        return None
    return [round(statistics.median(values), digits), round(min(values), digits),
            round(max(values), digits)]


def summary_rows(summary: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for pair, cell in summary.items():
        share, ratio = cell["share_b"] or [0, 0, 0], cell["ttft_ratio"] or [None] * 3
        rows.append(
            f"  {pair} over {cell['rounds']} rounds: B's share median {share[0]:.1%} "
            f"({share[1]:.1%}-{share[2]:.1%}); B's TTFT ratio median x{ratio[0]} "
            f"(x{ratio[1]}-x{ratio[2]}), <= {HIGH_RATIO} in {cell['met_ttft']}")
        rows += [f"    run {h['run']} x{h['ttft_ratio']}: B's stages beside A "
                 f"{stages_text(h['stages_b_beside_a_p50_ms'])}, alone "
                 f"{stages_text(h['stages_b_alone_p50_ms'])}; waits {h['b_waits']}"
                 for h in cell["high"]]
    return rows


def fair_rows(runs: list[dict[str, Any]]) -> list[str]:
    return [
        f"  tenants A:B weigh {r['weight_a']:g}:{r['weight_b']:g}, {r['clients_a']} vs "
        f"{r['clients_b']} requests kept going: B served {r['share_b']:.1%} of the tokens "
        f"(weight share {r['weight_share_b']:.1%}, off by {r['share_off_by']:.0%}; "
        f"{r['tokens_per_s']} tok/s in all); B's TTFT p50 {r['ttft_b_beside_a_p50_ms']} ms "
        f"beside A, {r['ttft_b_alone_p50_ms']} ms alone (x{r['ttft_ratio']}), "
        f"A's {r['ttft_a_p50_ms']} ms; B's stages p50 ({STAGES}) "
        f"alone {stages_text(r.get('stages_b_alone_p50_ms'))}, beside A "
        f"{stages_text(r.get('stages_b_beside_a_p50_ms'))}; B's waits {r.get('b_waits')}"
        for r in runs
    ]


STAGES = ("admission / queue / first token ms, share on a lane, the first token's runner / "
          "relay ms")


def stages_text(p50s: dict[str, float | None] | None) -> str:
    return " / ".join(str(v) for v in (p50s or {}).values()) or "-"
