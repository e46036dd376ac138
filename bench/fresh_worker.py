"""How long a freshly started worker takes to be dispatch-ready for a tiny-flux2 edit whose
10 MB input image is only in the object store: node registered, runner ready, task accepted."""

from __future__ import annotations

import asyncio
import io
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from bench.event_log import EventLog, ms
from bench.fleet_stack import FleetStack, seed_data_dir, wait_runner_ready
from bench.procs import stop_group
from fleet.bus.connect import js_publish
from fleet.bus.objects import ObjectBucket
from fleet.models.catalog import get_card
from fleet.models.store import ensure_model
from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.tasks import ImageEdits


def _noise_png(target_bytes: int) -> bytes:
    import numpy as np
    from PIL import Image

    side = int((target_bytes / 3) ** 0.5) + 1
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


async def measure_fresh_worker(
    stack: FleetStack, nc: Client, models_dir: Path, workdir: Path, env: dict[str, str]
) -> dict[str, Any]:
    flux = ensure_model(get_card("tiny-flux2"), models_dir)
    image = await asyncio.to_thread(_noise_png, 10 * 1000 * 1000)
    sha = await ObjectBucket(nc, subjects.IMAGES_BUCKET, timeout=30).put_by_hash(image)
    data_dir = workdir / "fresh-worker"
    seed_data_dir(data_dir, {"tiny-flux2": flux}, {})
    node = f"bench-fresh-{secrets.token_hex(4)}"
    (data_dir / "node_id").write_text(node)
    task = ImageEdits(task_id=f"edit-{secrets.token_hex(6)}", model="tiny-flux2",
                      prompt="a lighthouse at dusk", size="128x128", steps=2,
                      input_images=[sha])
    events = EventLog()
    sub = await nc.subscribe(subjects.out(task.task_id), cb=events.on_event)
    await js_publish(nc.jetstream(), subjects.tasks("tiny-flux2"), task, msg_id=task.task_id)
    began = time.perf_counter()
    with (data_dir / "worker.log").open("ab") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "--data-dir", str(data_dir), "--log-level",
             "warning", "worker", "--no-auto-place"], env={**env, "FLEET_NATS_URL": stack.nats_url},
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        registered = await _wait_node(nc, node, began + 120)
        await place(nc.jetstream(), get_card("tiny-flux2", data_dir), node_id=node, slots=1)
        deadline = time.monotonic() + 300
        await wait_runner_ready(nc, "tiny-flux2", deadline, node_id=node,
                                alive=lambda: _check_alive(worker, data_dir))
        ready = time.perf_counter() - began
        await events.all_finished([task.task_id], 300)
    finally:
        await sub.unsubscribe()
        await asyncio.to_thread(stop_group, worker, 5.0)
    accepted = events.accepted[task.task_id][0] - began
    return {
        "input_image_bytes": len(image),
        "node_registered_s": round(registered, 3),
        "runner_ready_s": round(ready, 3),
        "task_accepted_s": round(accepted, 3),
        "accepted_after_ready_ms": ms(accepted - ready),
        "task_finished_s": round(events.finished[task.task_id][0] - began, 3),
        "status": events.finished[task.task_id][2],
    }


async def _wait_node(nc: Client, node: str, deadline_perf: float) -> float:
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    watcher = await kv.watch(node)
    began = deadline_perf - 120
    try:
        while time.perf_counter() < deadline_perf:
            try:
                entry = await watcher.updates(timeout=1.0)
            except TimeoutError:
                continue
            if entry is not None and entry.value:
                return time.perf_counter() - began
    finally:
        await watcher.stop()
    raise TimeoutError(f"node {node} did not register")


def _check_alive(worker: subprocess.Popen[bytes], data_dir: Path) -> None:
    if worker.poll() is not None:
        raise RuntimeError(f"the fresh worker exited; see {data_dir / 'worker.log'}")
