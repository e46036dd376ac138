"""API keys and their tenants: the keys file, its hashes, and the ring a request's key is
looked up in. The middleware that does the lookup is fleet.gateway.auth.

A keys file (`FLEET_API_KEYS_FILE`) holds one JSON object a line, `#` lines are comments:

    {"tenant": "team-a", "sha256": "<hex sha256 of the key>"}
    {"tenant": "ops", "sha256": "<hex sha256>", "operator": true}
    {"tenant": "bulk", "sha256": "<hex>", "max_priority": "batch", "weight": 0.5}

`max_priority` and `weight` (priority classes and fair shares: fleet.gateway.priority) are
properties of the tenant too: the first line of a tenant that names them decides.

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
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from fleet.errors import InvalidRequest
from fleet.gateway.priority import OPEN, TenantPolicy, policy_of_line

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


def parse_policies(text: str, source: str = "keys file") -> dict[str, TenantPolicy]:
    """Tenant → its priority ceiling and weight, from the lines that name them (the lines are
    checked by parse_keys first)."""
    found: dict[str, TenantPolicy] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        entry = orjson.loads(line)
        if {"max_priority", "weight"} & entry.keys() and entry["tenant"] not in found:
            found[entry["tenant"]] = policy_of_line(entry, f"{source}:{number}")
    return found


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
    policies: dict[str, TenantPolicy] = field(default_factory=dict)

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
            return cls(by_hash, operators, parse_policies(text, str(path)))
        return cls(by_hash, operators)

    def policy(self, tenant: str | None) -> TenantPolicy:
        return self.policies.get(tenant, OPEN) if tenant is not None else OPEN

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
