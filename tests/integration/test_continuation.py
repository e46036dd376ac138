"""A worker SIGKILLed mid-answer: the other worker continues each of its text tasks from the next
token, and the stream equals, token for token, the same request run without a kill.

Real processes: nats-server, two `fleet worker`s with their runner subprocesses, mlx-lm on
tiny-llm. The kill takes the worker's whole process group (worker and runner), as a power
loss would. The seam (kill -> first token of the continuation, seen by a live subscriber) is
printed; AckWait is 2 s here, so it is about AckWait + one prefill. The chaos run (a kill
every ~10 s) is in test_continuation_chaos.py; more kinds of output in
test_continuation_kinds.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from nats.aio.client import Client

from fleet.models.catalog import get_card
from fleet.wire import subjects
from fleet.wire.codec import decode_event
from fleet.wire.events import (
    ErrorReason,
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    token_indexes,
)
from fleet.wire.tasks import ChatMessage, ImageGeneration, TextGeneration
from tests.gateway_process import GatewayProcess
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import (
    ENV,
    NO_EOS,
    Live,
    assert_came_back_here,
    assert_one_clean_stream,
    dedup,
    finished_of,
    first_after,
    place_on,
    run_whole,
    runner_pid,
)
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    client,
    events_of,
    submit,
    wait_node,
)
from tests.integration.killing import kill_mid_task

# the openai client is imported where used, not at the top: collection imports this module
# in every xdist worker (0.7 s of CPU; issue 28).
if TYPE_CHECKING:
    import openai

SAMPLERS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "seed": 1234},
    "frequency": {"frequency_penalty": 1.2},
    "top-p-logprobs": {"temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": True},
    "json": {"response_format": {"type": "json_object"}},  # the grammar is replayed
}


# Long enough that a kill at token ~40 lands mid-answer under load: tiny-llm makes a 240-token
# answer in about a second now, and a loaded test process (the client of `live`) lagged that
# much behind it (CI at load ~10: "the task ended before the kill").
LONG = 1200


def request(task_id: str, sampler: str, max_tokens: int) -> TextGeneration:
    fields = {"temperature": 0.0, **SAMPLERS[sampler]}
    return TextGeneration(
        task_id=task_id, model="tiny-llm", max_tokens=max_tokens, logit_bias=NO_EOS,
        messages=[ChatMessage(role="user", content=f"Tell me a long story ({sampler})")],
        **fields,
    )


async def test_a_worker_killed_mid_answer_is_continued_token_for_token(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    workers = [start_worker("a", **ENV), start_worker("b", **ENV)]
    nc = await client(nats_url)
    nodes: dict[str, WorkerProcess] = {}
    for worker in workers:
        node = await wait_node(nc, worker.data_dir)
        nodes[node] = worker
        await place_on(nc, get_card("tiny-llm"), node)
    # The same requests, uninterrupted, first: the reference each continued stream must equal.
    references = await asyncio.gather(*(
        run_whole(nc, request(f"ref-{name}", name, LONG)) for name in SAMPLERS
    ))
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    for name in SAMPLERS:
        await submit(nc, request(f"cont-{name}", name, LONG))
    # Kill the worker running the first task once it is well into its answer.
    first = "cont-greedy"
    await live.until(lambda: live.tokens(first) >= 40 or live.done(first), 120)
    victim_node = live.node_running(first)
    if live.done(first) or victim_node is None:
        pytest.fail("the task ended before the kill: make it longer")
    killed_at = time.monotonic()
    nodes[victim_node].kill()
    # The seam: the first token after the kill, from the continuing attempt.
    resumed = await live.until(lambda: first_after(live, first), 120)
    print(f"\nworker kill seam (SIGKILL -> next token): {resumed - killed_at:.2f} s "
          "(AckWait 2 s)")
    for name, reference in zip(SAMPLERS, references, strict=True):
        stored = await events_of(nc, f"cont-{name}")  # replayed from FLEET_OUT
        assert_one_clean_stream(stored, reference)
        assert_one_clean_stream(dedup([e for _, e in live.events[f"cont-{name}"]]), reference)
    accepted = [e for e in await events_of(nc, first) if isinstance(e, TaskAccepted)]
    assert len(accepted) == 2 and accepted[1].continued_from > 0
    assert accepted[1].node_id != victim_node
    await nc.close()


async def test_a_runner_killed_mid_answer_is_continued_on_its_restart_token_for_token(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker("a", **ENV)
    nc = await client(nats_url)
    record = await place_on(nc, get_card("tiny-llm"), await wait_node(nc, worker.data_dir))
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    references = {name: await run_whole(nc, request(f"ref-{name}", name, LONG))
                  for name in SAMPLERS}
    for name in SAMPLERS:
        await submit(nc, request(f"cont-{name}", name, LONG))
    tasks = [f"cont-{name}" for name in SAMPLERS]
    # Every task's output has begun: a task its runner took but that has streamed nothing yet
    # ends runner_crashed with it (a task that kills runners before its first token is not run
    # again: fleet.worker.continuation.output_began). Beside a CPU hog the last task's first
    # token once came after the first task's whole answer, so the kill may find some ended:
    # the seam is read on a task it caught.
    await live.until(lambda: all(live.tokens(task) >= 1 for task in tasks), 120)
    assert not all(live.done(task) for task in tasks), "every task ended before the kill"
    killed_at = time.monotonic()
    os.kill(runner_pid(record.runner_id), signal.SIGKILL)
    # A task may also end in the gap between that check and the kill landing (its terminal
    # came first: no attempt 1, and no token after the kill).
    caught = await live.until(
        lambda: [task for task in tasks if first_after(live, task) is not None], 120)
    first = caught[0]
    resumed = first_after(live, first) or killed_at
    print(f"\nrunner crash seam (SIGKILL -> next token): {resumed - killed_at:.2f} s "
          "(runner restart and model load included)")
    for name, reference in references.items():
        stored = await events_of(nc, f"cont-{name}")
        assert_one_clean_stream(stored, reference)
        assert_one_clean_stream(dedup([e for _, e in live.events[f"cont-{name}"]]), reference)
    accepted = [e for e in await events_of(nc, first) if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1] and accepted[1].continued_from >= 1
    # No other runner of the model was ready on its node, so the worker gave the message back
    # at once (a ready runner elsewhere would have taken it over); none was, so it came back
    # here, to the restarted runner.
    assert_came_back_here(accepted, worker)
    await nc.close()


async def test_an_image_task_whose_worker_dies_between_steps_ends_with_the_same_bytes(
    nats_url: str, start_worker: WorkerFactory, tiny_flux2_dir: Path
) -> None:
    model = "tiny-flux2"
    nc = await client(nats_url)

    async def start(name: str) -> tuple[WorkerProcess, str]:
        worker = start_worker(name, models={model: tiny_flux2_dir}, **ENV)
        node = await wait_node(nc, worker.data_dir)
        await place_on(nc, get_card(model), node)
        return worker, node

    def draw(task_id: str) -> ImageGeneration:
        return ImageGeneration(
            task_id=task_id, model=model, prompt="a lighthouse", size="128x128", steps=40,
            seed=7, partial_images=4,
        )

    # Killed between steps: a preview is out, the final is not.
    killed = await kill_mid_task(
        nc, draw("restarted-image"), start, lambda e: isinstance(e, ImageChunk))
    reference = await run_whole(nc, draw("ref-image"))  # the second worker, not killed
    events = killed.events
    assert finished_of(events).status == "completed"
    images = [e for e in events if isinstance(e, ImageChunk)]
    keys = [(e.image_index, e.partial_index) for e in images]
    assert len(keys) == len(set(keys)), "an image or preview announced twice"
    [final] = [e for e in images if e.partial_index is None]
    [want] = [e for e in reference if isinstance(e, ImageChunk) and e.partial_index is None]
    assert final.sha256 == want.sha256  # restarted from step 0 with the same seed
    previews = {e.partial_index: e.sha256 for e in images if e.partial_index is not None}
    wanted = {e.partial_index: e.sha256 for e in reference if isinstance(e, ImageChunk)}
    assert all(wanted[index] == sha for index, sha in previews.items())
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1]
    await nc.close()


async def test_the_openai_client_never_sees_the_kill_n2_seeded(
    nats_url: str, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    import openai
    workers = [start_worker("a", **ENV), start_worker("b", **ENV)]
    nc = await client(nats_url)
    nodes: dict[str, WorkerProcess] = {}
    for worker in workers:
        node = await wait_node(nc, worker.data_dir)
        nodes[node] = worker
        await place_on(nc, get_card("tiny-llm"), node)
    gateway = GatewayProcess(nats_url, tmp_path / "gateway")
    try:
        url = await gateway.listening()
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        ask = {
            "model": "tiny-llm", "n": 2, "seed": 99, "temperature": 0.8, "max_tokens": 1500,
            "logit_bias": {"2": -100}, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story"}],
        }
        reference = await asyncio.to_thread(_stream, api, ask, None)
        live = Live()
        await nc.subscribe("fleet.out.>", cb=live.on_msg)
        killed: list[str] = []
        loop = asyncio.get_running_loop()

        def kill_mid_answer() -> None:  # called from the streaming thread at chunk 40
            # The client's chunk 40 says little of where the runners are: under load the
            # client lagged a whole 1,500-token answer behind them (CI: the victim's choice
            # had ended, attempts [0]). So both workers (each a process group: worker and
            # runner) are frozen while the victim is chosen from what FLEET_OUT stored: a
            # choice without a stored terminal cannot end before the kill.
            for worker in nodes.values():
                os.killpg(worker.process.pid, signal.SIGSTOP)
            try:
                found = asyncio.run_coroutine_threadsafe(_unfinished(nc, live), loop).result(70)
                assert found is not None, "every choice was whole before the client's chunk 40"
                task_id, node = found
                killed.append(task_id)
                nodes[node].kill()
            finally:
                for worker in nodes.values():
                    if worker.process.poll() is None:
                        os.killpg(worker.process.pid, signal.SIGCONT)

        got = await asyncio.to_thread(_stream, api, ask, kill_mid_answer)
        assert killed, "the answer ended before the kill"
        assert got.texts == reference.texts  # each choice, token for token
        assert got.finish == reference.finish
        accepted = [e for e in await events_of(nc, killed[0]) if isinstance(e, TaskAccepted)]
        assert [e.attempt for e in accepted] == [0, 1]  # it was continued, unseen
    finally:
        gateway.stop()
    await nc.close()


async def _unfinished(nc: Client, live: Live) -> tuple[str, str] | None:
    """A choice accepted and without a stored terminal, and the node it runs on; its workers
    are frozen, so the live subscriber catches up with both choices' acceptances."""
    await live.until(lambda: sum(bool(live.node_running(t)) for t in live.events) >= 2, 60)
    js = nc.jetstream()
    for task_id in sorted(live.events):
        stored = await js.get_last_msg(subjects.OUT_STREAM, subjects.out(task_id))
        if not isinstance(decode_event(stored.data or b""), TaskFinished):
            return task_id, live.node_running(task_id) or ""
    return None


@dataclass
class Streamed:
    texts: dict[int, str]
    finish: dict[int, str | None]
    task_ids: set[str]


def _stream(
    api: openai.OpenAI, ask: dict[str, Any], at_chunk_40: Callable[[], None] | None
) -> Streamed:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for count, chunk in enumerate(api.chat.completions.create(**ask)):
        if count == 40 and at_chunk_40 is not None:
            at_chunk_40()
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return Streamed(texts, finish, set())


async def _until_event(live: Live, task_id: str, check: Callable[[OutputEvent], bool]) -> None:
    await live.until(lambda: any(check(e) for _, e in live.events.get(task_id, [])), 60)


def _is_attempt(attempt: int) -> Callable[[OutputEvent], bool]:
    return lambda e: isinstance(e, TaskAccepted) and e.attempt == attempt


async def _fault_worker(
    nc: Client, start_worker: WorkerFactory, name: str, **env: str
) -> WorkerProcess:
    worker = start_worker(name, **ENV, **env)
    card = add_fault_card(worker.data_dir)
    await place_on(nc, card, await wait_node(nc, worker.data_dir))
    return worker


def _fault_task(task_id: str, **fields: Any) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content="tokens:40 delay_ms:100")], **fields,
    )


async def test_a_kill_during_the_continuations_prefill_is_continued_again(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    first = await _fault_worker(nc, start_worker, "a")
    await submit(nc, _fault_task("twice"))
    await _until_event(live, "twice", lambda e: isinstance(e, TokenChunk) and e.next_index > 3)
    first.kill()
    second = await _fault_worker(nc, start_worker, "b")
    await _until_event(live, "twice", _is_attempt(1))
    second.kill()  # accepted, not a token yet: in the continuation's own prefill
    await _fault_worker(nc, start_worker, "c")
    events = await events_of(nc, "twice")
    tokens = [e for e in events if isinstance(e, TokenChunk)]
    assert token_indexes(tokens) == list(range(40))
    assert "".join(t.text for t in tokens) == "".join(f" t{i}" for i in range(40))
    result = finished_of(events)
    assert result.status == "completed", (result.reason, result.message, result.usage)
    assert [e.attempt for e in events if isinstance(e, TaskAccepted)][-1] == 2
    await nc.close()


async def test_three_kills_in_a_row_exhaust_max_continuations_and_end_worker_lost(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    # Each worker death uses a delivery: three kills and the continuation that gives up need
    # four; exactly four, so a delivery too many would show as max_deliveries.
    four = {"FLEET_MAX_DELIVER": "4"}
    worker = await _fault_worker(nc, start_worker, "a", **four)
    await submit(nc, _fault_task("doomed", max_continuations=2))
    await _until_event(live, "doomed", lambda e: isinstance(e, TokenChunk))
    for attempt in (1, 2):  # each continuation killed two tokens into its own output
        worker.kill()
        worker = await _fault_worker(nc, start_worker, f"w{attempt}", **four)
        await _until_event(live, "doomed", _is_attempt(attempt))
        await live.until(
            lambda: live.tokens("doomed") >= 2 + _tokens_at_attempt(live, "doomed"), 60
        )
    worker.kill()  # the third kill: both continuations are used up
    await _fault_worker(nc, start_worker, "last", **four)
    events = await events_of(nc, "doomed")
    result = finished_of(events)
    assert (result.status, result.reason) == ("failed", ErrorReason.WORKER_LOST)
    assert "max_continuations 2" in (result.message or "")
    assert [e.attempt for e in events if isinstance(e, TaskAccepted)] == [0, 1, 2]
    tokens = token_indexes(events)
    assert tokens == list(range(len(tokens)))  # what was streamed stays one clean stream
    await nc.close()


def _tokens_at_attempt(live: Live, task_id: str) -> int:
    """How many tokens had arrived when the latest attempt was accepted."""
    count = seen = 0
    for _, event in live.events.get(task_id, []):
        if isinstance(event, TokenChunk):
            count += 1
        elif isinstance(event, TaskAccepted):
            seen = count
    return seen
