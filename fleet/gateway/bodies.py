"""A request's body: the cap and the read timeout while it streams in, JSON, and the OpenAI request
models' base and shared fields; and the image bytes that arrive over HTTP (data URLs, URLs of
images this gateway stores, and the format sniffed from the bytes themselves).

The middlewares are plain ASGI so that a body over the cap is refused while it streams in,
not after it has been buffered.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.errors import FleetError, InvalidRequest, PayloadTooLarge, RequestTimeout
from fleet.gateway.errors import error_response, invalid_from

log = logging.getLogger(__name__)


M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_from(exc) from None


def refuse_with(exc: FleetError) -> ASGIApp:
    response = error_response(exc)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, send)

    return app


class BodyLimit:
    """413 for a declared Content-Length over the cap, and for a body that grows past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = PayloadTooLarge(f"the request body is over {self.max_bytes} bytes")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await refuse_with(too_large)(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large
            return message

        await self.app(scope, counted, send)


class BodyTimeout:
    """408 for a request whose body takes longer than `seconds` to arrive (a slow client
    holding a connection and a buffer); once the body is in, `receive` is left alone."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.seconds
        complete = False

        async def timed() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.seconds:g} s"
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, timed, send)


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


Timeout = Annotated[float, Field(gt=0, le=3600, description="Fleet: seconds before a 504")]


def deadline_after(now: datetime, timeout_s: float) -> datetime:
    return now.astimezone(UTC) + timedelta(seconds=timeout_s)


_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[^,;]*)*?;base64,(?P<data>.*)$", re.S
)


_STORED_URL = re.compile(r"(?:^|/v1/images/)(?P<sha>[0-9a-f]{64})$")


def stored_image(url: str) -> str | None:
    """The sha256 a /v1/images/<sha256> URL (or a bare hash) names, else None."""
    stored = _STORED_URL.search(url)
    return stored["sha"] if stored else None


def image_reference(url: str) -> str | bytes:
    """The sha256 of an image this gateway already stores, or the bytes of a data URL."""
    if (sha := stored_image(url)) is not None:
        return sha
    match = _DATA_URL.match(url)
    if not match:
        raise InvalidRequest(
            "image_url must be an http(s) URL (chat), a base64 data: URL or a "
            "/v1/images/<sha256> URL of this gateway"
        )
    try:
        data = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("image_url: the data URL is not valid base64") from None
    if image_format(data) is None:
        raise InvalidRequest("image_url: only PNG, JPEG and WebP images are supported")
    return data


def image_format(data: bytes) -> Literal["png", "jpeg", "webp"] | None:
    """Sniff the format from magic bytes; never trust a declared content type."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None
