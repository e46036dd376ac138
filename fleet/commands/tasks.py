"""Task verbs from the shell: submit, follow, cancel. They send the same JSON a NATS CLI user
publishes on `fleet.tasks.<model>` and print what arrives on `fleet.out.<task_id>`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

from nats.js import JetStreamContext

from fleet import telemetry
from fleet.bus.connect import connect_with, js_publish
from fleet.bus.records import CancelRecords
from fleet.config import Settings, settings_of
from fleet.errors import InvalidRequest
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task, encode
from fleet.wire.events import ErrorChunk, ImageChunk, OutputEvent, TaskFinished, TokenChunk
from fleet.wire.tasks import CancelTask, ChatMessage, ResponseFormat, TextGeneration


def new_task_id(prefix: str = "cli") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def render(event: OutputEvent, raw: bool) -> str | None:
    """One line per event with --json; otherwise only the text a person wants to read."""
    if raw:
        return encode(event).decode() + "\n"
    match event:
        case TokenChunk(text=text):
            return text
        case ImageChunk(sha256=sha, partial_index=None, width=w, height=h, format=fmt):
            return f"\n[image {w}x{h} {fmt} {sha}]\n"
        case ErrorChunk(reason=reason, message=message):
            return f"\n[error {reason.value}: {message}]\n"
        case TaskFinished(status=status, usage=usage, stats=stats, reason=reason):
            tail = f"{status}" + (f" ({reason.value})" if reason else "")
            if usage:
                tail += f", {usage.completion_tokens} tokens"
            if stats and stats.tokens_per_s:
                tail += f", {stats.tokens_per_s:.1f} tok/s"
            return f"\n[{tail}]\n"
    return None


async def follow_task(
    settings: Settings, task_id: str, raw: bool, timeout: float, wait: bool = False
) -> int:
    """Print a task's events to its end (exit 0 when it completed). A task with no stored
    events is unknown, expired or still queued: exit 1 at once, unless `wait`."""
    from fleet.bus.task_events import TaskEvents

    nc = await connect_with(settings, "fleet-cli")
    try:
        if await stored_events(nc.jetstream(), task_id) == 0:
            if not wait:
                print(f"fleet follow: no events are stored for task {task_id}: unknown, "
                      "expired, or still queued (--wait waits for a queued task)",
                      file=sys.stderr, flush=True)
                return 1
            print(f"fleet follow: no events are stored for task {task_id} yet: waiting up to "
                  f"{timeout:.0f} s", file=sys.stderr, flush=True)
        deadline = asyncio.get_running_loop().time() + timeout
        async with TaskEvents(nc.jetstream(), task_id, deadline) as events:
            async for item in events:
                if (line := render(item.event, raw)) is not None:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if isinstance(item.event, TaskFinished):
                    return 0 if item.event.status == "completed" else 1
    finally:
        await nc.close()
    return 1


async def stored_events(js: JetStreamContext, task_id: str) -> int:
    """How many events FLEET_OUT holds for the task (0: unknown, expired or not yet taken)."""
    from fleet.bus.task_log import TaskLog

    return await TaskLog(js._nc, js).count(task_id, budget_s=5.0)


def response_format(json_mode: bool, schema_file: str | None) -> ResponseFormat | None:
    """--json-mode / --json-schema FILE as the task's response format (None: free text)."""
    if schema_file is None:
        return ResponseFormat(type="json_object") if json_mode else None
    try:
        schema = json.loads(Path(schema_file).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"--json-schema {schema_file}: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"--json-schema {schema_file}: a JSON Schema is a JSON object")
    return ResponseFormat(type="json_schema", json_schema=schema)


async def submit_task(settings: Settings, args: argparse.Namespace) -> int:
    if args.file:
        data = Path(args.file).read_bytes() if args.file != "-" else sys.stdin.buffer.read()
        try:
            task = decode_task(data)
        except DecodeError as exc:
            raise InvalidRequest(f"{args.file}: {exc}") from None
    elif not args.prompt.strip():
        raise InvalidRequest("fleet submit needs a prompt: fleet submit 'your message' "
                             "(or --file TASK.json)")
    else:
        task = TextGeneration(
            task_id=new_task_id(), model=args.model, max_tokens=args.max_tokens,
            temperature=args.temperature, seed=args.seed,
            messages=[ChatMessage(role="user", content=args.prompt)],
            response_format=response_format(args.json_mode, args.json_schema),
        )
    nc = await connect_with(settings, "fleet-cli")
    telemetry.export_to_nats(lambda: nc)
    try:
        await js_publish(nc.jetstream(), subjects.tasks(task.model, task.priority), task,
                         msg_id=task.task_id)
        await telemetry.flush()  # the send span, before the connection closes
    finally:
        await nc.close()
    print(f"task {task.task_id} on {subjects.tasks(task.model, task.priority)}", file=sys.stderr)
    if args.no_follow:
        return 0
    return await follow_task(settings, task.task_id, args.json, args.timeout, wait=True)


async def cancel_task(settings: Settings, task_id: str) -> int:
    nc = await connect_with(settings, "fleet-cli")
    try:
        cancel = CancelTask(task_id=task_id, reason="fleet cancel")
        records = await CancelRecords.open(nc.jetstream(), budget_s=5.0)
        # Recorded as well as announced: honoured even if the task is still queued.
        await records.send(cancel)
        await nc.flush()
        started = await stored_events(nc.jetstream(), task_id) > 0
    finally:
        await nc.close()
    print(f"cancel sent for {task_id}")
    if not started:
        print(f"fleet cancel: task {task_id} has no events: it is still queued (the cancel "
              "ends it when a worker takes it), or unknown or expired", file=sys.stderr)
    return 0



def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("submit", help="publish a task and follow its output")
    p.add_argument("prompt", nargs="?", default="", help="the user message (chat)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--file", help="publish this task JSON instead ('-' for stdin)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-mode", action="store_true", help="the reply is a JSON object")
    shape.add_argument("--json-schema", metavar="FILE", help="the reply matches this JSON Schema")
    p.add_argument("--json", action="store_true", help="print every event as JSON")
    p.add_argument("--no-follow", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=lambda a: asyncio.run(submit_task(settings_of(a), a)))

    p = subparsers.add_parser("follow", help="print a task's events (replays from the start)")
    p.add_argument("task_id")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--wait", action="store_true",
                   help="wait for a task that has no events yet (still queued)")
    p.set_defaults(func=lambda a: asyncio.run(
        follow_task(settings_of(a), a.task_id, a.json, a.timeout, wait=a.wait)
    ))

    p = subparsers.add_parser("cancel", help="cancel a task (queued or running)")
    p.add_argument("task_id")
    p.set_defaults(func=lambda a: asyncio.run(cancel_task(settings_of(a), a.task_id)))
