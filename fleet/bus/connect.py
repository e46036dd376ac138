"""Connecting to NATS, and publishing with the headers every Fleet message carries.

Every process connects through `connect_with(settings, name)`: the server list, credentials
(a .creds file, an NKey seed, user and password) and TLS all come from Settings. No secret
is ever logged: URLs go through `redact_url` before they reach a log line or an error.
Each connection makes its inboxes under `_INBOX.<role or user>` (nats-py's `inbox_prefix`),
the only inboxes the shipped roles may read (docs/permissions.md).
A permission violation the server reports is logged once as one line naming the subject and
kept (fleet.bus.denials): a health check reads it, and a publish refused so fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import nats.errors as nats_errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from pydantic import BaseModel

from fleet.bus.denials import parse_permission_error, record, refused_by_permission
from fleet.bus.replies import inbox_prefix
from fleet.bus.retry import with_retry
from fleet.bus.server_version import check_server_version
from fleet.errors import NatsUnavailable, ServerTooOld
from fleet.telemetry import inject_headers, send_span
from fleet.wire.codec import encode

if TYPE_CHECKING:
    from fleet.config import Settings

log = logging.getLogger(__name__)

MSG_ID = "Nats-Msg-Id"
# Tries per server before the first connection is declared impossible (a restart gets two).
FIRST_CONNECT_ATTEMPTS = 1
# A dead server behind a live socket (a partition, a SIGSTOPped server) is noticed after
# PING_INTERVAL_S * MAX_OUTSTANDING_PINGS: nats-py's defaults (120 s x 2) would leave a worker
# talking to nobody for four minutes while its heartbeat expires elsewhere.
PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 3
# While reconnecting, nats-py reports each failed attempt (two a second): one line per
# distinct error per this many seconds is enough to tell the operator.
REPEAT_WARNING_S = 10.0
_USERINFO = re.compile(r"(\w+://)([^:/@\s]+):([^@/\s]+)@")


def redact_url(url: str) -> str:
    """`nats://user:secret@host` → `nats://user:***@host`; a bare token becomes `***`."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if not parts.username and not parts.password:
        return url
    user = parts.username or ""
    hidden = f"{user}:***" if parts.password is not None else "***"
    host = parts.hostname or ""
    netloc = f"{hidden}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact_text(text: str) -> str:
    """Redact every `scheme://user:password@` inside free text (errors that quote a URL)."""
    return _USERINFO.sub(lambda m: f"{m.group(1)}{m.group(2)}:***@", text)


def redact_urls(urls: Sequence[str]) -> str:
    return ", ".join(redact_url(url) for url in urls)


@dataclass(frozen=True)
class ConnectOptions:
    """How this process proves who it is to NATS; "" means not used."""

    creds: str = ""  # a .creds file (JWT + NKey seed)
    nkey: str = ""  # a file holding an NKey seed
    user: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectOptions:
        return cls(
            creds=settings.nats_creds, nkey=settings.nats_nkey, user=settings.nats_user,
            password=settings.nats_password, tls_ca=settings.nats_tls_ca,
            tls_cert=settings.nats_tls_cert, tls_key=settings.nats_tls_key,
        )

    def tls_context(self, servers: Sequence[str]) -> ssl.SSLContext | None:
        """A context when any server is `tls://` or any TLS file is set; None otherwise."""
        wants_tls = any(url.startswith("tls://") for url in servers)
        if not (wants_tls or self.tls_ca or self.tls_cert):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca or None)
        if self.tls_cert:
            context.load_cert_chain(self.tls_cert, self.tls_key or None)
        return context


def server_list(servers: str | Sequence[str]) -> list[str]:
    """nats-py wants a list: a comma-separated string crashes it (`invalid connect url`)."""
    raw = servers.split(",") if isinstance(servers, str) else list(servers)
    return [url.strip() for url in raw if url.strip()]


def inbox_owner(user: str, role: str) -> str:
    """Whose inboxes a connection makes: its NATS user when that is one subject token (the
    generated users are the roles), else the role of the process (a .creds or NKey login, an
    open server). The shipped roles may subscribe to `_INBOX.<role>.>` only."""
    return user if user and re.fullmatch(r"[A-Za-z0-9_-]+", user) else role


async def connect_with(
    settings: Settings, name: str, *, connect_timeout: float = 5.0, role: str = "client"
) -> Client:
    """The one way a Fleet process connects: servers, credentials and TLS from Settings;
    `role` names its inboxes when the settings name no user (fleet.bus.replies)."""
    return await connect(
        settings.urls, name, connect_timeout=connect_timeout,
        options=ConnectOptions.from_settings(settings),
        inbox_owner=inbox_owner(settings.nats_user, role),
    )


async def connect(
    servers: str | Sequence[str],
    name: str,
    *,
    connect_timeout: float = 5.0,
    options: ConnectOptions | None = None,
    inbox_owner: str = "client",
) -> Client:
    """Connect with endless reconnects after the first success; a first failure is a clear
    NatsUnavailable naming the (redacted) servers. Every inbox the connection makes (request
    replies, JetStream pulls, KV and object reads, publish acks) is under
    `_INBOX.<inbox_owner>`: the only inboxes its role may subscribe to."""
    urls = server_list(servers)
    options = options or ConnectOptions()
    shown = redact_urls(urls)

    first_errors: list[Exception] = []  # what the first connection met, for its error
    last_warned: dict[str, float] = {}  # error text -> when it was last logged

    async def on_error(exc: Exception) -> None:
        text = redact_text(str(exc) or type(exc).__name__)
        if not connected:
            first_errors.append(exc)
            log.debug("nats: connecting to %s: %s", shown, text)
            return
        if denied := parse_permission_error(text):
            record(denied)
            log.error(
                "nats: permission denied: %s to %s (the NATS user of %s may not do this)",
                denied.operation, denied.subject, name,
            )
            return
        now = time.monotonic()
        if now - last_warned.get(text, -REPEAT_WARNING_S) >= REPEAT_WARNING_S:
            last_warned[text] = now
            log.warning("nats: %s", text)

    async def on_disconnect() -> None:
        if not (client.is_closed or client.is_draining):  # a close we asked for is no news
            log.warning("nats: disconnected from %s, reconnecting", _current(client, shown))

    async def on_reconnect() -> None:
        last_warned.clear()  # the next outage is news again
        log.info("nats: reconnected to %s", _current(client, shown))

    connected = False
    extra: dict[str, object] = {}
    if options.creds:
        extra["user_credentials"] = options.creds
    if options.nkey:
        extra["nkeys_seed"] = options.nkey
    if options.user:
        extra["user"] = options.user
    if options.password:
        extra["password"] = options.password
    client = Client()
    try:
        if tls := options.tls_context(urls):
            extra["tls"] = tls
        await client.connect(
            urls,
            name=name,
            connect_timeout=connect_timeout,
            allow_reconnect=True,
            # nats-py retries a first connection forever with -1: bounded here, and endless
            # reconnects once connected (below).
            max_reconnect_attempts=FIRST_CONNECT_ATTEMPTS,
            reconnect_time_wait=0.5,
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            inbox_prefix=inbox_prefix(inbox_owner),
            **extra,  # type: ignore[arg-type]
        )
    except (nats_errors.Error, OSError, TimeoutError, ssl.SSLError) as exc:
        with contextlib.suppress(Exception):
            await client.close()
        # nats-py's close() swallows a CancelledError that lands while it waits for its
        # reconnect task: a cancel of the caller must not turn into a retried NatsUnavailable
        # (seen: a gateway with no NATS could never stop its connect loop).
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise asyncio.CancelledError from None
        causes = [*first_errors, exc]
        if any(isinstance(cause, nats_errors.AuthorizationError) for cause in causes):
            raise NatsUnavailable(
                f"NATS at {shown} refused this process's credentials"
            ) from None
        cause = next((c for c in reversed(causes) if not isinstance(c, nats_errors.NoServersError)),
                     exc)
        detail = redact_text(str(cause) or type(cause).__name__)
        raise NatsUnavailable(f"cannot reach NATS at {shown}: {detail}") from None
    try:
        check_server_version(client)
    except ServerTooOld:
        await client.close()
        raise
    connected = True
    client.options["max_reconnect_attempts"] = -1  # never give up once connected
    return client


def _current(client: Client, fallback: str) -> str:
    url = client.connected_url
    return redact_url(url.geturl()) if url else fallback


def headers_for(
    msg_id: str | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Nats-Msg-Id for de-duplication plus the current trace context (traceparent, tracestate)."""
    headers = dict(extra or {})
    if msg_id:
        headers[MSG_ID] = msg_id
    inject_headers(headers)
    return headers


async def publish(
    nc: Client, subject: str, message: BaseModel, *, msg_id: str | None = None
) -> None:
    """Core publish: no confirmation. For what may be lost (hints, live-only signals)."""
    await nc.publish(subject, encode(message), headers=headers_for(msg_id))


async def js_publish(
    js: JetStreamContext,
    subject: str,
    message: BaseModel,
    *,
    msg_id: str | None = None,
    timeout: float = 5.0,
    budget_s: float | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> PubAck:
    """JetStream publish awaiting the stream's ack (tasks, terminal events), inside a `send`
    span: the message's traceparent names that span as the parent of its consumers' spans.

    Retried on transient errors within the broker budget (fleet.bus.retry); with a msg_id
    the retry is idempotent: the stream keeps the first copy and acks the others as duplicates.
    """
    body = encode(message)

    async def once() -> PubAck:
        return await refused_by_permission(
            lambda: js.publish(subject, body, headers=headers, timeout=timeout), subject)

    with send_span(subject, msg_id, len(body)):
        # inside the span: its consumers' parent is this send
        headers = headers_for(msg_id, extra_headers)
        if budget_s is None:
            return await with_retry(once, what=f"publish to {subject}")
        return await with_retry(once, what=f"publish to {subject}", budget_s=budget_s)
