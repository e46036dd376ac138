"""Tenants: API keys, who owns which task and image, and how many requests each may have
waiting.

A keys file (`FLEET_API_KEYS_FILE`) holds one JSON object a line, `#` lines are comments:

    {"tenant": "team-a", "sha256": "<hex sha256 of the key>"}
    {"tenant": "ops", "sha256": "<hex sha256>", "operator": true}

An operator tenant may change the fleet from the dashboard (place and remove instances, read
dead letters) and sees every tenant's tasks there; the others see only their own. It is a
property of the tenant, so every line of one tenant must say the same.

Only hashes are stored. A plain SHA-256 is enough here, and a slow salted hash would be worse:
the keys `fleet gateway keys add` makes are 256 random bits, which no brute force reverses,
while scrypt or argon2 cost tens of ms of CPU per request (a denial-of-service lever on an
endpoint anyone can hit) and, being salted, would need a comparison against every entry.
With a plain hash a presented key is looked up in a dict: constant work, and timing tells
nothing about keys (it depends only on the hash of what was sent). Keys an operator chose
by hand must be as random as generated ones; that is their responsibility.

`FLEET_API_KEYS` (comma-separated plain keys) stays for the simple case: each key is its
own tenant, named `key-<first 12 hex of its sha256>` (never the key itself).

Which tenant owns a task id or an image is kept in the KV bucket FLEET_TENANTS. The gateway
writes `task.<task_id>` = a TaskRecord (tenant, the API asked, an n > 1 request's choices)
before it publishes a task, open gateway or not (kept 1 h, as long as FLEET_OUT keeps the
task's events) and `image.<sha256>.<tenant>` for every image a tenant's
tasks produced or that it sent (kept 7 d, as long as FLEET_IMAGES keeps images). Per-message
TTLs (`Nats-TTL`) let one bucket keep both for their own time.

Another tenant's task or image reads exactly like one that does not exist (404): answering
403 would confirm the id. An open gateway (no API keys) has no tenants and checks nothing.

How many requests may wait on task events at once is capped per tenant and in all: a waiting
request costs the gateway a listener and a little memory, never a broker resource,
but an unbounded number of them is still a way to exhaust it. Over a limit the answer is 429
with Retry-After, so clients back off; 503 is kept for a broker that is really unreachable.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.bus.retry import with_retry
from fleet.errors import (
    AtCapacity,
    FleetError,
    InvalidRequest,
    NatsUnavailable,
    Unauthorized,
)
from fleet.gateway import docs, landing
from fleet.gateway.bodies import refuse_with
from fleet.wire.codec import DecodeError, decode_model, encode
from fleet.wire.records import TaskRecord

log = logging.getLogger(__name__)


TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


KEY_PREFIX = "fk-"


def key_hash(key: str | bytes) -> str:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def plain_key_tenant(key: str) -> str:
    return f"key-{key_hash(key)[:12]}"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys_file(text: str, source: str = "keys file") -> dict[str, str]:
    """Hash → tenant from the file's lines; a bad line is an error naming its line number."""
    return parse_keys(text, source)[0]


def parse_keys(text: str, source: str = "keys file") -> tuple[dict[str, str], frozenset[str]]:
    """Hash → tenant, and the operator tenants, from the file's lines."""
    found: dict[str, str] = {}
    operator_of: dict[str, bool] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entry = orjson.loads(line)
            tenant, digest = entry["tenant"], entry["sha256"].lower()
            operator = entry.get("operator", False)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InvalidRequest(
                f"{source}:{number}: expected {{\"tenant\": ..., \"sha256\": ...}}"
            ) from None
        if not isinstance(tenant, str) or not TENANT.match(tenant):
            raise InvalidRequest(f"{source}:{number}: a tenant is 1-64 letters, digits, - or _")
        if not SHA256_HEX.match(digest):
            raise InvalidRequest(f"{source}:{number}: sha256 must be 64 hex digits")
        if not isinstance(operator, bool):
            raise InvalidRequest(f"{source}:{number}: operator is true or false")
        if operator_of.setdefault(tenant, operator) != operator:
            raise InvalidRequest(f"{source}:{number}: tenant {tenant} is an operator on one "
                                 "line and not on another")
        found[digest] = tenant
    return found, frozenset(t for t, operator in operator_of.items() if operator)


def key_line(tenant: str, key: str, operator: bool = False) -> str:
    if not TENANT.match(tenant):
        raise InvalidRequest("a tenant is 1-64 letters, digits, - or _")
    entry: dict[str, object] = {"tenant": tenant, "sha256": key_hash(key)}
    if operator:
        entry["operator"] = True
    return orjson.dumps(entry).decode()


@dataclass(frozen=True)
class KeyRing:
    """Which tenant a bearer key belongs to; empty means the gateway is open (no keys).
    Plain `FLEET_API_KEYS` are never operators: an operator is named in the keys file."""

    by_hash: dict[str, str]
    operators: frozenset[str] = frozenset()

    @classmethod
    def load(cls, plain_keys: Iterable[str], keys_file: str = "") -> KeyRing:
        by_hash = {key_hash(key): plain_key_tenant(key) for key in plain_keys}
        operators: frozenset[str] = frozenset()
        if keys_file:
            path = Path(keys_file).expanduser()
            try:
                text = path.read_text()
            except OSError as exc:
                raise InvalidRequest(f"cannot read the keys file {path}: {exc.strerror}") from None
            from_file, operators = parse_keys(text, str(path))
            by_hash.update(from_file)
        return cls(by_hash, operators)

    @property
    def open(self) -> bool:
        return not self.by_hash

    def is_operator(self, tenant: str | None) -> bool:
        """An open gateway trusts everyone (as the API does); else the keys file decides."""
        return self.open or (tenant is not None and tenant in self.operators)

    def tenant_of(self, token: bytes) -> str | None:
        return self.by_hash.get(key_hash(token.strip())) if token.strip() else None


def add_key(keys_file: Path, tenant: str, operator: bool = False) -> str:
    """Append a new key's hash for `tenant` to the file and return the key (shown once)."""
    key = new_key()
    line = key_line(tenant, key, operator)
    keys_file.parent.mkdir(parents=True, exist_ok=True)
    # The file lists hashes only, but who may add tenants is still the owner's business.
    with keys_file.open("a") as file:
        file.write(line + "\n")
    keys_file.chmod(0o600)
    return key


# Open to anyone: /healthz then answers only up or not; a key shows its details.
PROBE_PATHS = frozenset({"/healthz", "/health", "/openapi.json"})


def tenant_of(request: Request) -> str | None:
    """The tenant of the request's key; None on an open gateway (no keys configured)."""
    return request.scope.get("state", {}).get("tenant")


def authenticated(request: Request) -> bool:
    """A valid key was sent, or no keys are configured (then everyone is trusted)."""
    return bool(request.scope.get("state", {}).get("authenticated"))


class ApiKeys:
    """Bearer (or x-api-key) keys on every route but the probes when keys are configured; each key's
    tenant goes into the request's state for the routes to scope what they answer."""

    def __init__(self, app: ASGIApp, ring: KeyRing, protect_metrics: bool = False) -> None:
        self.app = app
        self.ring = ring
        self.open_paths = PROBE_PATHS if protect_metrics else PROBE_PATHS | {"/metrics"}

    def _tenant(self, scope: Scope) -> str | None:
        """A bearer key, or Anthropic's `x-api-key` header (what its clients send)."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            return self.ring.tenant_of(token)
        return self.ring.tenant_of(headers.get(b"x-api-key", b""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if self.ring.open:
            state.update(tenant=None, authenticated=True)
            return await self.app(scope, receive, send)
        tenant = self._tenant(scope)
        state.update(tenant=tenant, authenticated=tenant is not None)
        path = scope["path"]
        if tenant is None and path not in self.open_paths and not docs.is_open(path) and (
                path != landing.PAGE):
            refusal = Unauthorized("a valid API key is required: Authorization: Bearer KEY "
                                      "(or x-api-key: KEY)")
            return await refuse_with(refusal)(scope, receive, send)
        await self.app(scope, receive, send)


TENANTS_BUCKET = "FLEET_TENANTS"


STREAM = f"KV_{TENANTS_BUCKET}"


TASK_TTL_S = 3600


IMAGE_TTL_S = 7 * 24 * 3600


def task_key(task_id: str) -> str:
    return f"task.{task_id}"


def image_key(sha256: str, tenant: str) -> str:
    return f"image.{sha256}.{tenant}"


def subject_of(key: str) -> str:
    return f"$KV.{TENANTS_BUCKET}.{key}"


def record_of(value: bytes, task_id: str) -> TaskRecord | None:
    """The record stored for a task; one that cannot be read owns nothing (logged)."""
    try:
        return decode_model(TaskRecord, value)
    except DecodeError as exc:
        log.warning("the record of task %s in %s is unreadable: %s", task_id, TENANTS_BUCKET, exc)
        return None


class Owners:
    """Ownership records over one NATS connection (`client()` raises while it is down)."""

    def __init__(self, client: Callable[[], Client]) -> None:
        self._client = client

    def _nc(self) -> Client:
        return self._client()

    async def _put(self, key: str, value: bytes, ttl_s: int) -> None:
        js = self._nc().jetstream()
        headers = {"Nats-TTL": f"{ttl_s}s"}
        try:
            # The broker's whole budget, as every other call has: a KV election (4-8 s)
            # must delay the request, not fail it.
            await with_retry(
                lambda: js.publish(subject_of(key), value, headers=headers),
                what=f"record the owner of {key}",
            )
        except FleetError:
            raise
        except (NatsError, OSError, TimeoutError) as exc:
            raise NatsUnavailable(f"could not record the owner of {key}: {exc!r}") from None

    async def _get(self, key: str) -> bytes | None:
        js = self._nc().jetstream()
        try:
            stored = await with_retry(
                lambda: js.get_msg(STREAM, subject=subject_of(key), direct=True),
                what=f"read the owner of {key}",
            )
        except NotFoundError:
            return None
        except FleetError:
            raise
        except (NatsError, OSError, TimeoutError) as exc:
            raise NatsUnavailable(f"could not read the owner of {key}: {exc!r}") from None
        return stored.data or None  # a delete or TTL marker has no value: absent

    async def record_task(self, task_id: str, record: TaskRecord) -> None:
        await self._put(task_key(task_id), encode(record), TASK_TTL_S)

    async def task_record(self, task_id: str) -> TaskRecord | None:
        value = await self._get(task_key(task_id))
        return record_of(value, task_id) if value else None

    async def owns_task(self, task_id: str, tenant: str | None) -> bool:
        if tenant is None:
            return True
        record = await self.task_record(task_id)
        return record is not None and record.tenant == tenant

    async def own_image(self, sha256: str, tenant: str | None) -> None:
        if tenant is not None:
            await self._put(image_key(sha256, tenant), b"1", IMAGE_TTL_S)

    async def owns_image(self, sha256: str, tenant: str | None) -> bool:
        return tenant is None or await self._get(image_key(sha256, tenant)) is not None


def refusal(waiting: int, mine: int, max_waiting: int, per_key: int) -> str | None:
    """Why one more waiting request is refused, or None (pure: table-tested)."""
    if mine >= per_key:
        return f"this API key already has {mine} requests waiting on task events (the limit)"
    if waiting >= max_waiting:
        return f"the gateway has {waiting} requests waiting on task events (its limit)"
    return None


class Capacity:
    def __init__(self, max_waiting: int, per_key: int) -> None:
        self.max_waiting = max_waiting
        self.per_key = per_key
        self.by_tenant: Counter[str] = Counter()

    @property
    def waiting(self) -> int:
        return self.by_tenant.total()

    def take(self, tenant: str | None) -> str:
        """Count one more waiting request of `tenant`. On an open gateway (tenant None) there
        are no keys to tell clients apart: only the limit in all applies."""
        who = tenant or ""
        mine = self.by_tenant[who] if tenant is not None else 0
        if why := refusal(self.waiting, mine, self.max_waiting, self.per_key):
            raise AtCapacity(why + "; retry later")
        self.by_tenant[who] += 1
        return who

    def give_back(self, who: str) -> None:
        self.by_tenant[who] -= 1
        if self.by_tenant[who] <= 0:
            del self.by_tenant[who]

    @contextmanager
    def slot(self, tenant: str | None) -> Iterator[None]:
        who = self.take(tenant)
        try:
            yield
        finally:
            self.give_back(who)
