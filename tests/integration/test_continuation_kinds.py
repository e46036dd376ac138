"""Continuation of the kinds of output where a seam is easiest to break: a JSON schema, a forced
tool call (the grammar is replayed over the generated tokens), sampling without a request seed
(the seed the worker fixed is reused), and an image whose runner crashed between steps.

Real processes: nats-server, `fleet worker`s with their runner subprocesses, mlx-lm on tiny-llm,
mflux on tiny-flux2. Each continued stream is compared with the same request run without a
kill in the same test, both live and replayed from FLEET_OUT.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from fleet.models.catalog import get_card
from fleet.wire.events import (
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.tasks import ChatMessage, ImageGeneration, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import (
    ENV,
    NO_EOS,
    Live,
    assert_came_back_here,
    assert_one_clean_stream,
    dedup,
    finished_of,
    place_on,
    run_whole,
    runner_pid,
)
from tests.integration.harness import WorkerProcess, client, events_of, submit, wait_node

# Tokens into the answer. Small against the answer's length: between the test seeing this
# token and its SIGKILL landing, the runner goes on (~400 tokens/s alone; longer when the test
# itself is slow to wake on a loaded machine), and the kill must still land mid-answer.
KILL_AT = 10
LONG = 450  # characters of the story: 150-450 tokens of tiny-llm
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": LONG, "maxLength": LONG + 50}},
    "required": ["story"],
    "additionalProperties": False,
}
TELL = {"type": "function", "function": {"name": "tell", "parameters": STORY}}
KINDS: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": STORY}},
    "tool_call": {"tools": [TELL], "tool_choice": {"type": "function", "name": "tell"}},
    "unseeded": {"temperature": 0.8, "logit_bias": NO_EOS, "max_tokens": 300},
}


def story(task_id: str, kind: str, **extra: Any) -> TextGeneration:
    fields = {"temperature": 0.0, "max_tokens": 800, **KINDS[kind], **extra}
    return TextGeneration(
        task_id=task_id, model="tiny-llm",
        messages=[ChatMessage(role="user", content=f"Tell me a long story ({kind})")], **fields,
    )


async def check_continued(
    nc: Client, live: Live, task_id: str, kind: str, reference: list[OutputEvent] | None
) -> list[TaskAccepted]:
    """The continued task's stream, stored and live, equals its uninterrupted run (for the
    unseeded kind: run afterwards with the seed the first attempt recorded)."""
    stored = await events_of(nc, task_id)
    accepted = [e for e in stored if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1], accepted
    assert accepted[1].continued_from >= KILL_AT
    if reference is None:
        seeds = {e.seed for e in accepted}
        assert len(seeds) == 1 and None not in seeds, seeds  # fixed once, reused
        reference = await run_whole(nc, story(f"ref-{task_id}", kind, seed=seeds.pop()))
    for events in (stored, dedup([e for _, e in live.events[task_id]])):
        assert_one_clean_stream(events, reference)
        assert calls_of(events) == calls_of(reference)
    if kind == "json_schema":
        text = "".join(e.text for e in stored if isinstance(e, TokenChunk))
        assert len(json.loads(text)["story"]) >= LONG
    if kind == "tool_call":
        [(name, arguments)] = calls_of(stored)
        assert name == "tell" and len(json.loads(arguments)["story"]) >= LONG
    return accepted


# Between the test seeing token KILL_AT and its SIGKILL landing the runner goes on; beside a
# CPU hog a whole answer (a few hundred tokens at ~400/s) once ended in that gap, so the kill
# hit nothing. Such a round proves nothing either way and is tried again with a new task.
KILL_TRIES = 3


async def kill_missed(nc: Client, task_id: str) -> bool:
    """True when the task completed in its first attempt: the kill came after its end."""
    stored = await events_of(nc, task_id)
    attempts = [e.attempt for e in stored if isinstance(e, TaskAccepted)]
    return attempts == [0] and finished_of(stored).status == "completed"


def calls_of(events: list[OutputEvent]) -> list[tuple[str, str]]:
    return [(e.name, e.arguments) for e in events if isinstance(e, ToolCallChunk)]


async def until_mid_answer(live: Live, task_id: str) -> bool:
    """True once the task has streamed KILL_AT tokens and not ended; False if it ended first
    (on a saturated machine the test's loop once woke only after a whole 200-token answer had
    arrived): such a round is tried again with a new task."""
    return await live.until(
        lambda: (not live.done(task_id) and live.tokens(task_id) >= KILL_AT and "mid")
        or (live.done(task_id) and "ended"), 120) == "mid"


async def test_structured_and_unseeded_answers_continue_exactly_after_worker_kills(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    card = get_card("tiny-llm")
    nodes: dict[str, WorkerProcess] = {}

    async def add_worker(name: str) -> None:
        worker = start_worker(name, **ENV)
        node = await wait_node(nc, worker.data_dir)
        nodes[node] = worker
        await place_on(nc, card, node)

    await add_worker("a")
    await add_worker("b")
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    for round_no, kind in enumerate(KINDS):
        reference = None if kind == "unseeded" else await run_whole(nc, story(f"ref-{kind}", kind))
        for try_ in range(KILL_TRIES):
            task_id = f"cont-{kind}-{try_}"
            await submit(nc, story(task_id, kind))
            if await until_mid_answer(live, task_id):
                break
        else:
            raise AssertionError(f"{kind}: every answer ended before its kill")
        victim = live.node_running(task_id)
        assert victim is not None
        nodes.pop(victim).kill()  # SIGKILL of worker and runner, whichever node runs it
        accepted = await check_continued(nc, live, task_id, kind, reference)
        assert accepted[1].node_id != victim
        if round_no + 1 < len(KINDS):
            await add_worker(f"{kind}-fresh")  # two workers again for the next kind
    await nc.close()


async def test_structured_and_unseeded_answers_continue_exactly_after_a_runner_kill(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    """One kind at a time, so each is mid-answer when its runner dies whatever the machine's
    load: all three at once needed them in one batch, and on a loaded machine the first could
    end before the last had started. No worker dies here, so AckWait is long: the message is
    held throughout only if the worker's beats (every AckWait/4) keep up, and beside a CPU hog
    (load 15-22) a 2 s AckWait ran out once and the task was taken over."""
    worker = start_worker("a", **{**ENV, "FLEET_ACK_WAIT_S": "30"})
    nc = await client(nats_url)
    await place_on(nc, get_card("tiny-llm"), await wait_node(nc, worker.data_dir))
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    for kind in KINDS:  # each round's runner is the restart of the one killed before
        reference = None if kind == "unseeded" else await run_whole(nc, story(f"ref-{kind}", kind))
        for round_ in range(KILL_TRIES):
            task_id = f"cont-{kind}-{round_}"
            await submit(nc, story(task_id, kind))
            if not await until_mid_answer(live, task_id):
                continue
            [*_, running] = [e for _, e in live.events[task_id] if isinstance(e, TaskAccepted)]
            os.kill(runner_pid(running.runner_id), signal.SIGKILL)
            if not await kill_missed(nc, task_id):
                break
        accepted = await check_continued(nc, live, task_id, kind, reference)
        # No other runner of the model was ready on the node: the message went back to the
        # stream at once and, with no other worker, came back here.
        assert_came_back_here(accepted, worker)
    await nc.close()


async def test_an_image_task_whose_runner_crashes_between_steps_ends_with_the_same_bytes(
    nats_url: str, start_worker: WorkerFactory, tiny_flux2_dir: Path
) -> None:
    model = "tiny-flux2"
    nc = await client(nats_url)
    worker = start_worker("a", models={model: tiny_flux2_dir}, **ENV)
    record = await place_on(nc, get_card(model), await wait_node(nc, worker.data_dir))

    def draw(task_id: str) -> ImageGeneration:
        return ImageGeneration(
            task_id=task_id, model=model, prompt="a lighthouse", size="128x128", steps=40,
            seed=7, partial_images=4,
        )

    reference = await run_whole(nc, draw("ref-image"))
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    await submit(nc, draw("crashed-image"))
    await live.until(lambda: any(
        isinstance(e, ImageChunk) for _, e in live.events.get("crashed-image", [])
    ), 120)
    os.kill(runner_pid(record.runner_id), signal.SIGKILL)  # a preview is out, the final is not
    stored = await events_of(nc, "crashed-image")
    assert finished_of(stored).status == "completed", finished_of(stored)
    wanted = {key_of(e): e.sha256 for e in reference if isinstance(e, ImageChunk)}
    for events in (stored, [e for _, e in live.events["crashed-image"]]):
        images = [e for e in events if isinstance(e, ImageChunk)]
        keys = [key_of(e) for e in images]
        assert len(keys) == len(set(keys)), f"an image or preview announced twice: {keys}"
        assert keys.count((0, None)) == 1
        assert all(wanted[key_of(e)] == e.sha256 for e in images)  # the final: the same bytes
    accepted = [e for e in stored if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1]
    await nc.close()


def key_of(image: ImageChunk) -> tuple[int, int | None]:
    return image.image_index, image.partial_index
