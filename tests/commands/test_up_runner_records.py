"""What `fleet up` records of its runners: an image runner idle again after a task counts no
task (its Ready came while the task's terminal waited behind the image's upload, and the
dashboard read "1/1 slots busy")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from fleet.bus.embedded import EmbeddedNats
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import decode_model
from tests.commands.test_exits import Command, free_port
from tests.integration.harness import client, seed_models

IMAGE = {"model": "tiny-flux2", "prompt": "a fox", "size": "128x128", "steps": 2}


async def test_an_image_runner_idle_after_its_task_records_no_task(
    nats_server: EmbeddedNats, tmp_path: Path, tiny_flux2_dir: Path
) -> None:
    nc = await client(nats_server.url)
    seed_models(tmp_path / "data", {"tiny-flux2": tiny_flux2_dir})
    port = free_port()
    up = Command(tmp_path, "--nats-url", nats_server.url, "up", "--models", "tiny-flux2",
                 "--port", str(port))
    try:
        up.wait_for_line("is ready", timeout=120)
        kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            for _ in range(2):
                made = await http.post("/v1/images/generations", json=IMAGE)
                assert made.status_code == 200, made.text
                watcher = await kv.watchall()  # from the latest record of each runner
                latest: RunnerRecord | None = None
                async with asyncio.timeout(30):
                    while latest is None or (latest.status.state, latest.active_tasks) != (
                            "ready", 0):
                        entry = await watcher.updates(timeout=30)
                        if entry is not None and entry.value:
                            latest = decode_model(RunnerRecord, entry.value)
                await watcher.stop()
    finally:
        up.kill()
        await nc.close()
