"""Error answers in another API's shape: an ASGI middleware that holds back each response with
an error status under one path (they are small and whole), rewrites its body with that API's
`reshape(status, body)`, and lets everything else stream through. So refusals made before a
route runs (a missing key, a body too large, an unserved route) get the shape as well."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ErrorShapes:
    def __init__(self, app: ASGIApp, path: str, reshape: Callable[[int, bytes], bytes]) -> None:
        self.app = app
        self.path = path
        self.reshape = reshape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.path):
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
            new_body = self.reshape(start["status"], body)
            headers = [(name, value) for name, value in start.get("headers", [])
                       if name.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", str(len(new_body)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body})

        await self.app(scope, receive, reshaped)
