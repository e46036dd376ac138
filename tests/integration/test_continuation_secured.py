"""Continuation under the shipped NATS roles: the worker that continues a dead worker's task
reads that task's stored events from FLEET_OUT as the `worker` user, not as a superuser.

Real processes: nats-server with ops/nats/auth.conf, two `fleet worker`s each connected as
the worker role, a client publishing as the client role. The first worker is SIGKILLed
mid-answer; the second must continue the task from the next token (before the worker role
could replay FLEET_OUT, the continuation was refused by the server and the task failed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.provision import provision
from fleet.bus.replies import inbox_prefix
from fleet.wire.events import TaskAccepted, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.continuing import ENV, finished_of, place_on
from tests.integration.harness import WorkerProcess, add_fault_card, seed_models, wait_node
from tests.integration.killing import kill_mid_task, tokens_past
from tests.secured import PASSWORDS, shipped_auth_server

TOKENS = 40


@pytest.fixture
def secured_url(tmp_path: Path) -> Iterator[str]:
    with shipped_auth_server(tmp_path) as url:
        yield url


async def as_role(url: str, role: str) -> Client:
    return await nats.connect(url, user=role, password=PASSWORDS[role], connect_timeout=5,
                              inbox_prefix=inbox_prefix(role))


@pytest.mark.slow
async def test_a_task_is_continued_by_a_worker_connected_as_the_worker_role(
    secured_url: str, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    operator = await as_role(secured_url, "operator")
    await provision(operator)
    user = await as_role(secured_url, "client")
    workers: list[WorkerProcess] = []

    async def start(name: str) -> tuple[WorkerProcess, str]:
        data_dir = tmp_path / name
        seed_models(data_dir, {"tiny-llm": tiny_llm_dir})
        card = add_fault_card(data_dir)
        worker = WorkerProcess(
            secured_url, data_dir, **ENV,
            FLEET_NATS_USER="worker", FLEET_NATS_PASSWORD=PASSWORDS["worker"],
        ).start()
        workers.append(worker)
        node = await wait_node(operator, data_dir)
        await place_on(operator, card, node)
        return worker, node

    try:
        task = TextGeneration(
            task_id="secured-cont", model="fault-llm", max_tokens=1000,
            messages=[ChatMessage(role="user", content=f"tokens:{TOKENS} delay_ms:100")],
        )
        killed = await kill_mid_task(user, task, start, tokens_past(2))
        result = finished_of(killed.events)
        assert result.status == "completed", (result.reason, result.message)
        tokens = [e for e in killed.events if isinstance(e, TokenChunk)]
        assert sorted(set(token_indexes(tokens))) == list(range(TOKENS))
        accepted = [e for e in killed.events if isinstance(e, TaskAccepted)]
        assert accepted[-1].node_id == killed.second_node and accepted[-1].continued_from > 0
        log = killed.second.log()
        assert "permission denied" not in log, log[-2000:]
    finally:
        for worker in workers:
            worker.kill()
        await user.close()
        await operator.close()
