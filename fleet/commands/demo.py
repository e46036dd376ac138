"""`fleet demo`: the whole product in one command. It starts the embedded stack, asks
SmolLM2 a question through the OpenAI-compatible gateway, generates an image with
tiny-flux2 through the same gateway, saves it, and stops."""

from __future__ import annotations

import argparse
import base64
import logging
import sys
import time
from pathlib import Path

import orjson

from fleet.bus.connect import connect_with, redact_urls
from fleet.commands.stack import stack
from fleet.config import Settings, settings_of
from fleet.errors import FleetError
from fleet.proc import Exit, run_main
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import DecodeError, decode_model

CHAT_MODEL = "smollm2-135m"
IMAGE_MODEL = "tiny-flux2"
QUESTION = "What is the capital of France?"


async def wait_ready(settings: Settings, models: list[str], timeout: float) -> None:
    """Until every model has a runner in state ready (first use converts SmolLM2: seconds)."""
    nc = await connect_with(settings, "fleet-demo")
    try:
        kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
        watcher = await kv.watchall()
        ready: set[str] = set()
        deadline = time.monotonic() + timeout
        while not set(models) <= ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FleetError(f"runners not ready after {timeout:.0f} s: {set(models) - ready}")
            try:
                entry = await watcher.updates(timeout=remaining)
            except TimeoutError:
                continue
            if entry is None or not entry.value:
                continue
            try:
                record = decode_model(RunnerRecord, entry.value)
            except DecodeError:
                continue
            if record.status.state in ("ready", "running"):
                if record.model not in ready:
                    print(f"  runner for {record.model} is ready", file=sys.stderr)
                ready.add(record.model)
            elif record.status.state == "failed":
                raise FleetError(f"runner for {record.model} failed: {record.status}")
        await watcher.stop()
    finally:
        await nc.close()


async def chat(base: str) -> str:
    body = {
        "model": CHAT_MODEL, "stream": True, "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    answer = []
    task_id = ""
    print(f"\n> {QUESTION}\n< ", end="", flush=True)
    import httpx  # imported here: every `fleet` process builds this module's parser

    async with httpx.AsyncClient(timeout=300) as client, client.stream(
        "POST", f"{base}/chat/completions", json=body
    ) as response:
        if response.status_code != 200:
            raise FleetError(f"chat failed: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            task_id = chunk.get("id", task_id)  # the gateway's completion id is the task id
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                answer.append(text)
                print(text, end="", flush=True)
    print(f"\n  its trace, later (with `fleet nats` running): fleet trace {task_id}")
    return "".join(answer)


async def image(base: str, out: Path) -> Path:
    body = {"model": IMAGE_MODEL, "prompt": "a lighthouse at dusk", "size": "128x128",
            "response_format": "b64_json", "seed": 7}
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        response = await client.post(f"{base}/images/generations", json=body)
    if response.status_code != 200:
        raise FleetError(f"image failed: {response.status_code} {response.text}")
    out.write_bytes(base64.b64decode(response.json()["data"][0]["b64_json"]))
    return out


async def run_demo(settings: Settings, timeout: float, exit_: Exit | None = None) -> int:
    # The demo's output is the answer: an access-log line would land in the middle of it.
    for chatty in ("httpx", "uvicorn", "uvicorn.error", "fleet.gateway.access"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    print("fleet demo: starting nats-server, a worker and the gateway…", file=sys.stderr)
    async with stack(settings, [CHAT_MODEL, IMAGE_MODEL], exit_) as running:
        base = f"http://{running.gateway_host}:{running.gateway_port}/v1"
        print(f"  NATS {redact_urls(running.urls)}; gateway {base}", file=sys.stderr)
        print(f"  dashboard {base.removesuffix('/v1')}/ui", file=sys.stderr)
        print(f"  API docs  {base.removesuffix('/v1')}/docs", file=sys.stderr)
        await wait_ready(running, [CHAT_MODEL, IMAGE_MODEL], timeout)
        answer = await chat(base)
        path = await image(base, running.data_dir / "demo-image.png")
        print(f"\nimage from {IMAGE_MODEL} (random weights: coloured noise) saved to {path}")
    ok = "paris" in answer.lower()
    print("fleet demo: done" if ok else "fleet demo: the answer did not mention Paris")
    return 0 if ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the embedded stack, chat, make an image, stop")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for runners")
    # run_main, as `fleet up`: signals stop it within its grace, and it leaves without native
    # teardown, which aborts once mlx converted SmolLM2 in this process (see fleet.proc).
    p.set_defaults(func=lambda a: run_main(lambda exit_: run_demo(
        settings_of(a), a.timeout, exit_
    )))
