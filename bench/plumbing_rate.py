"""Plumbing at GPU-class rates: one `fleet up` carrying fault-engine tokens (issue 23).

The fault engine (`family: fault`) makes tokens for nothing, so every number here is Fleet's
own cost: what one node's worker, gateway, runner pipe and nats-server spend per token.

- http: 64 streams over `/v1/chat/completions` for `duration_s`, each a request of
  STREAM_TOKENS tokens, a new one as soon as one ends; tok/s and the CPU each process spent
  per token (psutil cpu_times deltas: `up` is the worker and the gateway, one process, or
  the worker alone beside `gateway` with `fleet up --processes split`);
- nats: the same 64 streams published to `fleet.tasks.<model>` and read on `fleet.out.*` by a
  raw nats-py client (no gateway): worker + runner + nats-server per token;
- c1: added latency per token at concurrency 1, paced at C1_RATE tokens a second: client
  receipt time minus the event's `at` (when the runner made its oldest token), over NATS;
- tasks: tasks/s with max_tokens 1 and 64 slots (TASKS published at once), and
  publish -> `task_accepted` p50 one task at a time (light load).

Token counts come from each task's usage; a token event may carry several tokens
(`token_ids`), so the raw client counts those.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.event_log import ms
from bench.fleet_stack import FleetStack
from bench.procs import cpu_seconds
from bench.workload import percentile
from fleet.bus.task_queue import TaskQueue
from fleet.models.catalog import custom_cards_dir
from fleet.runner.fault_engine import fault_card
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.tasks import ChatMessage, TextGeneration

MODEL = "fault-llm"
STREAMS = 64
SLOTS = 64
STREAM_TOKENS = 1500
C1_RATE = 200  # tokens a second: a fast model's single-stream decode
STREAM_TIMEOUT_S = 120.0
BATCH = 500  # tasks published before their acks are awaited
QUEUED_MAX = 1000  # FLEET_TASKS's max_msgs_per_subject (DiscardNew): more queued are refused


@dataclass(frozen=True)
class RatePlan:
    duration_s: float = 60.0
    stream_tokens: int = STREAM_TOKENS
    c1_tokens: int = 400
    accepted: int = 100
    tasks: int = 2000


QUICK = RatePlan(duration_s=3.0, stream_tokens=300, c1_tokens=100, accepted=20, tasks=200)


def _prompt(tokens: int, rate: int | None = None) -> str:
    return f"tokens:{tokens}" + (f" tokens_per_s:{rate}" if rate else "")


def _task(task_id: str, tokens: int, rate: int | None = None) -> TextGeneration:
    return TextGeneration(task_id=task_id, model=MODEL, max_tokens=tokens,
                          messages=[ChatMessage(role="user", content=_prompt(tokens, rate))])


def _per_token(before: dict[str, float], after: dict[str, float], tokens: int,
               wall: float) -> dict[str, Any]:
    us = {name: round(1e6 * (after[name] - before[name]) / max(tokens, 1), 2) for name in before}
    load = {name: round((after[name] - before[name]) / wall, 3) for name in before}
    return {"cpu_us_per_token": us, "cores": load}


class RawEvents:
    """One core subscription to `fleet.out.*`: tokens and ends by task, parsed with orjson
    only (a plain NATS client's cost, not pydantic's)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.accepted: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.latencies: list[float] | None = None
        self.token_events = 0  # events of type token (one carries one token or several)

    async def on_msg(self, msg: Msg) -> None:
        event = orjson.loads(msg.data)
        kind = event.get("type")
        if kind == "task_finished" and (last := event.get("last_tokens")):
            for token in last:  # the task's last token events, stored in its terminal
                self._token(token)
        if kind == "token":
            self._token(event)
        elif kind == "task_accepted":
            self.accepted.setdefault(event.get("task_id", ""), time.perf_counter())
        elif kind == "task_finished":
            waiter = self.waiters.get(event.get("task_id", ""))
            if waiter is not None and not waiter.done():
                waiter.set_result(event)

    def _token(self, event: dict[str, Any]) -> None:
        self.token_events += 1
        if self.latencies is not None:
            self.latencies.append(time.time() - event["at"])
        task_id = event.get("task_id", "")
        self.tokens[task_id] = self.tokens.get(task_id, 0) + len(event.get("token_ids") or (0,))

    def waiter(self, task_id: str) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters[task_id] = future
        return future


async def _nats_task(nc: Client, events: RawEvents, tokens: int, rate: int | None = None
                     ) -> int:
    task_id = f"rate-{secrets.token_hex(8)}"
    done = events.waiter(task_id)
    await nc.jetstream().publish(subjects.tasks(MODEL), encode(_task(task_id, tokens, rate)),
                                 headers={"Nats-Msg-Id": task_id})
    finished = await asyncio.wait_for(done, 600)
    events.waiters.pop(task_id, None)
    got = events.tokens.pop(task_id, 0)
    if finished.get("status") != "completed" or got != tokens:
        raise RuntimeError(f"task {task_id}: {finished.get('status')}, {got}/{tokens} tokens")
    return got


async def _http_stream(client: httpx.AsyncClient, base_url: str, tokens: int,
                       frames: list[int] | None = None) -> int:
    """One streamed chat of `tokens` tokens; `frames` (one counter) adds the SSE events it
    got: the gateway joins token events that wait together, so fewer than events made."""
    body = {"model": MODEL, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": _prompt(tokens)}]}
    tail = b""
    count = 0
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for piece in response.aiter_bytes():
            count += (tail[-1:] + piece).count(b"\n\n")  # an event ends with a blank line
            tail = (tail + piece)[-4096:]
    if frames is not None:
        frames[0] += count
    datas = [frame.rsplit(b"data: ", 1)[-1] for frame in tail.split(b"\n\n")]
    usages = [data for data in datas if data.startswith(b"{") and b'"usage":{' in data]
    got = int(orjson.loads(usages[-1])["usage"]["completion_tokens"]) if usages else 0
    if got != tokens or not tail.rstrip().endswith(b"[DONE]"):
        raise RuntimeError(f"an HTTP stream ended with {got}/{tokens} tokens")
    return got


async def _for_duration(duration_s: float, one: Any) -> tuple[int, float, list[str]]:
    """STREAMS loops of `one()` until the duration is up; (tokens, wall seconds, errors). A
    stream that fails or takes over STREAM_TIMEOUT_S is an error, counted, not a hang."""
    deadline = time.perf_counter() + duration_s
    totals = [0] * STREAMS
    errors: list[str] = []

    async def loop(slot: int) -> None:
        while time.perf_counter() < deadline:
            try:
                totals[slot] += await asyncio.wait_for(one(), STREAM_TIMEOUT_S)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    began = time.perf_counter()
    await asyncio.gather(*(loop(slot) for slot in range(STREAMS)))
    return sum(totals), time.perf_counter() - began, errors


async def measure_http(stack: FleetStack, procs: dict[str, psutil.Process], plan: RatePlan
                       ) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(_http_stream(client, stack.base_url, 20) for _ in range(8)))
        before = cpu_seconds(procs)
        frames = [0]
        tokens, wall, errors = await _for_duration(
            plan.duration_s,
            lambda: _http_stream(client, stack.base_url, plan.stream_tokens, frames))
        after = cpu_seconds(procs)
    return {"streams": STREAMS, "tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 1), **_per_token(before, after, tokens, wall),
            "sse_events_per_token": round(frames[0] / max(tokens, 1), 3),
            "load_1m": round(os.getloadavg()[0], 2),  # the machine's, over the run's last minute
            "errors": len(errors), "first_errors": errors[:3]}


async def measure_nats(nc: Client, events: RawEvents, procs: dict[str, psutil.Process],
                       plan: RatePlan) -> dict[str, Any]:
    await asyncio.gather(*(_nats_task(nc, events, 20) for _ in range(8)))
    before = cpu_seconds(procs)
    events_before = events.token_events
    tokens, wall, errors = await _for_duration(
        plan.duration_s, lambda: _nats_task(nc, events, plan.stream_tokens))
    after = cpu_seconds(procs)
    # CPU per token moves with how many tokens an event carries (the runner's coalescing
    # window fills more when it is starved of CPU): this says how many it did.
    made = events.token_events - events_before
    return {"streams": STREAMS, "tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 1), **_per_token(before, after, tokens, wall),
            "tokens_per_event": round(tokens / max(made, 1), 2),
            "load_1m": round(os.getloadavg()[0], 2),
            "errors": len(errors), "first_errors": errors[:3]}


async def measure_c1(nc: Client, events: RawEvents, plan: RatePlan) -> dict[str, Any]:
    events.latencies = []
    await asyncio.wait_for(_nats_task(nc, events, plan.c1_tokens, C1_RATE), STREAM_TIMEOUT_S)
    latencies, events.latencies = events.latencies, None
    return {"rate_tok_s": C1_RATE, "tokens": plan.c1_tokens, "events": len(latencies),
            "p50_ms": ms(percentile(latencies, 50)), "p99_ms": ms(percentile(latencies, 99))}


async def room_for(queue: TaskQueue, count: int, timeout: float) -> None:
    """Returns once `count` more tasks fit under the subject's cap. Read from the stream: a
    task's terminal event comes before its worker's ack removes it (the quiet run of
    2026-12-05 04:36 waited for terminals, published into a full subject, and the refused
    publishes never resolved)."""
    async with asyncio.timeout(timeout):
        while await queue.stored_on(subjects.tasks(MODEL)) > QUEUED_MAX - count:
            await asyncio.sleep(0.01)


async def measure_tasks(nc: Client, events: RawEvents, plan: RatePlan) -> dict[str, Any]:
    js = nc.jetstream()
    latencies = []
    for _ in range(plan.accepted):
        task_id = f"acc-{secrets.token_hex(8)}"
        done = events.waiter(task_id)
        began = time.perf_counter()
        await js.publish(subjects.tasks(MODEL), encode(_task(task_id, 1)),
                         headers={"Nats-Msg-Id": task_id})
        await asyncio.wait_for(done, STREAM_TIMEOUT_S)
        latencies.append(events.accepted[task_id] - began)
    ids = [f"many-{secrets.token_hex(8)}" for _ in range(plan.tasks)]
    waiters = [events.waiter(task_id) for task_id in ids]
    began = time.perf_counter()
    for start in range(0, len(ids), BATCH):
        if start >= QUEUED_MAX:  # FLEET_TASKS holds at most 1,000 of a model: wait for room
            await room_for(TaskQueue(nc), BATCH, STREAM_TIMEOUT_S)
        acks = [await js.publish_async(subjects.tasks(MODEL), encode(_task(task_id, 1)),
                                       headers={"Nats-Msg-Id": task_id})
                for task_id in ids[start:start + BATCH]]
        # Bounded: nats-py 2.16 never resolves the future of a publish the stream refuses
        # (its reply handler raises the 503 instead), so a refusal would hang here.
        await asyncio.wait_for(asyncio.gather(*acks), STREAM_TIMEOUT_S)
    ended = await asyncio.wait_for(asyncio.gather(*waiters), 5 * STREAM_TIMEOUT_S)
    wall = time.perf_counter() - began
    bad = [e for e in ended if e.get("status") != "completed"]
    return {"publish_to_accepted_p50_ms": ms(percentile(latencies, 50)),
            "publish_to_accepted_p99_ms": ms(percentile(latencies, 99)),
            "tasks": plan.tasks, "tasks_per_s": round(plan.tasks / wall, 1),
            "not_completed": len(bad)}


def seed_fault_card(data_dir: Path) -> None:
    folder = custom_cards_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    card = fault_card(MODEL).model_copy(update={"source": str(data_dir)})
    (folder / f"{MODEL}.json").write_bytes(encode(card))


async def run_rate(workdir: Path, env: dict[str, str], plan: RatePlan) -> dict[str, Any]:
    data_dir = workdir / "fleet-data"
    seed_fault_card(data_dir)
    stack = FleetStack(data_dir, [MODEL], SLOTS, env)
    nc = await stack.start()
    try:
        found = stack.processes()
        procs = {"up": found["up"], "runner": found[f"runner:{MODEL}"], "nats": found["nats"],
                 "client": psutil.Process()}
        if "gateway" in found:  # split: the worker in `up`, the gateway in a child
            procs["gateway"] = found["gateway"]
        out: dict[str, Any] = {"plan": plan.__dict__, "up_processes": _up_processes(env),
                               "load_average": [round(x, 2) for x in os.getloadavg()]}
        out["http"] = await measure_http(stack, procs, plan)
        # Only now: a reader of every task's events would be a second client to feed (and,
        # at these rates, a slow consumer the server drops messages for) during the HTTP run.
        events = RawEvents()
        await nc.subscribe("fleet.out.*", cb=events.on_msg, pending_msgs_limit=1_000_000)
        out["nats"] = await measure_nats(nc, events, procs, plan)
        for name, measure in (("c1", measure_c1), ("tasks", measure_tasks)):
            try:
                out[name] = await measure(nc, events, plan)
            except TimeoutError:
                out[name] = {"error": f"timed out (stack stalled?); see {data_dir}"}
        return out
    finally:
        await stack.stop()


def _up_processes(env: dict[str, str]) -> str:
    """The mode `fleet up` ran in (FLEET_UP_PROCESSES; its default when unset)."""
    from fleet.config import default_of

    return env.get("FLEET_UP_PROCESSES") or str(default_of("up_processes"))


def rate_table(rate: dict[str, Any]) -> list[str]:
    lines = [f"plumbing at rate (fault engine, one fleet up, processes "
             f"{rate.get('up_processes')}, load average {rate.get('load_average')}):"]
    for path in ("http", "nats"):
        row = rate[path]
        cpu = ", ".join(f"{k} {v}" for k, v in row["cpu_us_per_token"].items())
        lines.append(f"  {path:5} {row['tok_s']:>10,.0f} tok/s  ({row['tokens']} tokens, "
                     f"{row['wall_s']} s, {row['errors']} failed)  CPU us/token: {cpu}"
                     + (f"; SSE events/token {row['sse_events_per_token']}"
                        if "sse_events_per_token" in row else "")
                     + (f"; tokens/event {row['tokens_per_event']}"
                        if "tokens_per_event" in row else ""))
    c1, tasks = rate["c1"], rate["tasks"]
    lines.append(f"  c=1 added latency per token: p50 {c1.get('p50_ms')} ms, "
                 f"p99 {c1.get('p99_ms')} ms {c1.get('error', '')}")
    lines.append(f"  tasks/s (max_tokens 1, {SLOTS} slots): {tasks.get('tasks_per_s')}; "
                 f"publish -> task_accepted p50 {tasks.get('publish_to_accepted_p50_ms')} ms "
                 f"{tasks.get('error', '')}")
    return lines
