"""How each endpoint turns a task's events into its response: one renderer per endpoint kind.

Text renderers are pure wrappers of `replies.Reply`; the image renderer reads image bytes from
FLEET_IMAGES because OpenAI's image responses carry base64, while Fleet's events carry hashes.
Streamed lines carry the event's index as the SSE `id:`: a client that loses the connection
resumes from /v1/tasks/{id}/events?after=<last id> (OpenAI clients ignore the field).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fleet.errors import NatsUnavailable
from fleet.gateway.backend import Backend
from fleet.gateway.images import StreamKind, encode_b64, images_response, stream_event
from fleet.gateway.replies import SSE_DONE, Reply, sse
from fleet.gateway.streams import Indexed
from fleet.wire.events import (
    ImageChunk,
    OutputEvent,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    Usage,
)


class Renderer(Protocol):
    async def body(self, events: list[OutputEvent]) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    async def lines(self, item: Indexed) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...


class _TextRenderer:
    """What chat and completion streams share: one reply, per-choice progress, and the usage
    chunk once the last choice has finished. With several choices the SSE lines carry no
    `id:`: event indexes are per task, and a resumable stream has one choice."""

    kind = ""

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
        return []

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


class ImageRenderer:
    def __init__(
        self,
        backend: Backend,
        kind: StreamKind,
        created: int,
        wants_url: bool,
        url_of: Callable[[str], str],
    ) -> None:
        self.backend = backend
        self.kind = kind
        self.created = created
        self.wants_url = wants_url
        self.url_of = url_of

    async def _b64(self, sha256: str) -> str:
        data = await self.backend.get_image(sha256)
        if data is None:
            raise NatsUnavailable(f"image {sha256} was announced but is not in the store")
        return encode_b64(data)

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        finals = [e for e in events if isinstance(e, ImageChunk) and e.partial_index is None]
        hashes = {chunk.sha256 for chunk in finals}
        b64 = {} if self.wants_url else {sha: await self._b64(sha) for sha in hashes}
        urls = {sha: self.url_of(sha) for sha in hashes}
        return images_response(finals, self.created, self.wants_url, b64, urls)

    def opening(self) -> list[bytes]:
        return []

    async def lines(self, item: Indexed) -> list[bytes]:
        chunk = item.event
        if not isinstance(chunk, ImageChunk):
            return []
        b64 = await self._b64(chunk.sha256)
        name, data = stream_event(chunk, b64, self.kind, self.created, self.url_of(chunk.sha256))
        return [sse(data, event=name, event_id=item.index)]

    def closing(self) -> list[bytes]:
        return []
