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
from fleet.gateway.replies import SSE_DONE, Reply, gather, sse
from fleet.gateway.streams import Indexed
from fleet.wire.events import ImageChunk, OutputEvent, TokenChunk, ToolCallChunk


class Renderer(Protocol):
    async def body(self, events: list[OutputEvent]) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    async def lines(self, item: Indexed) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...


class ChatRenderer:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.tool_calls_seen = 0

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        return self.reply.chat_completion(gather(events))

    def opening(self) -> list[bytes]:
        return [sse(self.reply.chat_opening())]

    async def lines(self, item: Indexed) -> list[bytes]:
        chunks = self.reply.chat_chunks(item.event, self.tool_calls_seen)
        if isinstance(item.event, ToolCallChunk):
            self.tool_calls_seen += 1
        return [sse(chunk, event_id=item.index) for chunk in chunks]

    def closing(self) -> list[bytes]:
        return [SSE_DONE]


class CompletionRenderer:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.text_offset = 0

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        return self.reply.text_completion(gather(events))

    def opening(self) -> list[bytes]:
        return []

    async def lines(self, item: Indexed) -> list[bytes]:
        chunks = self.reply.completion_chunks(item.event, self.text_offset)
        if isinstance(item.event, TokenChunk):
            self.text_offset += len(item.event.text)
        return [sse(chunk, event_id=item.index) for chunk in chunks]

    def closing(self) -> list[bytes]:
        return [SSE_DONE]


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
