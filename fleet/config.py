"""Settings: frozen, read once. Flags beat FLEET_* environment variables beat defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fleet.errors import InvalidSetting


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fleet"


@dataclass(frozen=True)
class Settings:
    nats_url: str | None = None  # None: `fleet up` runs an embedded nats-server
    data_dir: Path = field(default_factory=_default_data_dir)
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    gateway_timeout_s: float = 300.0  # a request that has no terminal event by then gets 504
    gateway_max_body_bytes: int = 32 * 1024**2  # larger request bodies get 413
    nats_port: int = 4222
    log_level: str = "info"
    slots: int = 0  # tasks per text runner (batch width); 0: sized from engine and memory
    api_keys: tuple[str, ...] = ()
    image_cache_bytes: int = 2 * 1024**3
    models_disk_limit: int = 0  # bytes of model files a node keeps; 0 = no budget
    memory_limit: int = 0  # bytes of model memory this node offers placement; 0 = what is free
    ring_host: str = "127.0.0.1"  # the address peers reach this node's shard runner on
    ring_port: int = 0  # its ring port; 0 = a free port chosen at start
    input_wait_s: float = 10.0  # how long a task waits for a missing input image
    # One delivery more than the first plus max_continuations (3): a task whose worker dies
    # three times mid-answer still ends worker_lost, not max_deliveries; one spare for a
    # death before its output began.
    max_deliver: int = 5
    ack_wait_s: float = 30.0
    auto_place: bool = True  # a task queued for a model nobody serves places an instance
    prefix_routing: bool = True  # a task goes to the runner holding most of its prompt
    prefix_index_blocks: int = 4096  # prompt blocks remembered per runner (LRU)
    # How this process proves who it is to NATS ("" = not used); see README "Operating".
    replicas: int = 0  # stream and KV replicas; 0 = from the cluster's size (3 if >= 3 servers)
    nats_creds: str = ""  # a .creds file (JWT + NKey seed)
    nats_nkey: str = ""  # an NKey seed file
    nats_user: str = ""
    nats_password: str = ""
    nats_tls_ca: str = ""  # CA bundle that signed the server's certificate
    nats_tls_cert: str = ""  # client certificate (mutual TLS)
    nats_tls_key: str = ""
    # The gateway's tenants and limits; see README "Operating" (tenants, keys file, limits).
    api_keys_file: str = ""  # JSON lines {"tenant": ..., "sha256": ...}; keys map to tenants
    gateway_protect_metrics: bool = False  # /metrics needs an API key too
    gateway_events_idle_s: float = 30.0  # a /v1/tasks/<id>/events stream ends after this quiet
    gateway_streams_per_key: int = 256  # requests waiting on task events, per tenant (then 429)
    gateway_max_waiting: int = 4096  # requests waiting on task events, in all (then 429)
    gateway_max_connections: int = 4096  # open HTTP connections (more get 429 and are closed)
    gateway_header_timeout_s: float = 10.0  # to send a request's headers
    gateway_body_timeout_s: float = 60.0  # to send a request's whole body (then 408)
    gateway_keep_alive_s: float = 15.0  # an idle keep-alive connection is closed after this
    metrics_host: str = "127.0.0.1"  # where a worker serves its /metrics
    metrics_port: int = 0  # a worker's /metrics port; 0 = not served
    ask_timeout_s: float = 300.0  # a `fleet.ask.<model>` request is answered `timeout` after

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def images_dir(self) -> Path:
        return self.data_dir / "images"

    @property
    def nats_store_dir(self) -> Path:
        return self.data_dir / "nats"

    @property
    def url(self) -> str:
        return self.nats_url or f"nats://127.0.0.1:{self.nats_port}"

    @property
    def urls(self) -> list[str]:
        """Every server of `url` (a comma-separated list names a cluster's servers)."""
        return [part.strip() for part in self.url.split(",") if part.strip()]


_ENV: dict[str, str] = {
    "nats_url": "FLEET_NATS_URL",
    "data_dir": "FLEET_DATA_DIR",
    "gateway_host": "FLEET_GATEWAY_HOST",
    "gateway_port": "FLEET_GATEWAY_PORT",
    "gateway_timeout_s": "FLEET_GATEWAY_TIMEOUT_S",
    "gateway_max_body_bytes": "FLEET_GATEWAY_MAX_BODY_BYTES",
    "nats_port": "FLEET_NATS_PORT",
    "log_level": "FLEET_LOG_LEVEL",
    "slots": "FLEET_SLOTS",
    "api_keys": "FLEET_API_KEYS",
    "image_cache_bytes": "FLEET_IMAGE_CACHE_BYTES",
    "models_disk_limit": "FLEET_MODELS_DISK_LIMIT",
    "memory_limit": "FLEET_MEMORY_LIMIT",
    "ring_host": "FLEET_RING_HOST",
    "ring_port": "FLEET_RING_PORT",
    "input_wait_s": "FLEET_INPUT_WAIT_S",
    "max_deliver": "FLEET_MAX_DELIVER",
    "ack_wait_s": "FLEET_ACK_WAIT_S",
    "auto_place": "FLEET_AUTO_PLACE",
    "prefix_routing": "FLEET_PREFIX_ROUTING",
    "prefix_index_blocks": "FLEET_PREFIX_INDEX_BLOCKS",
    "replicas": "FLEET_REPLICAS",
    "nats_creds": "FLEET_NATS_CREDS",
    "nats_nkey": "FLEET_NATS_NKEY",
    "nats_user": "FLEET_NATS_USER",
    "nats_password": "FLEET_NATS_PASSWORD",
    "nats_tls_ca": "FLEET_NATS_TLS_CA",
    "nats_tls_cert": "FLEET_NATS_TLS_CERT",
    "nats_tls_key": "FLEET_NATS_TLS_KEY",
    "api_keys_file": "FLEET_API_KEYS_FILE",
    "gateway_protect_metrics": "FLEET_GATEWAY_PROTECT_METRICS",
    "gateway_events_idle_s": "FLEET_GATEWAY_EVENTS_IDLE_S",
    "gateway_streams_per_key": "FLEET_GATEWAY_STREAMS_PER_KEY",
    "gateway_max_waiting": "FLEET_GATEWAY_MAX_WAITING",
    "gateway_max_connections": "FLEET_GATEWAY_MAX_CONNECTIONS",
    "gateway_header_timeout_s": "FLEET_GATEWAY_HEADER_TIMEOUT_S",
    "gateway_body_timeout_s": "FLEET_GATEWAY_BODY_TIMEOUT_S",
    "gateway_keep_alive_s": "FLEET_GATEWAY_KEEP_ALIVE_S",
    "metrics_host": "FLEET_METRICS_HOST",
    "metrics_port": "FLEET_METRICS_PORT",
    "ask_timeout_s": "FLEET_ASK_TIMEOUT_S",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(name: str, raw: Any) -> Any:
    kind = {f.name: f.type for f in fields(Settings)}[name]
    if name == "data_dir":
        return Path(raw).expanduser().resolve()
    if name == "api_keys":
        return tuple(k for k in (raw.split(",") if isinstance(raw, str) else raw) if k)
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in _TRUE + _FALSE:
            return str(raw).lower() in _TRUE
        raise ValueError(raw)
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw


def load_settings(
    flags: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Build Settings from flags (None means not given) over the environment over defaults."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    for name, var in _ENV.items():
        if env.get(var):
            values[name] = _checked(name, env[var], var)
    for name, value in (flags or {}).items():
        if value is not None and name in _ENV:
            values[name] = _checked(name, value, "--" + name.replace("_", "-"))
    return replace(Settings(), **values)


def _checked(name: str, raw: Any, source: str) -> Any:
    try:
        return _coerce(name, raw)
    except ValueError:
        raise InvalidSetting(f"{source}: {raw!r} is not a valid value for {name}") from None


# What each setting means, for `--help` (which adds its flag's env var and default).
DESCRIPTIONS: dict[str, str] = {
    "nats_url": "NATS server URL; comma-separated for a cluster (`fleet up`: none = embedded)",
    "data_dir": "data directory: models, images, the embedded server's store, auth",
    "gateway_host": "address the gateway listens on",
    "gateway_port": "port the gateway listens on",
    "gateway_timeout_s": "seconds a request waits for its task to end (then 504)",
    "gateway_max_body_bytes": "larger request bodies get 413",
    "nats_port": "client port of the embedded nats-server",
    "log_level": "debug, info, warning, error",
    "slots": "concurrent tasks per text runner (0: what the engine batches, within the "
    "node's memory; see fleet/batch_width.py)",
    "api_keys": "comma-separated API keys the gateway accepts (prefer the env var)",
    "image_cache_bytes": "bytes of images the worker keeps on disk",
    "models_disk_limit": "bytes of model files the worker keeps on disk (0: no limit); "
    "least recently used models not placed here are evicted to make room",
    "memory_limit": "bytes of memory this node offers models (0: the free memory); a model "
    "no node can hold is split over several (sharded instances)",
    "ring_host": "address other nodes reach this node's shard runner on (mx.distributed ring)",
    "ring_port": "TCP port of this node's shard runner in a ring (0: a free one at start)",
    "input_wait_s": "seconds a task waits for a missing input image",
    "max_deliver": "deliveries of a task before it is given up",
    "ack_wait_s": "seconds a worker holds a task before JetStream redelivers it",
    "auto_place": "place a model when tasks wait for one nobody serves",
    "prefix_routing": "send a task to the runner whose prefix cache holds most of its prompt",
    "prefix_index_blocks": "prompt blocks remembered per runner for routing (LRU)",
    "replicas": "stream and KV replicas (0: from the cluster's size)",
    "nats_creds": "a .creds file (JWT + NKey seed)",
    "nats_nkey": "an NKey seed file",
    "nats_user": "NATS user",
    "nats_password": "NATS password (prefer the env var)",
    "nats_tls_ca": "CA bundle that signed the server's certificate",
    "nats_tls_cert": "client certificate (mutual TLS)",
    "nats_tls_key": "client certificate's key",
    "api_keys_file": "keys file: JSON lines {tenant, sha256}",
    "gateway_protect_metrics": "/metrics needs an API key too",
    "gateway_events_idle_s": "a /v1/tasks/<id>/events stream ends after this quiet",
    "gateway_streams_per_key": "requests waiting on task events, per tenant (then 429)",
    "gateway_max_waiting": "requests waiting on task events, in all (then 429)",
    "gateway_max_connections": "open HTTP connections (more get 429)",
    "gateway_header_timeout_s": "seconds to send a request's headers",
    "gateway_body_timeout_s": "seconds to send a request's whole body (then 408)",
    "gateway_keep_alive_s": "an idle keep-alive connection is closed after this",
    "metrics_host": "address a worker serves /metrics on",
    "metrics_port": "port a worker serves Prometheus /metrics on (0: not served)",
    "ask_timeout_s": "seconds a worker waits for the end of a task asked on fleet.ask.<model> "
    "(then it answers `timeout`)",
}

# Which settings a kind of command reads: `fleet.cli` offers exactly these on each command.
GENERAL = ("data_dir", "log_level")
CONNECTION = (
    "nats_url", "nats_creds", "nats_nkey", "nats_user", "nats_password",
    "nats_tls_ca", "nats_tls_cert", "nats_tls_key",
)
WORKER = ("slots", "image_cache_bytes", "models_disk_limit", "memory_limit", "ring_host",
          "ring_port", "input_wait_s", "max_deliver",
          "ack_wait_s", "auto_place", "replicas", "prefix_routing", "prefix_index_blocks",
          "metrics_host", "metrics_port", "ask_timeout_s")
GATEWAY = (
    *(name for name in _ENV if name.startswith("gateway_")), "api_keys", "api_keys_file",
    "replicas",
)


def env_var(name: str) -> str:
    return _ENV[name]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def kind_of(name: str) -> str:
    """The setting's type as written in Settings ("bool", "int", "str | None", ...)."""
    return str({f.name: f.type for f in fields(Settings)}[name])


def default_of(name: str) -> Any:
    return getattr(Settings(), name)


def settings_of(namespace: object, **overrides: Any) -> Settings:
    """Settings from a parsed command line: every attribute named like a setting is a flag
    (None or absent: not given); `overrides` are flags under other names."""
    flags = {name: getattr(namespace, name, None) for name in _ENV}
    flags.update({k: v for k, v in overrides.items() if v is not None})
    return load_settings(flags)
