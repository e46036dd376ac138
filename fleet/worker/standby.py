"""A standby runner: a runner process started before it has a job (issue 24).

A text runner's start is mostly imports: mlx-lm brings transformers and huggingface_hub, 9-16 s
on a loaded 2-core box, more than its model's load. When a rank of a sharded instance moves,
every rank restarts (the ring cannot be re-joined in-process: mlx's `init` keeps its first
group), and a spare node that takes a dead node's shard starts from nothing: both paid those
seconds while the user's answer was frozen. So a node that may have to start a runner at
short notice keeps one process that has imported a text runner's libraries and waits, blocked
on its stdin, for a job: one frame with its spec and environment (`fleet.runner.main
--standby`). Taking it costs a pipe write.

Which nodes keep one (`standby_wanted`, pure): a node hosting no instance (a spare: failover
or demand may place a model here) and a node hosting a rank of a sharded instance (its runner
restarts whenever the group changes). A node serving only one-node instances keeps none: its
runner's crash hands the task to another runner of the model, and an idle import would cost
memory for nothing. A new standby is started only once no runner of the node has been starting
for STANDBY_AFTER_S, nor the worker itself (`standby_may_start`): it would take cores from the
start it is meant to speed up, and from the continuation's prefill that follows a restarted
group's ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from fleet.aio import Supervisor
from fleet.wire.cluster import ModelCard
from fleet.wire.codec import encode
from fleet.wire.framing import encode_frame, encode_message
from fleet.wire.pipe import RunnerSpec, RunnerStatusReport
from fleet.wire.runners import RunnerIdle
from fleet.worker.state import WorkerState

log = logging.getLogger(__name__)

# fleet.runner.fault_engine's family (the worker imports no runner code): it imports no mlx,
# so a standby would gain it nothing.
FAULT_FAMILY = "fault"
STANDBY_AFTER_S = 10.0
STARTING_STATES = frozenset({"idle", "connecting", "connected", "loading", "loaded",
                             "warming_up"})


def standby_fits(card: ModelCard) -> bool:
    """Whether a standby (a text runner's imports done) can run `card`. Pure."""
    return not (card.is_image or card.is_vision or card.is_embedding
                or card.family == FAULT_FAMILY)


def standby_wanted(state: WorkerState) -> bool:
    """Whether this node should hold a standby runner now (one it holds is kept while this
    says so, and stopped once it does not). Pure."""
    if state.stopping:
        return False
    hosted = state.hosted_instances()
    return not hosted or any(instance.sharded for instance in hosted)


def runners_starting(state: WorkerState) -> bool:
    """Whether a runner of this node is being prepared or has not yet become ready. Pure."""
    return bool(state.starting) or any(
        runner.status.state in STARTING_STATES for runner in state.runners.values()
    )


def standby_kept(state: WorkerState) -> bool:
    """Whether a standby held here is kept: wanted, or a runner of this node is starting (it
    may be about to take the standby: a spare given a one-node instance by failover no longer
    wants one, but its runner's start does). Pure."""
    return not state.stopping and (standby_wanted(state) or runners_starting(state))


def standby_may_start(state: WorkerState, quiet_s: float) -> bool:
    """Whether a new standby may start now: wanted, and no runner of this node starting now
    nor in the last STANDBY_AFTER_S (`quiet_s`: seconds since one was). Pure."""
    return (standby_wanted(state) and not runners_starting(state)
            and quiet_s >= STANDBY_AFTER_S)


# What a standby writes once its imports are done: an Idle report (a runner's first state),
# so a standby handed its job before that reads as any runner to the report pump.
WARM = encode_message(RunnerStatusReport(status=RunnerIdle()))


def standby_job(spec: RunnerSpec, env: dict[str, str]) -> bytes:
    """The frame a standby waits for: its spec and the environment it adds. Pure."""
    return encode_frame(json.dumps({"spec": encode(spec).decode(), "env": env}).encode())


class StandbyRunner:
    """One started standby process; its runner id and log file are chosen at its start."""

    def __init__(self, runner_id: str, log_path: Path,
                 process: asyncio.subprocess.Process, owner: Supervisor,
                 on_warm: Callable[[], None] = lambda: None) -> None:
        self.runner_id = runner_id
        self.log_path = log_path
        self.process = process
        self.warm = False  # its imports are done: a job handed now starts at once
        self._on_warm = on_warm
        self._started = time.monotonic()
        # A child of the worker's supervisor: a failure of the watch is logged there.
        self._watch = owner.spawn(f"standby {runner_id} warm watch", self._until_warm())

    async def _until_warm(self) -> None:
        assert self.process.stdout is not None
        # One readexactly: atomic under cancellation (a job handed first leaves it unread,
        # and the runner's report pump reads it as the Idle report it is).
        with contextlib.suppress(asyncio.IncompleteReadError):
            if await self.process.stdout.readexactly(len(WARM)) == WARM:
                self.warm = True
                log.info("standby runner %s is warm (imports took %.1f s)", self.runner_id,
                         time.monotonic() - self._started)
                self._on_warm()

    @classmethod
    async def start(cls, logs: Path, env: dict[str, str], owner: Supervisor,
                    on_warm: Callable[[], None] = lambda: None) -> StandbyRunner:
        runner_id = f"run-{uuid.uuid4().hex[:10]}"
        logs.mkdir(parents=True, exist_ok=True)
        # Named as a standby's until a runner takes it (`adopt_log`): tools that read a
        # node's runner logs (`run-*.log`) see no log of a process that never ran a model.
        log_path = logs / f"standby-{runner_id}.log"
        with log_path.open("ab") as stderr:  # the child holds its own copy
            process = await asyncio.create_subprocess_exec(
                # Its id on its command line, as a runner's spec puts it there: tools and
                # tests find a runner's process by it.
                sys.executable, "-m", "fleet.runner.main", "--standby", runner_id,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                env={**os.environ, **env},
            )
        log.info("standby runner %s started, pid %d", runner_id, process.pid)
        return cls(runner_id, log_path, process, owner, on_warm)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def hand(self, spec: RunnerSpec, env: dict[str, str]) -> bool:
        """Give it its job; False when it is gone (the caller starts a runner afresh)."""
        await _stop(self._watch)  # the runner's pump reads its stdout from here on
        if not self.alive or self.process.stdin is None:
            return False
        try:
            self.process.stdin.write(standby_job(spec, env))
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def adopt_log(self, runner_log: Path | None) -> None:
        """Its log becomes the runner's (the process keeps writing to it: a rename)."""
        if runner_log is not None:
            with contextlib.suppress(OSError):
                self.log_path.rename(runner_log)

    async def discard(self) -> None:
        """Kill it and collect it (it holds no task and nothing of the fleet's). The log of
        one killed here goes (its imports' noise); one that ended by itself keeps it."""
        await _stop(self._watch)
        killed = self.alive
        if killed:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()
        if killed:
            self.log_path.unlink(missing_ok=True)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
