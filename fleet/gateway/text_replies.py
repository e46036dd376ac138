"""Fleet events in, OpenAI text responses out: chat.completion, text_completion, their
chunks, and the renderers that stream them. Pure functions of the events; no I/O, no clock.

Streamed lines carry the event's index as the SSE `id:`: a client that loses the connection
resumes from /v1/tasks/{id}/events?after=<last id> (OpenAI clients ignore the field).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fleet.bus.task_events import Indexed
from fleet.errors import FleetError
from fleet.gateway.relay import SSE_DONE, sse, sse_error
from fleet.wire.events import (
    ErrorChunk,
    OutputEvent,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    Usage,
)


@dataclass
class TextResult:
    """What a text task produced, folded from its events in order."""

    tokens: list[TokenChunk] = field(default_factory=list)
    tool_calls: list[ToolCallChunk] = field(default_factory=list)
    last_error: ErrorChunk | None = None
    finished: TaskFinished | None = None

    def add(self, event: OutputEvent) -> None:
        match event:
            case TokenChunk():
                self.tokens.append(event)
            case ToolCallChunk():
                self.tool_calls.append(event)
            case ErrorChunk():
                self.last_error = event
            case TaskFinished():
                self.finished = event

    @property
    def text(self) -> str:
        return "".join(token.text for token in self.tokens)


def finish_reason(finished: TaskFinished, has_tool_calls: bool) -> str:
    return finished.finish_reason or ("tool_calls" if has_tool_calls else "stop")


def usage_json(usage: Usage | None) -> dict[str, Any]:
    """OpenAI's usage object; cached prompt tokens go where OpenAI reports its prompt cache."""
    usage = usage or Usage()
    details: dict[str, int] = {"cached_tokens": usage.cached_tokens}
    if usage.images:  # Fleet's own: how many input images the vision cache saved encoding
        details |= {"images": usage.images, "cached_images": usage.cached_images}
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": details,
    }


def _token_logprob(token: TokenChunk) -> dict[str, Any]:
    return {
        "token": token.text,
        "logprob": token.logprob,
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": top.token, "logprob": top.logprob, "bytes": list(top.token.encode())}
            for top in token.top_logprobs or []
        ],
    }


def chat_logprobs(tokens: list[TokenChunk]) -> dict[str, Any]:
    return {"content": [_token_logprob(t) for t in tokens], "refusal": None}


def completion_logprobs(tokens: list[TokenChunk], offset: int = 0) -> dict[str, Any]:
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{top.token: top.logprob for top in t.top_logprobs or []} for t in tokens],
        "text_offset": offsets,
    }


def tool_call_json(call: ToolCallChunk) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def merged_usage(usages: Iterable[Usage | None], per_prompt: int | None = None) -> Usage:
    """The usage of the choices of one request: each prompt counted once (as OpenAI does; the
    choices come in runs of `per_prompt` per prompt, None: all of one prompt), the
    completions summed."""
    present = [usage or Usage() for usage in usages]
    firsts = present[::per_prompt] if per_prompt else present[:1]
    prompt = sum(usage.prompt_tokens for usage in firsts)
    cached = sum(usage.cached_tokens for usage in firsts)
    completion = sum(usage.completion_tokens for usage in present)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, cached_tokens=cached,
                 images=sum(usage.images for usage in firsts),
                 cached_images=sum(usage.cached_images for usage in firsts))


@dataclass(frozen=True)
class Reply:
    """What every response of one request shares. `choice_ids`: the task of each choice, in
    choice order, when the request asked for more than one."""

    task_id: str
    model: str
    created: int
    logprobs: bool = False
    include_usage: bool = False
    choice_ids: tuple[str, ...] = ()
    per_prompt: int | None = None  # choices per prompt, for a completion with prompts
    echo: tuple[str, ...] = ()  # each choice's prompt, when its text starts with it

    @property
    def choices(self) -> int:
        return len(self.choice_ids) or 1

    def choice_of(self, task_id: str) -> int:
        return self.choice_ids.index(task_id) if self.choice_ids else 0

    def by_choice(self, events: Iterable[OutputEvent]) -> list[TextResult]:
        results = [TextResult() for _ in range(self.choices)]
        for event in events:
            results[self.choice_of(event.task_id)].add(event)
        return results

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.task_id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, results: list[TextResult]) -> dict[str, Any]:
        usages = [r.finished.usage if r.finished else None for r in results]
        return usage_json(merged_usage(usages, self.per_prompt))

    def echoed(self, index: int) -> str:
        return self.echo[index] if self.echo else ""

    def chat_completion(self, results: list[TextResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            assert result.finished is not None
            message: dict[str, Any] = {
                "role": "assistant", "content": result.text, "refusal": None,
            }
            if result.tool_calls:
                message["tool_calls"] = [tool_call_json(call) for call in result.tool_calls]
                message["content"] = result.text or None
            choices.append({
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(result.tokens) if self.logprobs else None,
                "finish_reason": finish_reason(result.finished, bool(result.tool_calls)),
            })
        envelope = self._envelope("chat.completion")
        return {**envelope, "choices": choices, "usage": self._usage(results)}

    def text_completion(self, results: list[TextResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            assert result.finished is not None
            choices.append({
                "index": index,
                "text": self.echoed(index) + result.text,
                "logprobs": completion_logprobs(result.tokens) if self.logprobs else None,
                "finish_reason": finish_reason(result.finished, False),
            })
        envelope = self._envelope("text_completion")
        return {**envelope, "choices": choices, "usage": self._usage(results)}

    def _chat_chunk(self, delta: dict[str, Any], index: int = 0, **choice: Any) -> dict[str, Any]:
        chunk = {
            **self._envelope("chat.completion.chunk"),
            "choices": [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                 **choice}
            ],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chat_opening(self) -> list[dict[str, Any]]:
        return [self._chat_chunk({"role": "assistant", "content": ""}, index)
                for index in range(self.choices)]

    def chat_chunks(self, event: OutputEvent, tool_calls_seen: int) -> list[dict[str, Any]]:
        """The chunks one event becomes (`tool_calls_seen`: of the event's choice so far)."""
        index = self.choice_of(event.task_id)
        match event:
            case TokenChunk():
                logprobs = chat_logprobs([event]) if self.logprobs else None
                return [self._chat_chunk({"content": event.text}, index, logprobs=logprobs)]
            case ToolCallChunk():
                call = {"index": tool_calls_seen, **tool_call_json(event)}
                return [self._chat_chunk({"tool_calls": [call]}, index)]
            case TaskFinished():
                reason = finish_reason(event, tool_calls_seen > 0)
                return [self._chat_chunk({}, index, finish_reason=reason)]
        return []

    def usage_chunk(self, kind: str, usages: Iterable[Usage | None]) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
        merged = merged_usage(usages, self.per_prompt)
        return {**self._envelope(kind), "choices": [], "usage": usage_json(merged)}

    def _completion_chunk(self, text: str, index: int = 0, **choice: Any) -> dict[str, Any]:
        chunk = {
            **self._envelope("text_completion"),
            "choices": [
                {"index": index, "text": text, "logprobs": None, "finish_reason": None,
                 **choice}
            ],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def completion_echo(self, index: int) -> dict[str, Any]:
        return self._completion_chunk(self.echo[index], index)

    def completion_chunks(self, event: OutputEvent, text_offset: int) -> list[dict[str, Any]]:
        """The chunks one event becomes (`text_offset`: of the event's choice so far)."""
        index = self.choice_of(event.task_id)
        match event:
            case TokenChunk():
                logprobs = completion_logprobs([event], text_offset) if self.logprobs else None
                return [self._completion_chunk(event.text, index, logprobs=logprobs)]
            case TaskFinished():
                reason = finish_reason(event, False)
                return [self._completion_chunk("", index, finish_reason=reason)]
        return []


class _TextRenderer:
    """What chat and completion streams share: one reply, per-choice progress, and the usage
    chunk once the last choice has finished. With several choices the SSE lines carry no
    `id:`: event indexes are per task, and a resumable stream has one choice."""

    kind = ""
    # Token events that arrived together render as one chunk (fleet.gateway.token_runs): a
    # chunk's text is any piece of the answer, and its `id:` the last event it covers.
    merges_tokens = True

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.usages: dict[str, Usage | None] = {}

    def _event_id(self, item: Indexed) -> int | None:
        return item.index if self.reply.choices == 1 else None

    def _finished(self, item: Indexed, event: TaskFinished) -> list[bytes]:
        self.usages[event.task_id] = event.usage
        if not self.reply.include_usage or len(self.usages) < self.reply.choices:
            return []
        usages = [self.usages.get(task_id) for task_id in self.reply.choice_ids or self.usages]
        return [sse(self.reply.usage_chunk(self.kind, usages), event_id=self._event_id(item))]

    def closing(self) -> list[bytes]:
        return [SSE_DONE]

    def failed(self, exc: FleetError) -> list[bytes]:
        return [sse_error(exc)]


class ChatRenderer(_TextRenderer):
    kind = "chat.completion.chunk"

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply)
        self.tool_calls_seen: dict[int, int] = {}

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        return self.reply.chat_completion(self.reply.by_choice(events))

    def opening(self) -> list[bytes]:
        return [sse(chunk) for chunk in self.reply.chat_opening()]

    async def lines(self, item: Indexed) -> list[bytes]:
        choice = self.reply.choice_of(item.event.task_id)
        seen = self.tool_calls_seen.get(choice, 0)
        chunks = self.reply.chat_chunks(item.event, seen)
        if isinstance(item.event, ToolCallChunk):
            self.tool_calls_seen[choice] = seen + 1
        lines = [sse(chunk, event_id=self._event_id(item)) for chunk in chunks]
        if isinstance(item.event, TaskFinished):
            lines += self._finished(item, item.event)
        return lines


class CompletionRenderer(_TextRenderer):
    kind = "text_completion"

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply)
        self.text_offsets: dict[int, int] = {}

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        return self.reply.text_completion(self.reply.by_choice(events))

    def opening(self) -> list[bytes]:
        """With echo, each choice's prompt comes first, as a chunk of its own."""
        return [sse(self.reply.completion_echo(index)) for index in range(len(self.reply.echo))]

    async def lines(self, item: Indexed) -> list[bytes]:
        choice = self.reply.choice_of(item.event.task_id)
        offset = self.text_offsets.get(choice, 0)
        chunks = self.reply.completion_chunks(item.event, offset)
        if isinstance(item.event, TokenChunk):
            self.text_offsets[choice] = offset + len(item.event.text)
        lines = [sse(chunk, event_id=self._event_id(item)) for chunk in chunks]
        if isinstance(item.event, TaskFinished):
            lines += self._finished(item, item.event)
        return lines
