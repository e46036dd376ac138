"""`fleet up --models M` keeps an instance of M that the fleet has already, says so, and a
stranded one (its node died alone) is moved to this node by the failover sweep."""

from __future__ import annotations

import time
from pathlib import Path

from fleet.bus.embedded import EmbeddedNats
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.codec import encode
from tests.commands.test_exits import Command, assert_clean, free_port
from tests.integration.harness import client, finished, hello, run_task, seed_models


async def test_fleet_up_keeps_a_stranded_instance_says_so_and_heals_it(
    nats_server: EmbeddedNats, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    nc = await client(nats_server.url)
    stranded = Instance(
        instance_id="tiny-llm-old", model="tiny-llm", slots=2, created_at=time.time(),
        shards=[ShardAssignment(node_id="ghost-node", runner_id="run-gone", end_layer=2)],
    )
    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    await kv.create(stranded.instance_id, encode(stranded))
    seed_models(tmp_path / "data", {"tiny-llm": tiny_llm_dir})
    up = Command(tmp_path, "--nats-url", nats_server.url, "up", "--models", "tiny-llm",
                 "--port", str(free_port()))
    try:
        up.wait_for_line("fleet up: NATS")
        assert "kept existing instance tiny-llm-old on node ghost-node" in up.log()
        assert "placed tiny-llm" not in up.log()
        result = finished(await run_task(nc, hello("kept-and-healed"), timeout=120))
        assert result.status == "completed"
        assert "moved tiny-llm-old" in up.log()
        up.wait_for_line("for tiny-llm on node")  # fleet up says when a runner is ready
        assert "is ready" in up.log()
        assert_clean(up, *up.terminate_and_time())
    finally:
        up.kill()
        await nc.close()
