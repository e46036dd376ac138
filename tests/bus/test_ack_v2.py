"""The grants survive the v2 ack and flow-control subjects (issue 31, item 7).

nats-server 2.14 added `$JS.ACK.<domain>.<account hash>.<stream>...` and the same for
`$JS.FC`, behind the feature flag `js_ack_fc_v2`, announced as the default of a later release.
The bundled 2.15.1 takes the flag, so the shipped roles run here on a server that uses it: a
worker's ack of a task and a client's flow-controlled read of an image must still pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.bus.objects import ObjectBucket
from fleet.bus.provision import ensure_task_consumer, provision
from fleet.bus.roles import GRANTS
from tests.secured import as_role, shipped_auth_server

MODEL = "acked-v2"


@pytest.fixture(scope="module")
def v2_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shipped_auth_server(tmp_path_factory.mktemp("ackv2"),
                             "feature_flags { js_ack_fc_v2: true }") as url:
        asyncio.run(_prepare(url))
        yield url


async def _prepare(url: str) -> None:
    admin = await as_role(url, "operator")
    try:
        await provision(admin)
        await ensure_task_consumer(admin, MODEL)
    finally:
        await admin.close()


def _matches(subject: str, pattern: str) -> bool:
    tokens, wanted = subject.split("."), pattern.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or token not in ("*", tokens[i]):
            return False
    return len(tokens) == len(wanted)


async def test_a_worker_acks_a_task_in_the_v2_form(v2_url: str) -> None:
    violations: list[str] = []
    admin = await as_role(v2_url, "operator")
    worker = await as_role(v2_url, "worker", violations)
    try:
        await admin.jetstream().publish(f"fleet.tasks.{MODEL}", b"{}")
        sub = await worker.jetstream().pull_subscribe_bind(f"tasks-{MODEL}", stream="FLEET_TASKS")
        [msg] = await sub.fetch(1, timeout=5)
        assert msg.reply.startswith("$JS.ACK._.") and len(msg.reply.split(".")) >= 11
        # the v1 grant alone would refuse it: the stream is the fifth token now
        assert not _matches(msg.reply, "$JS.ACK.FLEET_TASKS.>")
        assert any(_matches(msg.reply, g) for g in GRANTS["worker"].publish)
        await msg.ack_sync(timeout=5)
        info = await admin.jetstream().stream_info("FLEET_TASKS")
        assert info.state.messages == 0  # a work queue drops what was acked
        assert violations == []
    finally:
        await worker.close()
        await admin.close()


async def test_a_client_reads_an_image_with_v2_flow_control(v2_url: str, tmp_path: Path) -> None:
    """Several chunks through a push consumer with flow control (fleet.bus.chunks)."""
    violations: list[str] = []
    admin = await as_role(v2_url, "operator")
    client = await as_role(v2_url, "client", violations)
    try:
        image = bytes(range(256)) * 20_000  # 5 MB: flow-control requests on the way
        name = await ObjectBucket(admin).put_by_hash(image)
        assert await ObjectBucket(client).get(name) == image
        assert violations == []
    finally:
        await client.close()
        await admin.close()
