"""The buckets every node watches take more watchers than nats-server 2.15's default of 1,000
consumers a stream (issue 22): a worker holds one ordered consumer on FLEET_INSTANCES, one on
FLEET_CANCELS, one on FLEET_MODELS and one on FLEET_PREFIXES per model it serves. At
N = 1,000 simulated nodes the 1,001st consumer of FLEET_INSTANCES was refused (error 10026),
and it was the sweeper's snapshot: no failover within 60 s."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from fleet.bus.kv_read import live_entries
from fleet.bus.provision import definitions
from fleet.wire import subjects

SERVER_DEFAULT = 1000  # nats-server 2.15: any stream that sets no max_consumers of its own
# One watch per node (FLEET_PREFIXES: per model it serves): N nodes need N consumers and more.
PER_NODE = ("KV_FLEET_INSTANCES", "KV_FLEET_CANCELS", "KV_FLEET_MODELS", "KV_FLEET_PREFIXES")


@pytest.mark.parametrize("name", PER_NODE)
def test_every_per_node_bucket_sets_its_own_consumer_limit(name: str) -> None:
    config = next(d for d in definitions() if d["name"] == name)
    assert config.get("max_consumers", 0) > 4 * SERVER_DEFAULT


async def test_a_snapshot_is_read_beside_more_watchers_than_the_default(
    provisioned_nc: Client,
) -> None:
    js = provisioned_nc.jetstream()
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    await kv.put("i-1", b"{}")
    watchers = [await kv.watchall() for _ in range(SERVER_DEFAULT + 1)]
    try:
        assert [e.key for e in await live_entries(js, subjects.INSTANCES_BUCKET)] == ["i-1"]
    finally:
        for watcher in watchers:
            await watcher.stop()
