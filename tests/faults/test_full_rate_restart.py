"""A broker restart during full-rate streams (issue 23): the runners coalesce tokens into
multi-token events, and a single nats-server SIGKILLed and restarted on its store mid-stream
still ends every task with no gap and no duplicate token (counted per token, not per event),
read back in index order by the gateway's reader as well.

The fault engine runs unpaced (delay_ms:0), so token events carry up to 16 tokens each; the
tasks are long enough that the kill lands while they stream.
"""

from __future__ import annotations

import asyncio

import pytest

from fleet.bus.task_events import TaskEvents
from fleet.wire.events import TokenChunk, token_indexes
from tests.faults.conftest import RunFactory
from tests.faults.run import Load
from tests.faults.servers import Broker
from tests.faults.test_broker_faults import SINGLE_DOWN_S, check, kill_and_restart

FULL_RATE = Load(tasks=16, tokens=20000, delay_ms=0, slots=8)

pytestmark = pytest.mark.timeout(300)


async def test_a_broker_restart_during_full_rate_streams_leaves_no_gap_and_no_duplicate(
    single_broker: Broker, fault_run: RunFactory
) -> None:
    run = fault_run(single_broker, FULL_RATE, 1)
    await run.start()
    await run.publish()
    await run.until_busy()
    (node,) = single_broker.nodes.values()
    returned = await kill_and_restart(run, single_broker, node, "full-rate streams",
                                      SINGLE_DOWN_S)
    await run.until_finished(returned)
    report = await run.report(returned)
    check(report, replicas=1)
    stored = await run.read_out()
    multi = sum(1 for events in stored.values() for s in events
                if isinstance(s.event, TokenChunk) and s.event.count > 1)
    assert multi > 0, "no token event carried several tokens: nothing was coalesced"
    loop = asyncio.get_running_loop()
    for task_id, tokens in run.expected.items():
        async with TaskEvents(run.nc.jetstream(), task_id, loop.time() + 60) as events:
            read = token_indexes([item.event async for item in events])
        if any(s.event.type == "task_finished" and getattr(s.event, "status", "") == "completed"
               for s in stored[task_id]):
            assert read == list(range(tokens)), f"{task_id}: read {len(read)} of {tokens}"
