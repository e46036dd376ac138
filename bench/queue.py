"""`fleet bench --only queue` (issue 25): the queue as a product, on one `fleet up` serving the
fault engine.

- accept: a 50,000-request batch job (chat completions) through the gateway: seconds from the
  first byte of the upload to the job's answer (accepted), and to `in_progress` (its file
  validated), then the lines it finishes in `run_s` seconds; the job is then cancelled.
- mixed: a chat every 2 s (streamed: time to first token, `Fleet-Priority: interactive`) on
  an idle fleet, then beside a 5,000-line batch job whose lines each hold a slot for ~1 s.
- fair: tenant A keeps 10x tenant B's requests going (bench/queue_fair.py): B's share of the
  tokens served against its weight share, and B's TTFT beside A against alone.
- retries: 1,000 chat POSTs, each sent twice with the same Idempotency-Key (the second one to
  a replay of the first): how many tasks the fleet ran (workers' task_accepted events) and how
  many distinct task ids the answers named.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.fleet_stack import FleetStack
from bench.plumbing_rate import MODEL, seed_fault_card
from bench.queue_fair import (
    QUICK_FAIR,
    STAGES,
    FairPlan,
    Served,
    Stages,
    cells_of,
    fair_rows,
    fair_summary,
    measure_fair,
    stage_p50s_ms,
    stages_text,
    summary_rows,
    write_keys,
)
from fleet.gateway.keys import add_key
from fleet.wire.codec import decode_event
from fleet.wire.events import TaskAccepted

SLOTS = 16


@dataclass(frozen=True)
class QueuePlan:
    lines: int = 50_000
    run_s: float = 20.0
    retried: int = 1_000
    concurrency: int = 32
    interactive: int = 15  # chats, one every `every_s`, on an idle fleet and beside a job
    every_s: float = 2.0
    mixed_lines: int = 5_000
    fair: FairPlan = field(default_factory=FairPlan)


QUICK = QueuePlan(lines=2_000, run_s=3.0, retried=100, concurrency=16, interactive=4,
                  every_s=0.5, mixed_lines=200, fair=QUICK_FAIR)
# A batch line takes a slot for a second (50 tokens at 50 tok/s); a chat is 5 quick tokens.
BATCH_PROMPT = "tokens:50 tokens_per_s:50"
CHAT_PROMPT = "tokens:5"


def batch_file(lines: int, prompt: str = "tokens:2", max_tokens: int = 4) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"{prompt} line {i}"}]},
    }).encode() + b"\n" for i in range(lines))


async def _ttft(client: httpx.AsyncClient, base: str) -> Served:
    body = {"model": MODEL, "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": CHAT_PROMPT}]}
    began = time.perf_counter()
    async with client.stream("POST", f"{base}/chat/completions", json=body,
                             headers={"Fleet-Priority": "interactive"}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if '"content":"' in line:
                first = time.perf_counter()
                return Served(began, first, first, 0,
                              response.headers.get("x-fleet-task-id", ""))
    raise RuntimeError("a chat stream ended without content")


async def _interactive(client: httpx.AsyncClient, base: str, plan: QueuePlan) -> list[Served]:
    chats = []
    for _ in range(plan.interactive):
        started = time.perf_counter()
        chats.append(await _ttft(client, base))
        await asyncio.sleep(max(0.0, plan.every_s - (time.perf_counter() - started)))
    return chats


def _p50(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def measure_mixed(base: str, key: str, plan: QueuePlan,
                        nc: Client | None = None) -> dict[str, Any]:
    """(1) Interactive TTFT on an idle fleet, then beside a running batch job; the job's
    lines done meanwhile (each takes a slot for ~1 s). With `nc`, the chats' TTFT split into
    stages (bench.queue_fair.Stages)."""
    stages = Stages()
    if nc is not None:
        await stages.start(nc)
    try:
        return await _measure_mixed(base, key, plan, stages)
    finally:
        await stages.stop()


async def _measure_mixed(base: str, key: str, plan: QueuePlan,
                         stages: Stages) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=120, headers=_auth(key)) as client:
        idle = await _interactive(client, base, plan)
        data = batch_file(plan.mixed_lines, BATCH_PROMPT, max_tokens=64)
        upload = (await client.post(f"{base}/files", data={"purpose": "batch"},
                                    files={"file": ("mixed.jsonl", data)})).raise_for_status()
        batch_id = (await client.post(f"{base}/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})).raise_for_status().json()["id"]
        while (await _status(client, base, batch_id))["request_counts"]["completed"] == 0:
            await asyncio.sleep(0.1)  # the job runs: its lines hold the slots now
        # The job alone for as long as the chats will take: its own rate is the slack the
        # issue's 90 % is read against (a line's own dispatch and ending count in both).
        alone_s = plan.interactive * plan.every_s
        first = (await _status(client, base, batch_id))["request_counts"]["completed"]
        began_alone = time.perf_counter()
        await asyncio.sleep(alone_s)  # a measurement window, not a synchronisation
        before = (await _status(client, base, batch_id))["request_counts"]["completed"]
        began = time.perf_counter()
        alone_rate = (before - first) / (began - began_alone)
        busy = await _interactive(client, base, plan)
        wall = time.perf_counter() - began
        after = (await _status(client, base, batch_id))["request_counts"]["completed"]
        (await client.post(f"{base}/batches/{batch_id}/cancel")).raise_for_status()
    idle_ttft = [chat.first - chat.sent for chat in idle if chat.first is not None]
    busy_ttft = [chat.first - chat.sent for chat in busy if chat.first is not None]
    return {"interactive": plan.interactive, "every_s": plan.every_s,
            "ttft_idle_p50_ms": _p50(idle_ttft), "ttft_beside_batch_p50_ms": _p50(busy_ttft),
            "ratio": round(statistics.median(busy_ttft) / statistics.median(idle_ttft), 2),
            "stages_idle_p50_ms": stage_p50s_ms(idle, stages, 0.0, float("inf")),
            "stages_beside_batch_p50_ms": stage_p50s_ms(busy, stages, 0.0, float("inf")),
            "batch_lines_per_s_meanwhile": round((after - before) / wall, 1),
            "batch_lines_per_s_alone": round(alone_rate, 1),
            "slack_used": round((after - before) / wall / alone_rate, 3) if alone_rate else None,
            "batch_slots": SLOTS}


async def _status(client: httpx.AsyncClient, base: str, batch_id: str) -> dict[str, Any]:
    return (await client.get(f"{base}/batches/{batch_id}")).raise_for_status().json()


async def measure_accept(base: str, key: str, plan: QueuePlan) -> dict[str, Any]:
    data = batch_file(plan.lines)
    async with httpx.AsyncClient(timeout=120, headers=_auth(key)) as client:
        began = time.perf_counter()
        upload = (await client.post(f"{base}/files", data={"purpose": "batch"},
                                    files={"file": ("big.jsonl", data)})).raise_for_status()
        created = (await client.post(f"{base}/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})).raise_for_status().json()
        accepted_s = time.perf_counter() - began
        batch_id = created["id"]
        status = created
        while status["status"] == "validating":
            await asyncio.sleep(0.05)  # the API has no push: poll the record
            status = await _status(client, base, batch_id)
        validated_s = time.perf_counter() - began
        await asyncio.sleep(plan.run_s)
        running = await _status(client, base, batch_id)
        (await client.post(f"{base}/batches/{batch_id}/cancel")).raise_for_status()
    done = running["request_counts"]["completed"] + running["request_counts"]["failed"]
    return {
        "lines": plan.lines, "file_mb": round(len(data) / 1e6, 1),
        "accepted_s": round(accepted_s, 2), "in_progress_s": round(validated_s, 2),
        "status_after_validation": status["status"],
        "lines_done_in_run": done, "run_s": plan.run_s,
        "lines_per_s": round(done / plan.run_s, 1),
    }


async def measure_retries(base: str, key: str, stack: FleetStack,
                          plan: QueuePlan) -> dict[str, Any]:
    assert stack.nc is not None
    accepted: set[str] = set()
    accepted_events = 0

    async def on_event(msg: Msg) -> None:
        nonlocal accepted_events
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted) and event.task_id.startswith("chatcmpl-"):
            accepted_events += 1
            accepted.add(event.task_id)

    sub = await stack.nc.subscribe("fleet.out.*", cb=on_event)
    gate = asyncio.Semaphore(plan.concurrency)
    ids: list[str] = []
    replays = 0
    run = f"{time.time_ns()}"

    async def twice(client: httpx.AsyncClient, index: int) -> None:
        nonlocal replays
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"tokens:2 retry {index}"}]}
        headers = {"Idempotency-Key": f"bench-{run}-{index}"}
        async with gate:
            for _ in range(2):  # the retry a client sends after a timeout
                answer = (await client.post(f"{base}/chat/completions", json=body,
                                            headers=headers)).raise_for_status()
                ids.append(answer.headers["x-fleet-task-id"])
                replays += answer.headers.get("x-fleet-idempotent-replay") == "true"

    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, headers=_auth(key)) as client:
        await asyncio.gather(*(twice(client, i) for i in range(plan.retried)))
    wall = time.perf_counter() - began
    await stack.nc.flush()
    await sub.unsubscribe()
    return {"posts": 2 * plan.retried, "keys": plan.retried, "distinct_task_ids": len(set(ids)),
            "tasks_run": len(accepted), "task_accepted_events": accepted_events,
            "replayed_answers": replays, "wall_s": round(wall, 2)}


CELLS = ("fair", "mixed", "retries", "accept")  # the measures, in the order they run


async def run_queue(workdir: Path, env: dict[str, str], quick: bool,
                    cells: tuple[str, ...] = CELLS, rounds: int | None = None,
                    weights: tuple[tuple[float, float], ...] | None = None) -> dict[str, Any]:
    """The chosen measures (`cells`) on one `fleet up`; (2) ("fair") `rounds` times a weight
    pair (`weights`, A:B), the pairs interleaved."""
    plan = QUICK if quick else QueuePlan()
    fair_plan = replace(plan.fair, rounds=rounds or plan.fair.rounds,
                        weights=weights or plan.fair.weights)
    plan = replace(plan, fair=fair_plan)
    data_dir = workdir / "queue"
    data_dir.mkdir(parents=True, exist_ok=True)
    seed_fault_card(data_dir)
    # Tenants, so (2) has two: the other measures send as one tenant of their own, whose
    # requests pass the fair-share admission (three KV writes each) with no one to wait for.
    keys_file = data_dir / "keys.jsonl"
    keys_file.unlink(missing_ok=True)
    key = add_key(keys_file, "bench")
    fair_keys = write_keys(keys_file, plan.fair)
    stack = FleetStack(data_dir, [MODEL], SLOTS, {**env, "FLEET_API_KEYS_FILE": str(keys_file)},
                       api_key=key)
    await stack.start()
    try:
        base = stack.base_url
        # (2) first, on the idle fleet: its drain ends with nothing left running.
        result: dict[str, Any] = {"plan": asdict(plan), "cells": list(cells),
                                  "load_average": [round(x, 2) for x in os.getloadavg()]}
        if "fair" in cells:
            result["fair"] = [await measure_fair(base, fair_keys, run, SLOTS, plan.fair,
                                                 stack.nc)
                              for run in range(len(cells_of(plan.fair)))]
            result["fair_summary"] = fair_summary(result["fair"])
            result["load_average_after_fair"] = [round(x, 2) for x in os.getloadavg()]
        if "mixed" in cells:
            result["mixed"] = await measure_mixed(base, key, plan, stack.nc)
        if "retries" in cells:
            result["retries"] = await measure_retries(base, key, stack, plan)
        if "accept" in cells:
            result["accept"] = await measure_accept(base, key, plan)
        return result
    finally:
        await stack.stop()


def queue_table(result: dict[str, Any]) -> list[str]:
    rows = [f"queue (fault engine, one fleet up; load average {result.get('load_average')}):"]
    if (mixed := result.get("mixed")) is not None:
        rows.append(
            f"  interactive TTFT p50 {mixed['ttft_idle_p50_ms']} ms idle, "
            f"{mixed['ttft_beside_batch_p50_ms']} ms beside a batch job (x{mixed['ratio']}); "
            f"the job meanwhile {mixed['batch_lines_per_s_meanwhile']} lines/s, alone "
            f"{mixed.get('batch_lines_per_s_alone')} (slack used {mixed.get('slack_used')}; "
            f"~1 s each, {mixed['batch_slots']} slots); the chats' stages p50 ({STAGES}) idle "
            f"{stages_text(mixed.get('stages_idle_p50_ms'))}, beside the job "
            f"{stages_text(mixed.get('stages_beside_batch_p50_ms'))}")
    if (accept := result.get("accept")) is not None:
        rows.append(
            f"  batch of {accept['lines']:,} lines ({accept['file_mb']} MB): accepted in "
            f"{accept['accepted_s']} s, in_progress after {accept['in_progress_s']} s, "
            f"{accept['lines_done_in_run']:,} lines done in {accept['run_s']} s "
            f"({accept['lines_per_s']} lines/s)")
    if (retries := result.get("retries")) is not None:
        rows.append(
            f"  {retries['posts']:,} POSTs ({retries['keys']:,} keys, each sent twice): "
            f"{retries['tasks_run']:,} tasks run, {retries['distinct_task_ids']:,} distinct "
            f"ids, {retries['replayed_answers']:,} replayed answers, {retries['wall_s']} s")
    rows += fair_rows(result.get("fair", []))
    rows += summary_rows(result.get("fair_summary", {}))
    return rows
