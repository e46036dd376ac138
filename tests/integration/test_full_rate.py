"""64 fault-engine streams at full rate through one `fleet up`: each arrives whole and in order,
over HTTP (the gateway's SSE) and over NATS (a plain subscriber of `fleet.out.<task_id>`).

At full rate the runner coalesces a task's tokens (fleet.runner.coalesce): a token event carries
several tokens, so the check is on tokens, and that coalescing did happen is checked too.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from pathlib import Path

import httpx
import orjson
import pytest
from nats.aio.msg import Msg

from bench.fleet_stack import FleetStack
from bench.plumbing_rate import MODEL, seed_fault_card
from fleet.bus.connect import js_publish
from fleet.wire import subjects
from fleet.wire.codec import decode_events
from fleet.wire.events import OutputEvent, TaskFinished, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration

STREAMS = 64
TOKENS = 200
EXPECTED_TEXT = "".join(f" t{i}" for i in range(TOKENS))

pytestmark = pytest.mark.timeout(300)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")) if p)
    env.setdefault("MLX_DISABLE_COMPILE", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


async def _http_stream(client: httpx.AsyncClient, base_url: str) -> tuple[str, int, int]:
    """(content, usage completion tokens, content frames) of one streamed chat."""
    body = {"model": MODEL, "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"tokens:{TOKENS}"}]}
    text, usage, frames = [], -1, 0
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if content := (choice.get("delta") or {}).get("content"):
                    text.append(content)
                    frames += 1
    return "".join(text), usage, frames


async def _nats_task(stack: FleetStack) -> list[OutputEvent]:
    assert stack.nc is not None
    task_id = f"rate-{secrets.token_hex(6)}"
    events: list[OutputEvent] = []
    done = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            events.append(event)
            if isinstance(event, TaskFinished):
                done.set()

    sub = await stack.nc.subscribe(subjects.out(task_id), cb=on_event)
    try:
        await js_publish(stack.nc.jetstream(), subjects.tasks(MODEL), TextGeneration(
            task_id=task_id, model=MODEL, max_tokens=TOKENS,
            messages=[ChatMessage(role="user", content=f"tokens:{TOKENS}")]), msg_id=task_id)
        await asyncio.wait_for(done.wait(), 120)
    finally:
        await sub.unsubscribe()
    return events


@pytest.mark.skipif(sys.platform != "linux", reason="fleet up's process tree is read via psutil")
async def test_64_full_rate_streams_arrive_whole_and_in_order(tmp_path: Path) -> None:
    data_dir = tmp_path / "fleet-data"
    seed_fault_card(data_dir)
    stack = FleetStack(data_dir, [MODEL], STREAMS, _env())
    await stack.start()
    try:
        limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
        async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
            over_http = await asyncio.gather(
                *(_http_stream(client, stack.base_url) for _ in range(STREAMS)))
        over_nats = await asyncio.gather(*(_nats_task(stack) for _ in range(STREAMS)))
    finally:
        await stack.stop()

    for text, usage, _ in over_http:
        assert (text, usage) == (EXPECTED_TEXT, TOKENS)
    for events in over_nats:
        assert token_indexes(events) == list(range(TOKENS)), "a gap, a repeat or a swap"
        tokens = [e for e in events if isinstance(e, TokenChunk)]
        assert "".join(t.text for t in tokens) == EXPECTED_TEXT
        assert [i for t in tokens for i in t.ids] == list(range(TOKENS))
        assert tokens[0].count == 1  # the first token is never held
        terminals = [e for e in events if isinstance(e, TaskFinished)]
        assert len(terminals) == 1 and events[-1] is terminals[0]
        assert terminals[0].status == "completed"
    # Full rate: tokens travelled together, in fewer events (and SSE frames) than tokens.
    events_sent = sum(1 for events in over_nats for e in events if isinstance(e, TokenChunk))
    assert events_sent < STREAMS * TOKENS / 2
    assert sum(frames for _, _, frames in over_http) < STREAMS * TOKENS / 2
