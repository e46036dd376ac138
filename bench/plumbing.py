"""Plumbing: what Fleet's own moving parts cost, on the smallest real model (`tiny-llm`).

- accepted: publish -> `task_accepted` latency, one task at a time, and tasks/s for a batch
  published at once (max_tokens 1, so the model's work stays small);
- output: the same 8-stream burst through the limit, Fleet over NATS and Fleet over HTTP, with
  the CPU time of every process divided by the tokens, and each token's delivery latency from
  its creation in the runner (TokenChunk.at) to the NATS client;
- dispatch: with a runner of one slot, the gap from one task's end to the next task's start
  (both stamped by the runner) with 10 and with 10,000 tasks in FLEET_TASKS;
- fresh worker: a new `fleet worker` process for a tiny-flux2 edit task whose 10 MB input
  image is only in the object store: node registered, runner ready, task accepted;
- object store: bench/objects.py (stock nats-py against Fleet's reader and writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from nats.aio.client import Client

from bench import objects
from bench.event_log import EventLog, ms
from bench.fleet_stack import FleetStack, NatsPath, seed_data_dir, text_task, wait_runner_ready
from bench.fresh_worker import measure_fresh_worker
from bench.http_path import OpenAIStreamPath
from bench.limit import LimitPath
from bench.procs import cpu_seconds
from bench.workload import Request, make_request, percentile
from fleet.models.catalog import get_card
from fleet.models.store import ensure_model
from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.codec import encode

log = logging.getLogger("bench.plumbing")

MODEL = "tiny-llm"
SERIAL = "tiny-llm-serial"  # the same weights, placed with SERIAL_SLOTS slots
# One slot: each dispatch follows exactly one task's end. (Gaps are paired per slot, so any
# number works; the run recorded in bench/README.md used 2, when a 1-slot text runner still
# failed its warm-up.)
SERIAL_SLOTS = 1
PER_SUBJECT_CAP = 1000  # FLEET_TASKS max_msgs_per_subject (ops/jetstream/FLEET_TASKS.json)
FILLER = "bench-filler"
FILLER_MODELS = 10_000 // PER_SUBJECT_CAP - 1


@dataclass(frozen=True)
class Counts:
    accepted: int
    throughput: int
    output_tokens: int
    dispatch_rounds: int
    deep_gaps: int


FULL = Counts(accepted=200, throughput=500, output_tokens=256, dispatch_rounds=5, deep_gaps=200)
QUICK = Counts(accepted=20, throughput=50, output_tokens=64, dispatch_rounds=1, deep_gaps=30)


def _tiny_task(model: str, eos: list[int], task_id: str | None = None) -> tuple[str, bytes]:
    task_id = task_id or f"plumb-{secrets.token_hex(8)}"
    request = Request([{"role": "user", "content": "Hi"}], 1, {t: -100.0 for t in eos})
    return task_id, encode(text_task(task_id, model, request))


async def _publish_many(nc: Client, subject: str, bodies: list[tuple[str, bytes]]) -> None:
    js = nc.jetstream()
    for start in range(0, len(bodies), 500):
        futures = [await js.publish_async(subject, body, headers={"Nats-Msg-Id": task_id})
                   for task_id, body in bodies[start:start + 500]]
        await asyncio.gather(*futures)


async def measure_accepted(nc: Client, log_: EventLog, eos: list[int], counts: Counts
                           ) -> dict[str, Any]:
    js = nc.jetstream()
    latencies, acks = [], []
    for _ in range(counts.accepted):
        task_id, body = _tiny_task(MODEL, eos)
        began = time.perf_counter()
        await js.publish(subjects.tasks(MODEL), body, headers={"Nats-Msg-Id": task_id})
        acks.append(time.perf_counter() - began)
        await log_.all_finished([task_id], 60)
        latencies.append(log_.accepted[task_id][0] - began)
    bodies = [_tiny_task(MODEL, eos) for _ in range(counts.throughput)]
    began = time.perf_counter()
    await _publish_many(nc, subjects.tasks(MODEL), bodies)
    published = time.perf_counter() - began
    await log_.all_finished([task_id for task_id, _ in bodies], 300)
    last = max(log_.finished[task_id][0] for task_id, _ in bodies)
    return {
        "publish_ack_p50_ms": ms(percentile(acks, 50)),
        "publish_to_accepted_p50_ms": ms(percentile(latencies, 50)),
        "publish_to_accepted_p99_ms": ms(percentile(latencies, 99)),
        "tasks": counts.throughput,
        "publish_all_s": round(published, 3),
        "tasks_per_s": round(counts.throughput / (last - began), 1),
    }


async def measure_output(
    stack: FleetStack, limit: LimitPath, nc: Client, eos: list[int], counts: Counts
) -> dict[str, Any]:
    """Tokens of an 8-stream burst on each path, and the CPU every process spent on them."""
    assert limit.process is not None
    me = psutil.Process()
    fleet_procs = {k: v for k, v in stack.processes().items() if k in ("up", "nats")}
    fleet_procs["runner"] = stack.processes()[f"runner:{MODEL}"]
    gateway = OpenAIStreamPath("fleet_http", stack.base_url, MODEL)
    nats_path = NatsPath(nc, MODEL)
    nats_path.latencies = []
    paths: list[tuple[Any, dict[str, psutil.Process]]] = [
        (limit, {"limit": psutil.Process(limit.process.pid), "client": me}),
        (nats_path, {**fleet_procs, "client": me}),
        (gateway, {**fleet_procs, "client": me}),
    ]
    out: dict[str, Any] = {}
    try:
        for path, procs in paths:
            requests = [make_request("unique", counts.output_tokens, eos) for _ in range(8)]
            await path.burst(requests[:2])  # warm
            before, began = cpu_seconds(procs), time.perf_counter()
            results = await path.burst(requests)
            wall = time.perf_counter() - began
            after = cpu_seconds(procs)
            tokens = sum(r.tokens for r in results)
            out[path.name] = {
                "tokens": tokens,
                "tok_s": round(tokens / wall, 1),
                "cpu_us_per_token": {name: round(1e6 * (after[name] - before[name]) / tokens, 1)
                                     for name in procs},
            }
    finally:
        await gateway.close()
    lat = nats_path.latencies
    out["fleet_nats"]["delivery_p50_ms"] = ms(percentile(lat, 50))
    out["fleet_nats"]["delivery_p99_ms"] = ms(percentile(lat, 99))
    return out


async def measure_dispatch(nc: Client, log_: EventLog, eos: list[int], counts: Counts
                           ) -> dict[str, Any]:
    """Gap from a slot coming free to the next task's start, by queue depth."""
    shallow: list[float] = []
    for _ in range(counts.dispatch_rounds):
        bodies = [_tiny_task(SERIAL, eos) for _ in range(10)]
        await _publish_many(nc, subjects.tasks(SERIAL), bodies)
        await log_.all_finished([task_id for task_id, _ in bodies], 120)
        shallow += _gaps(log_, [task_id for task_id, _ in bodies])
    js = nc.jetstream()
    for k in range(FILLER_MODELS):
        model = f"{FILLER}-{k}"
        await _publish_many(nc, subjects.tasks(model),
                            [_tiny_task(model, eos) for _ in range(PER_SUBJECT_CAP)])
    bodies = [_tiny_task(SERIAL, eos) for _ in range(PER_SUBJECT_CAP)]
    await _publish_many(nc, subjects.tasks(SERIAL), bodies)
    depth = (await js.stream_info(subjects.TASKS_STREAM)).state.messages
    # Only tasks that start once all 10,000 are in the stream count.
    counted = [t for t in (task_id for task_id, _ in bodies) if t not in log_.accepted]
    async with asyncio.timeout(300):
        while sum(1 for t in counted if t in log_.finished) <= counts.deep_gaps:
            await asyncio.sleep(0.05)  # polling our own event log, bounded by the timeout
    await js.purge_stream(subjects.TASKS_STREAM, subject="fleet.tasks.>")
    deep = _gaps(log_, [t for t in counted if t in log_.finished])
    return {
        "runner_slots": SERIAL_SLOTS,
        "queued_10": {"gaps": len(shallow), "p50_ms": ms(percentile(shallow, 50)),
                      "p99_ms": ms(percentile(shallow, 99))},
        "queued_10000": {"stream_depth": depth, "model_depth_cap": PER_SUBJECT_CAP,
                         "gaps": len(deep), "p50_ms": ms(percentile(deep, 50)),
                         "p99_ms": ms(percentile(deep, 99))},
    }


def _gaps(log_: EventLog, task_ids: list[str]) -> list[float]:
    """Runner-stamped gaps from a slot coming free (a task finished) to the next task's start:
    each start is paired with the earliest unpaired finish before it, so it works for any
    number of slots; the first starts of a round, into slots that were free, pair with none."""
    starts = sorted(log_.accepted[t][1] for t in task_ids if t in log_.accepted)
    ends = sorted(log_.finished[t][1] for t in task_ids if t in log_.finished)
    gaps, next_end = [], 0
    for start in starts:
        if next_end < len(ends) and ends[next_end] <= start:
            gaps.append(start - ends[next_end])
            next_end += 1
    return gaps


async def run_plumbing(
    models_dir: Path, workdir: Path, env: dict[str, str], quick: bool,
    with_fresh_worker: bool = True, with_objects: bool = True,
) -> dict[str, Any]:
    counts = QUICK if quick else FULL
    tiny = ensure_model(get_card(MODEL), models_dir)
    data_dir = workdir / "fleet-data"
    # Fillers: models with a card (so no janitor fails their tasks) that nobody serves.
    fillers = {f"{FILLER}-{k}": tiny for k in range(FILLER_MODELS)}
    seed_data_dir(data_dir, {MODEL: tiny}, {SERIAL: tiny, **fillers})
    stack = FleetStack(data_dir, [MODEL], 16, env)
    limit = LimitPath(tiny, env, workdir / "limit.log")
    out: dict[str, Any] = {}
    try:
        ready, nc = await asyncio.gather(limit.start(), stack.start())
        eos = ready["eos_ids"]
        node = (data_dir / "node_id").read_text().strip()
        await place(nc.jetstream(), get_card(SERIAL, data_dir), node_id=node,
                    slots=SERIAL_SLOTS)
        await wait_runner_ready(nc, SERIAL, time.monotonic() + 120, alive=stack.check_alive)
        events = EventLog()
        await nc.subscribe("fleet.out.*", cb=events.on_event)
        log.info("plumbing: accepted latency and tasks/s")
        out["accepted"] = await measure_accepted(nc, events, eos, counts)
        log.info("plumbing: output path")
        out["output"] = await measure_output(stack, limit, nc, eos, counts)
        log.info("plumbing: dispatch latency by queue depth")
        out["dispatch"] = await measure_dispatch(nc, events, eos, counts)
        if with_fresh_worker:
            log.info("plumbing: fresh worker with a 10 MB input image")
            out["fresh_worker"] = await measure_fresh_worker(
                stack, nc, models_dir, workdir, env
            )
    finally:
        await asyncio.gather(stack.stop(), limit.stop())
    if with_objects:
        log.info("plumbing: object store")
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its own table
            store = await asyncio.to_thread(objects.run, quick)
        out["object_store_mb_s"] = store["results"]
    return out

