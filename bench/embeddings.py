"""`fleet bench --only embeddings`: POST /v1/embeddings through `fleet up` against the same
model in-process.

Fleet: 1, 16 and 256 concurrent clients, each sending one-text requests back to back; the
requests a second and the latency percentiles of each level, and how many forward passes the
runner made for them (the `forward_pass` stamps on the `embedding` events, heard on
`fleet.out.>`). In-process: the same engine class the runner uses (fleet.runner.embed), one
text per forward pass, and every text of a level in passes as wide as the runner's.
Every text is distinct, so the runner's de-duplication of repeated texts saves nothing.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from nats.aio.msg import Msg

from bench.fleet_stack import FleetStack, seed_data_dir
from fleet.models.catalog import get_card
from fleet.models.store import ensure_model

LEVELS = (1, 16, 256)
QUICK_LEVELS = (1, 16)
SUBJECT_ALL_OUTPUT = "fleet.out.>"


def texts(count: int, tag: str) -> list[str]:
    """Distinct short texts, ~12-16 tokens each."""
    return [f"{tag} request {i}: the quick brown fox jumps over the lazy dog near {i % 97}"
            for i in range(count)]


def requests_at(level: int, quick: bool) -> int:
    """Requests sent at a concurrency level: enough for a p50, few enough for two cores."""
    if quick:
        return max(8, level * 2)
    return max(64, level * 2)


async def fleet_level(
    http: httpx.AsyncClient, model: str, level: int, total: int, passes: dict[str, int]
) -> dict[str, Any]:
    """`level` clients share `total` one-text requests; each sends its next when its last
    is answered."""
    queue = list(texts(total, f"c{level}"))
    latencies: list[float] = []
    task_ids: list[str] = []
    errors: list[str] = []

    async def client() -> None:
        while queue:
            text = queue.pop()
            began = time.perf_counter()
            response = await http.post("/embeddings", json={"model": model, "input": text})
            latencies.append(time.perf_counter() - began)
            if response.status_code != 200:
                errors.append(f"{response.status_code} {response.text[:200]}")
            else:
                task_ids.append(response.headers["x-fleet-task-id"])

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(level)))
    wall = time.perf_counter() - began
    heard = {passes[t] for t in task_ids if t in passes}
    return {
        "clients": level, "requests": total, "errors": len(errors), "first_errors": errors[:2],
        "requests_per_s": round(total / wall, 2),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p95_ms": round(sorted(latencies)[int(0.95 * (len(latencies) - 1))] * 1000, 1),
        "forward_passes": len(heard),
    }


async def run_fleet(model: str, path: Path, workdir: Path, env: dict[str, str],
                    levels: tuple[int, ...], quick: bool) -> dict[str, Any]:
    data_dir = workdir / "data"
    seed_data_dir(data_dir, {model: path}, {})
    stack = FleetStack(data_dir, [model], max(levels), env)
    nc = await stack.start()
    passes: dict[str, int] = {}

    async def heard(msg: Msg) -> None:
        event = orjson.loads(msg.data)
        if event.get("type") == "embedding":
            passes[event["task_id"]] = event["forward_pass"]

    subscription = await nc.subscribe(SUBJECT_ALL_OUTPUT, cb=heard)
    rows = []
    try:
        limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
        async with httpx.AsyncClient(base_url=stack.base_url, limits=limits,
                                     timeout=600) as http:
            await fleet_level(http, model, 1, 4, passes)  # warm: the first requests' costs
            for level in levels:
                rows.append(await fleet_level(http, model, level, requests_at(level, quick),
                                              passes))
    finally:
        await subscription.unsubscribe()
        await stack.stop()
    return {"startup_s": round(stack.startup_s or 0.0, 1), "levels": rows}


def run_in_process(model: str, path: Path, levels: tuple[int, ...], quick: bool,
                   blas_threads: int) -> dict[str, Any]:
    """The runner's engine in this process: one text a pass, and a level's texts batched."""
    os.environ["OPENBLAS_NUM_THREADS"] = str(blas_threads)  # as the runner has it
    from fleet.models.blas import enable_openblas

    enable_openblas()
    from fleet.runner.embed import BATCH_ROWS, EmbeddingEngine
    from fleet.runner.engine import EngineConfig

    engine = EmbeddingEngine(EngineConfig(card=get_card(model), model_path=path, slots=1,
                                          images_dir=path))
    engine.load(lambda done, total: None)
    engine.warm_up()
    tokenize = engine.tokenize
    single = [tokenize(text) for text in texts(16 if quick else 32, "solo")]
    each = []
    for row in single:
        began = time.perf_counter()
        engine.forward([row])
        each.append(time.perf_counter() - began)
    one_s = statistics.median(each)  # the machine is shared: the median, not the mean
    batched = []
    for level in (level for level in levels if level > 1):
        rows = [tokenize(text) for text in texts(requests_at(level, quick), f"b{level}")]
        width = min(level, BATCH_ROWS)
        began = time.perf_counter()
        for start in range(0, len(rows), width):
            engine.forward(rows[start:start + width])
        took = time.perf_counter() - began
        batched.append({"batch": width, "texts": len(rows),
                        "texts_per_s": round(len(rows) / took, 2),
                        "pass_ms": round(took / -(-len(rows) // width) * 1000, 1)})
    return {"one_at_a_time": {"texts_per_s": round(1 / one_s, 2),
                              "latency_ms": round(one_s * 1000, 1)},
            "batched": batched}


async def run_embeddings(models_dir: Path, workdir: Path, env: dict[str, str], quick: bool,
                         models: list[str], blas_threads: int) -> dict[str, Any]:
    levels = QUICK_LEVELS if quick else LEVELS
    result: dict[str, Any] = {}
    for model in models:
        path = ensure_model(get_card(model), models_dir)
        result[model] = {
            "fleet": await run_fleet(model, path, workdir / model, env, levels, quick),
            "in_process": await asyncio.to_thread(run_in_process, model, path, levels, quick,
                                                  blas_threads),
        }
    return result


def embeddings_table(result: dict[str, Any]) -> list[str]:
    lines = ["", "embeddings: one text a request, distinct texts"]
    for model, parts in result.items():
        lines.append(f"  {model}")
        lines.append(f"    {'clients':>8} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} "
                     f"{'passes':>7} {'requests':>8}")
        for row in parts["fleet"]["levels"]:
            lines.append(f"    {row['clients']:>8} {row['requests_per_s']:>8} "
                         f"{row['p50_ms']:>8} {row['p95_ms']:>8} {row['forward_passes']:>7} "
                         f"{row['requests']:>8}" + (f"  errors {row['errors']}"
                                                    if row["errors"] else ""))
        alone = parts["in_process"]["one_at_a_time"]
        lines.append(f"    in-process, one text a pass: {alone['texts_per_s']} texts/s, "
                     f"{alone['latency_ms']} ms a text")
        for row in parts["in_process"]["batched"]:
            lines.append(f"    in-process, {row['batch']} texts a pass: "
                         f"{row['texts_per_s']} texts/s, {row['pass_ms']} ms a pass")
    return lines
