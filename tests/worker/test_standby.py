"""Which nodes keep a standby runner (fleet.worker.standby): table tests of the pure rules, and
one real standby process taking a tiny-llm runner's job."""

from __future__ import annotations

import asyncio
import io
import json
import math
from pathlib import Path

import pytest

from fleet.aio import Supervisor
from fleet.models.catalog import get_card
from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.framing import FrameReader
from fleet.wire.pipe import ConnectToGroup, LoadModel, RunnerSpec, RunnerStatusReport, WarmUp
from fleet.wire.runners import RunnerIdle, RunnerLoading, RunnerReady, RunnerStatus
from fleet.worker.inbox import RunnerReported
from fleet.worker.standby import (
    STANDBY_AFTER_S,
    StandbyRunner,
    standby_fits,
    standby_job,
    standby_kept,
    standby_may_start,
    standby_wanted,
)
from fleet.worker.state import RunnerView, WorkerState
from fleet.worker.supervisor import RunnerProcess

HERE = "node-a"


def one_node(instance_id: str, node: str = HERE) -> Instance:
    shard = ShardAssignment(node_id=node, runner_id=f"run-{instance_id}")
    return Instance(instance_id=instance_id, model="tiny-llm", shards=[shard], created_at=0.0)


def two_shards(instance_id: str, nodes: tuple[str, str] = (HERE, "node-b")) -> Instance:
    shards = [
        ShardAssignment(node_id=node, runner_id=f"run-{instance_id}-{rank}", rank=rank,
                        world_size=2, start_layer=rank * 2, end_layer=rank * 2 + 2,
                        ring_address=f"127.0.0.1:{5000 + rank}")
        for rank, node in enumerate(nodes)
    ]
    return Instance(instance_id=instance_id, model="tiny-llm", shards=shards, created_at=0.0)


def state(*instances: Instance, runner: RunnerStatus | None = None, starting: bool = False,
          stopping: bool = False) -> WorkerState:
    runners = {} if runner is None else {"run-1": RunnerView(
        runner_id="run-1", instance_id=instances[0].instance_id, model="tiny-llm",
        status=runner)}
    return WorkerState(
        node_id=HERE, instances={i.instance_id: i for i in instances}, runners=runners,
        starting=frozenset({instances[0].instance_id}) if starting else frozenset(),
        stopping=stopping,
    )


@pytest.mark.parametrize(("case", "worker", "wanted", "kept", "may_start"), [
    ("a spare: no instance here", state(), True, True, True),
    ("an instance elsewhere only", state(one_node("i1", node="node-b")), True, True, True),
    ("a one-node instance here", state(one_node("i1"), runner=RunnerReady()), False, False,
     False),
    # Failover gave a spare a one-node instance: its runner's start may take the standby.
    ("a one-node instance here, its runner being prepared",
     state(one_node("i1"), starting=True), False, True, False),
    ("a one-node instance here, its runner loading",
     state(one_node("i1"), runner=RunnerLoading()), False, True, False),
    ("a rank of a sharded instance, ready", state(two_shards("s1"), runner=RunnerReady()),
     True, True, True),
    ("a rank whose runner is loading", state(two_shards("s1"), runner=RunnerLoading()),
     True, True, False),
    ("a rank whose runner was just spawned", state(two_shards("s1"), runner=RunnerIdle()),
     True, True, False),
    ("a rank whose runner is being prepared", state(two_shards("s1"), starting=True),
     True, True, False),
    ("a rank of a sharded instance beside a one-node one",
     state(two_shards("s1"), one_node("i1"), runner=RunnerReady()), True, True, True),
    ("stopping", state(stopping=True), False, False, False),
    ("stopping while a runner starts", state(two_shards("s1"), starting=True, stopping=True),
     False, False, False),
])
def test_which_nodes_keep_a_standby(
    case: str, worker: WorkerState, wanted: bool, kept: bool, may_start: bool,
) -> None:
    assert standby_wanted(worker) is wanted, case
    assert standby_kept(worker) is kept, case
    assert standby_may_start(worker, quiet_s=math.inf) is may_start, case


@pytest.mark.parametrize(("quiet_s", "may_start"), [
    (0.0, False), (STANDBY_AFTER_S - 0.01, False), (STANDBY_AFTER_S, True),
])
def test_a_standby_waits_until_the_last_start_is_behind(quiet_s: float, may_start: bool) -> None:
    """A restarted group's ready is followed by the continuation's prefill: a standby's
    imports started at once would take its cores."""
    ready_rank = state(two_shards("s1"), runner=RunnerReady())
    assert standby_may_start(ready_rank, quiet_s) is may_start


@pytest.mark.parametrize(("model", "fits"), [
    ("tiny-llm", True), ("smollm2-135m", True), ("tiny-flux2", False),
    ("smollm2-135m-embed", False), ("fault", False),
])
def test_a_standby_runs_text_models_only(model: str, fits: bool) -> None:
    # The fault engine's card is a test's own: a text card of its family stands for it.
    card = (get_card("tiny-llm").model_copy(update={"family": "fault"}) if model == "fault"
            else get_card(model))
    assert standby_fits(card) is fits


def spec_for(runner_id: str, model_dir: Path, images: Path) -> RunnerSpec:
    return RunnerSpec(
        runner_id=runner_id, instance_id="inst-1", node_id=HERE, card=get_card("tiny-llm"),
        model_path=str(model_dir), images_dir=str(images), slots=2,
    )


def test_the_job_frame_carries_spec_and_env(tmp_path: Path) -> None:
    frame = standby_job(spec_for("run-x", tmp_path, tmp_path), {"OPENBLAS_NUM_THREADS": "1"})
    job = json.loads(FrameReader(io.BytesIO(frame)).read() or b"")
    assert job["env"] == {"OPENBLAS_NUM_THREADS": "1"}
    assert RunnerSpec.model_validate_json(job["spec"]).runner_id == "run-x"


async def test_a_standby_takes_a_tiny_llm_job_and_becomes_ready(
    tmp_path: Path, tiny_llm_dir: Path,
) -> None:
    """A real standby process: its imports done ahead, it reads its spec from stdin, reports
    as the runner of the standby's id, loads and warms up on the worker's commands."""
    inbox: asyncio.Queue[object] = asyncio.Queue()
    async with Supervisor("test") as owner:
        standby = await StandbyRunner.start(
            tmp_path / "logs", {"OPENBLAS_NUM_THREADS": "1"}, owner)
        runner_log = tmp_path / "logs" / f"{standby.runner_id}.log"
        process = RunnerProcess(spec_for(standby.runner_id, tiny_llm_dir, tmp_path / "images"),
                                inbox, env={"OPENBLAS_NUM_THREADS": "1"},  # type: ignore[arg-type]
                                log_path=runner_log)
        await process.start(owner, standby)
        assert process.pid == standby.process.pid
        try:
            for command in (ConnectToGroup(), LoadModel(), WarmUp()):
                await process.send(command)
            async with asyncio.timeout(300):
                while True:
                    item = await inbox.get()
                    if (isinstance(item, RunnerReported)
                            and isinstance(item.report, RunnerStatusReport)
                            and isinstance(item.report.status, RunnerReady)):
                        assert item.runner_id == standby.runner_id
                        break
        finally:
            await process.stop(timeout=10.0)
    log = runner_log.read_text()  # the standby's log, renamed as the runner's
    assert f"runner {standby.runner_id}" in log and "warmed up in" in log
    assert list((tmp_path / "logs").glob("standby-*.log")) == []


@pytest.mark.process  # a standby process, started by hand (tests/tiers.py)
async def test_a_discarded_standby_leaves_no_log(tmp_path: Path) -> None:
    async with Supervisor("test") as owner:
        standby = await StandbyRunner.start(
            tmp_path / "logs", {"OPENBLAS_NUM_THREADS": "1"}, owner)
        await standby.discard()
    assert not standby.alive and list((tmp_path / "logs").iterdir()) == []
