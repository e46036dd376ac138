"""API keys and the tenants they belong to.

A keys file (`FLEET_API_KEYS_FILE`) holds one JSON object a line, `#` lines are comments:

    {"tenant": "team-a", "sha256": "<hex sha256 of the key>"}

Only hashes are stored. A plain SHA-256 is enough here, and a slow salted hash would be worse:
the keys `fleet gateway keys add` makes are 256 random bits, which no brute force reverses,
while scrypt or argon2 cost tens of ms of CPU per request (a denial-of-service lever on an
endpoint anyone can hit) and, being salted, would need a comparison against every entry.
With a plain hash a presented key is looked up in a dict: constant work, and timing tells
nothing about keys (it depends only on the hash of what was sent). Keys an operator chose
by hand must be as random as generated ones; that is their responsibility.

`FLEET_API_KEYS` (comma-separated plain keys) stays for the simple case: each key is its
own tenant, named `key-<first 12 hex of its sha256>` (never the key itself).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from fleet.errors import InvalidRequest

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
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entry = orjson.loads(line)
            tenant, digest = entry["tenant"], entry["sha256"].lower()
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InvalidRequest(
                f"{source}:{number}: expected {{\"tenant\": ..., \"sha256\": ...}}"
            ) from None
        if not isinstance(tenant, str) or not TENANT.match(tenant):
            raise InvalidRequest(f"{source}:{number}: a tenant is 1-64 letters, digits, - or _")
        if not SHA256_HEX.match(digest):
            raise InvalidRequest(f"{source}:{number}: sha256 must be 64 hex digits")
        found[digest] = tenant
    return found


def key_line(tenant: str, key: str) -> str:
    if not TENANT.match(tenant):
        raise InvalidRequest("a tenant is 1-64 letters, digits, - or _")
    return orjson.dumps({"tenant": tenant, "sha256": key_hash(key)}).decode()


@dataclass(frozen=True)
class KeyRing:
    """Which tenant a bearer key belongs to; empty means the gateway is open (no keys)."""

    by_hash: dict[str, str]

    @classmethod
    def load(cls, plain_keys: Iterable[str], keys_file: str = "") -> KeyRing:
        by_hash = {key_hash(key): plain_key_tenant(key) for key in plain_keys}
        if keys_file:
            path = Path(keys_file).expanduser()
            try:
                text = path.read_text()
            except OSError as exc:
                raise InvalidRequest(f"cannot read the keys file {path}: {exc.strerror}") from None
            by_hash.update(parse_keys_file(text, str(path)))
        return cls(by_hash)

    @property
    def open(self) -> bool:
        return not self.by_hash

    def tenant_of(self, token: bytes) -> str | None:
        return self.by_hash.get(key_hash(token.strip())) if token.strip() else None


def add_key(keys_file: Path, tenant: str) -> str:
    """Append a new key's hash for `tenant` to the file and return the key (shown once)."""
    key = new_key()
    line = key_line(tenant, key)
    keys_file.parent.mkdir(parents=True, exist_ok=True)
    # The file lists hashes only, but who may add tenants is still the owner's business.
    with keys_file.open("a") as file:
        file.write(line + "\n")
    keys_file.chmod(0o600)
    return key
