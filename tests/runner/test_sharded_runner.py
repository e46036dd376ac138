"""Sharded text runners: two real runner subprocesses joined by mx.distributed's ring, driven
over their pipes as their workers would; their tokens against one unsharded runner's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleet.models.catalog import get_card
from fleet.wire.events import TaskFinished, TokenChunk
from fleet.wire.framing import decode_report
from fleet.wire.pipe import (
    ConnectToGroup,
    LoadModel,
    RunnerSpec,
    RunnerStatusReport,
    SubmitTask,
    WarmUp,
)
from fleet.wire.ring import GroupSpec
from fleet.wire.runners import RunnerFailed
from fleet.wire.tasks import TextGeneration
from fleet.wire.token_frames import TokenFrame
from fleet.worker.inbox import RunnerExited, RunnerReported
from fleet.worker.node import free_port
from fleet.worker.supervisor import RunnerProcess

WAIT_S = 120.0  # two shared cores: each rank imports mlx and loads its layers


class Owner:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, name: str, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        return task


class Rank:
    """One runner process and its reports, read with timeouts."""

    def __init__(self, spec: RunnerSpec, log: Path) -> None:
        self.reports: asyncio.Queue[Any] = asyncio.Queue()
        self.process = RunnerProcess(spec, self.reports, env={"MLX_DISABLE_COMPILE": "1"},
                                     log_path=log)
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, TaskFinished] = {}

    async def next(self) -> Any:
        item = await asyncio.wait_for(self.reports.get(), WAIT_S)
        report = item.report if isinstance(item, RunnerReported) else item
        if isinstance(item, RunnerReported):  # a terminal's last token events, read with it
            for frame in item.tail:
                self._tokens_of(decode_report(frame.body))
        if isinstance(report, TokenFrame):  # a token event reaches the worker as its bytes
            report = decode_report(report.body)
        self._tokens_of(report)
        if isinstance(report, TaskFinished):
            self.finished[report.task_id] = report
        return report

    def _tokens_of(self, report: Any) -> None:
        if isinstance(report, TokenChunk):  # an event may carry several tokens
            self.tokens.setdefault(report.task_id, []).extend(report.ids)

    async def until_state(self, *states: str) -> Any:
        while True:
            report = await self.next()
            if isinstance(report, RunnerStatusReport) and report.status.state in states:
                return report.status
            assert not isinstance(report, RunnerExited), f"runner exited: {report}"

    async def until_finished(self, task_ids: set[str]) -> None:
        while not task_ids <= set(self.finished):
            await self.next()


def spec(model_dir: Path, runner_id: str, group: GroupSpec | None, slots: int = 8) -> RunnerSpec:
    return RunnerSpec(
        runner_id=runner_id, instance_id="inst", node_id=f"node-{runner_id}",
        card=get_card(model_dir.name if model_dir.name != "model" else "tiny-llm"),
        model_path=str(model_dir), images_dir="/tmp", slots=slots, group=group,
    )


@pytest.fixture
async def owner() -> AsyncIterator[Owner]:
    yield Owner()


async def start(ranks: list[Rank], owner: Owner) -> None:
    for rank in ranks:
        await rank.process.start(owner)
    for command in (ConnectToGroup(), LoadModel(), WarmUp()):
        for rank in ranks:
            await rank.process.send(command)
    for rank in ranks:
        await rank.until_state("ready")


async def stop(ranks: list[Rank]) -> list[int]:
    return list(await asyncio.gather(*(r.process.stop(timeout=30) for r in ranks)))


def group(rank: int, ports: list[int], layers: list[tuple[int, int]]) -> GroupSpec:
    start, end = layers[rank]
    return GroupSpec(rank=rank, start_layer=start, end_layer=end,
                     ring=[f"127.0.0.1:{p}" for p in ports], connect_timeout_s=60)


def chat(task_id: str, question: str, max_tokens: int, model: str) -> SubmitTask:
    return SubmitTask(task=TextGeneration(
        task_id=task_id, model=model, max_tokens=max_tokens, temperature=0.0,
        messages=[{"role": "user", "content": question}],
    ))


async def run(ranks: list[Rank], tasks: list[SubmitTask]) -> dict[str, list[int]]:
    for task in tasks:
        await ranks[0].process.send(task)
    await ranks[0].until_finished({t.task.task_id for t in tasks})
    return {t.task.task_id: ranks[0].tokens.get(t.task.task_id, []) for t in tasks}


async def test_two_shards_of_tiny_llm_batch_eight_tasks_as_each_runs_alone(
    tiny_llm_dir: Path, tmp_path: Path, owner: Owner,
) -> None:
    questions = [f"question {i}: {'why ' * i}" for i in range(8)]
    tasks = [chat(f"t{i}", q, 12, "tiny-llm") for i, q in enumerate(questions)]
    alone = Rank(spec(tiny_llm_dir, "solo", None), tmp_path / "solo.log")
    await start([alone], owner)
    solo_tokens = {}
    for task in tasks:
        solo_tokens.update(await run([alone], [task]))
    await stop([alone])

    ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
    ranks = [Rank(spec(tiny_llm_dir, f"r{i}", group(i, ports, [(0, 1), (1, 2)])),
                  tmp_path / f"r{i}.log") for i in range(2)]
    await start(ranks, owner)
    together = await run(ranks, tasks)
    assert all(len(tokens) == 12 for tokens in together.values())
    assert together == solo_tokens
    # They did run together: the lockstep batch held several tasks at once.
    assert max((f.stats.batched_with or 0) for f in ranks[0].finished.values() if f.stats) >= 3
    assert ranks[1].finished == {}  # only rank 0 reports task events
    assert await stop(ranks) == [0, 0]


async def test_a_rank_that_never_comes_fails_the_ring_with_a_clear_error(
    tiny_llm_dir: Path, tmp_path: Path, owner: Owner,
) -> None:
    ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
    lonely = group(0, ports, [(0, 1), (1, 2)]).model_copy(update={"connect_timeout_s": 3.0})
    rank = Rank(spec(tiny_llm_dir, "r0", lonely), tmp_path / "r0.log")
    await rank.process.start(owner)
    await rank.process.send(ConnectToGroup())
    failed = await rank.until_state("failed")
    assert isinstance(failed, RunnerFailed)
    assert f"the ring did not form within 3 s: rank 0 waited for rank 1 at 127.0.0.1:{ports[1]}" \
        in failed.error
    while not isinstance(await rank.next(), RunnerExited):
        pass  # the watchdog killed it after its last words
    assert rank.process.returncode == -9
