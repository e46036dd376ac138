"""An image task whose runner finished it while its image was still uploading, and whose runner
is then killed before the upload ends (issue 27): the task ends once, `completed`, after its
image, and is not run again (the suspected race: `_continue_after_crash` re-queued it while
the old finish went on to ack it).

Real processes: nats-server, a `fleet worker` with its runner subprocess, mflux on tiny-flux2.
Deterministic: the worker's upload waits on a FIFO (the fault knob FLEET_FAULT_UPLOAD_GATE,
fleet/worker/image_outputs.py) until the test has seen the terminal queued behind it (the
worker's log) and the killed runner's restart ready (FLEET_RUNNERS), and only then lets the
upload go.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from fleet.bus.task_log import TaskLog
from fleet.models.catalog import get_card
from fleet.wire import subjects
from fleet.wire.events import ImageChunk, TaskAccepted, TaskFinished
from fleet.wire.tasks import ImageGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import ENV, Live, place_on, runner_pid
from tests.integration.harness import (
    WorkerProcess,
    client,
    events_of,
    submit,
    until_queue_empty,
    wait_node,
    wait_runner,
)

MODEL = "tiny-flux2"
QUEUED = "its terminal waits behind an image upload"


async def until_logged(worker: WorkerProcess, text: str, timeout: float = 120) -> None:
    """Until the worker's log holds `text` (a bounded poll of its log file: the worker says
    nothing on NATS while its upload is held)."""
    async with asyncio.timeout(timeout):
        while text not in worker.log():
            await asyncio.sleep(0.1)


async def open_gate(gate: Path) -> None:
    """Let the held upload go: open the FIFO for writing (blocks until the upload reads)."""

    def write() -> None:
        with gate.open("wb") as fifo:
            fifo.write(b"go\n")

    await asyncio.wait_for(asyncio.to_thread(write), 60)


async def test_a_runner_killed_while_its_finished_image_task_uploads_ends_it_once_after_its_image(
    nats_url: str, start_worker: WorkerFactory, tiny_flux2_dir: Path, tmp_path: Path
) -> None:
    gate = tmp_path / "upload-gate"
    os.mkfifo(gate)
    nc = await client(nats_url)
    worker = start_worker("a", models={MODEL: tiny_flux2_dir},
                          FLEET_FAULT_UPLOAD_GATE=str(gate), **ENV)
    record = await place_on(nc, get_card(MODEL), await wait_node(nc, worker.data_dir))
    task = ImageGeneration(task_id="ending-image", model=MODEL, prompt="a lighthouse",
                           size="128x128", steps=4, seed=7, partial_images=1)
    live = Live()
    await nc.subscribe(subjects.out(task.task_id), cb=live.on_msg)
    await submit(nc, task)
    await open_gate(gate)  # the preview's upload
    await live.until(lambda: any(isinstance(e, ImageChunk) for _, e in
                                 live.events.get(task.task_id, [])), 120)
    # Its output began (a crash now would be continued); the final's upload is held.
    await until_logged(worker, QUEUED)  # the runner's terminal came, its image still uploads
    runners = await (await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)).watchall()
    os.kill(runner_pid(record.runner_id), signal.SIGKILL)
    # Its restart ready: a task re-queued by the crash would be dispatched to it now, and run
    # on after the old terminal acks it (attempt 1 in its stored events).
    await wait_runner(runners, MODEL, ("ready",), other_than=record.runner_id)
    await open_gate(gate)  # the final's upload

    await events_of(nc, task.task_id)  # up to its terminal
    await until_queue_empty(nc.jetstream())  # and its message acked
    events = await TaskLog(nc).stored(task.task_id)
    terminals = [e for e in events if isinstance(e, TaskFinished)]
    assert len(terminals) == 1 and terminals[0].status == "completed", terminals
    assert isinstance(events[-1], TaskFinished)  # after its image
    images = [e for e in events if isinstance(e, ImageChunk)]
    assert [(e.image_index, e.partial_index) for e in images] == [(0, 0), (0, None)]
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0], "the finished task was run again"
    await nc.close()
