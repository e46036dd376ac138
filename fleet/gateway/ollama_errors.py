"""Every error answer under /api/ in Ollama's shape, `{"error": "..."}`: the routes' own, the
relay's (a task that failed after it was published), and those made before a route runs (a
missing key, a body too large or too slow, an unknown /api/ path), whatever made them. The
status and headers (x-fleet-task-id, retry-after) stay; only the body changes. Answers that
are not errors stream through untouched; an error answer is small and whole, so it is held
until its end."""

from __future__ import annotations

from http import HTTPStatus

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATH = "/api/"


def ollama_error_body(status: int, body: bytes) -> bytes:
    """The body of an error answer in Ollama's shape (pure): OpenAI's `error.message`, an
    Ollama-shaped body as it is, and words for the status when the body has none."""
    try:
        found = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        found = None
    error = found.get("error") if isinstance(found, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        error = error["message"]
    if not isinstance(error, str) or not error:
        try:
            error = HTTPStatus(status).phrase.lower()
        except ValueError:
            error = f"error {status}"
    return orjson.dumps({"error": error})


class OllamaErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        start: Message | None = None
        body = b""

        async def reshaped(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            new_body = ollama_error_body(start["status"], body)
            headers = [(name, value) for name, value in start.get("headers", [])
                       if name.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", str(len(new_body)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body})

        await self.app(scope, receive, reshaped)
