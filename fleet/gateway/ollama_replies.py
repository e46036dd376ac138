"""Fleet events in, Ollama's replies out: /api/chat and /api/generate as one JSON object, or
as NDJSON lines (one per event, the last with `done: true` and the counts and durations).
Pure functions of the events; the times come from the events and the request's start.

Durations are in nanoseconds, as Ollama gives them: `total_duration` from the request's
arrival to the task's end, `prompt_eval_duration` from the runner taking the task to its first
token (queueing and prefill), `eval_duration` from the first token to the end. Fleet loads
models when they are placed, not per request: `load_duration` is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

from fleet.bus.task_events import Indexed
from fleet.errors import FleetError
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk, ToolCallChunk

NDJSON = "application/x-ndjson"


def ndjson(data: dict[str, Any]) -> bytes:
    return orjson.dumps(data) + b"\n"


def error_json(exc: FleetError) -> dict[str, str]:
    """Ollama's error shape: the words only (the HTTP status says the rest)."""
    return {"error": exc.message}


def timestamp(unix_s: float) -> str:
    """RFC 3339 in UTC with a Z, as Ollama writes `created_at`."""
    moment = datetime.fromtimestamp(unix_s, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def done_reason(finished: TaskFinished) -> str:
    # Ollama ends a turn with tool calls as "stop", the calls in its message.
    return "length" if finished.finish_reason == "length" else "stop"


def tool_call_json(call: ToolCallChunk) -> dict[str, Any]:
    """Ollama's tool call: the arguments as an object, not OpenAI's JSON string."""
    try:
        arguments = orjson.loads(call.arguments or "{}")
    except orjson.JSONDecodeError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    return {"function": {"name": call.name, "arguments": arguments}}


@dataclass
class Timings:
    """What the counts and durations come from, seen as the events pass."""

    started: float  # unix time the request arrived
    accepted: float | None = None
    first_token: float | None = None

    def see(self, event: OutputEvent) -> None:
        if isinstance(event, TaskAccepted) and self.accepted is None:
            self.accepted = event.at
        elif isinstance(event, TokenChunk | ToolCallChunk) and self.first_token is None:
            self.first_token = event.at

    def stats(self, finished: TaskFinished) -> dict[str, Any]:
        usage = finished.usage
        accepted = self.accepted if self.accepted is not None else self.started
        first = self.first_token if self.first_token is not None else finished.at
        return {
            "done": True,
            "done_reason": done_reason(finished),
            "total_duration": _ns(finished.at - self.started),
            "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens if usage else 0,
            "prompt_eval_duration": _ns(first - accepted),
            "eval_count": usage.completion_tokens if usage else 0,
            "eval_duration": _ns(finished.at - first),
        }


@dataclass(frozen=True)
class OllamaReply:
    model: str
    kind: Literal["chat", "generate"]
    started: float  # unix time the request arrived

    def part(self, at: float, text: str = "", tool_calls: list[dict[str, Any]] | None = None,
             ) -> dict[str, Any]:
        """One reply object without its end: a chat's `message`, a generation's `response`."""
        head: dict[str, Any] = {"model": self.model, "created_at": timestamp(at)}
        if self.kind == "generate":
            return {**head, "response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {**head, "message": message}

    def loaded(self, at: float) -> dict[str, Any]:
        """The answer to an empty /api/generate prompt: the model is there to use."""
        return {**self.part(at), "done": True, "done_reason": "load"}


class OllamaRenderer:
    """An Ollama reply, whole (`body`) or as NDJSON lines (the relay's Renderer)."""

    def __init__(self, reply: OllamaReply) -> None:
        self.reply = reply
        self.timings = Timings(reply.started)

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        finished: TaskFinished | None = None
        for event in events:
            self.timings.see(event)
            match event:
                case TokenChunk():
                    text.append(event.text)
                case ToolCallChunk():
                    calls.append(tool_call_json(event))
                case TaskFinished():
                    finished = event
        assert finished is not None  # the relay answers only a finished task
        part = self.reply.part(finished.at, "".join(text), calls)
        return {**part, **self.timings.stats(finished)}

    def opening(self) -> list[bytes]:
        return []

    async def lines(self, item: Indexed) -> list[bytes]:
        event = item.event
        self.timings.see(event)
        match event:
            case TokenChunk():
                return [ndjson({**self.reply.part(event.at, event.text), "done": False})]
            case ToolCallChunk():
                part = self.reply.part(event.at, tool_calls=[tool_call_json(event)])
                return [ndjson({**part, "done": False})]
            case TaskFinished():
                return [ndjson({**self.reply.part(event.at), **self.timings.stats(event)})]
        return []

    def closing(self) -> list[bytes]:
        return []

    def failed(self, exc: FleetError) -> list[bytes]:
        """A stream that fails after it began ends with Ollama's error line (its client
        raises ResponseError on it)."""
        return [ndjson(error_json(exc))]
