"""The runner subprocesses this node hosts: prepare a model, spawn, command, stop."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fleet.aio import Supervisor
from fleet.config import Settings
from fleet.models.store import ensure_model
from fleet.runner.protocol import RunnerCommand, RunnerSpec
from fleet.wire.cluster import Instance, ModelCard
from fleet.worker.inbox import Inbox, RunnerExited
from fleet.worker.state import RunnerSpawned, RunnerStartFailed, RunnerView
from fleet.worker.supervisor import RunnerNotRunning, RunnerProcess

log = logging.getLogger(__name__)

# mflux draws a tqdm progress bar per generation: carriage-return noise in the runner's log.
RUNNER_ENV = {"TQDM_DISABLE": "1"}


class RunnerPool:
    """The runners of this node. Starting, stopping and each runner's report pump are
    children of the worker's Supervisor (`owner`)."""

    def __init__(
        self, settings: Settings, node_id: str, inbox: Inbox, owner: Supervisor
    ) -> None:
        self.settings = settings
        self.node_id = node_id
        self.inbox = inbox
        self.owner = owner
        self.processes: dict[str, RunnerProcess] = {}
        self.stopping: set[str] = set()
        self.building = asyncio.Lock()

    def spawn(self, instance: Instance, card: ModelCard | None) -> None:
        """Prepare weights (a first SmolLM2 conversion takes seconds) off the loop, then start."""
        self.owner.spawn(f"start runner for {instance.instance_id}", self._spawn(instance, card))

    async def _spawn(self, instance: Instance, card: ModelCard | None) -> None:
        try:
            if card is None:
                raise LookupError(f"no model card {instance.model!r} on this node")
            # One build at a time: builds saturate the cores anyway, and the libraries they
            # import lazily (transformers) are not safe to import from two threads at once.
            async with self.building:
                path = await asyncio.to_thread(ensure_model, card, self.settings.models_dir)
            runner_id = f"run-{uuid.uuid4().hex[:10]}"
            slots = 1 if card.is_image else instance.slots
            spec = RunnerSpec(
                runner_id=runner_id, instance_id=instance.instance_id, node_id=self.node_id,
                card=card, model_path=str(path), images_dir=str(self.settings.images_dir),
                slots=slots,
            )
            self.settings.images_dir.mkdir(parents=True, exist_ok=True)
            logs = self.settings.data_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            process = RunnerProcess(
                spec, self.inbox, env=RUNNER_ENV, log_path=logs / f"{runner_id}.log"
            )
            await process.start(self.owner)
        except Exception as exc:
            log.error("cannot start a runner for %s: %s", instance.instance_id, exc)
            self.inbox.put_nowait(RunnerStartFailed(instance.instance_id, time.time()))
            return
        self.processes[runner_id] = process
        view = RunnerView(
            runner_id=runner_id, instance_id=instance.instance_id, model=instance.model,
            slots=slots,
        )
        self.inbox.put_nowait(RunnerSpawned(view))

    async def send(self, runner_id: str, command: RunnerCommand) -> bool:
        """Write a command; False when the runner is gone (its RunnerExited is then on its
        way, or already handled) - logged here, and never silent to the caller."""
        process = self.processes.get(runner_id)
        if process is None:
            log.warning("runner %s is gone: %s not sent", runner_id, command.type)
            return False
        try:
            await process.send(command)
        except (RunnerNotRunning, ConnectionError) as exc:
            log.warning("runner %s: %s not sent: %s", runner_id, command.type, exc)
            return False
        return True

    def stop(self, runner_id: str) -> None:
        if (process := self.processes.get(runner_id)) and runner_id not in self.stopping:
            self.stopping.add(runner_id)
            self.owner.spawn(f"stop runner {runner_id}", process.stop(timeout=10.0))

    def abandon(self, runner_id: str) -> None:
        """A runner that refused a task (its pipe is closed) is dying or dead: make sure it is
        dead, so its RunnerExited comes and the tasks in flight there end runner_crashed."""
        if (process := self.processes.get(runner_id)) is not None:
            process.kill_now()

    def exited(self, exited: RunnerExited) -> bool:
        """Forget a runner; True when it crashed (it was not asked to stop)."""
        self.processes.pop(exited.runner_id, None)
        asked = exited.runner_id in self.stopping
        self.stopping.discard(exited.runner_id)
        return not asked and exited.returncode != 0

    async def stop_all(self, timeout: float) -> None:
        await asyncio.gather(
            *(p.stop(timeout=timeout) for p in self.processes.values()), return_exceptions=True
        )
