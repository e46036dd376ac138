"""Settings: frozen, read once. Flags beat FLEET_* environment variables beat defaults.

Each setting is declared once, as a field of `Settings`: its type, its default, what it means
and the groups of commands that read it (`setting(...)`). Its environment variable is
`FLEET_` + its name in capitals and its flag `--` + its name with dashes; `fleet.cli` makes the
flags and `--help` from these declarations, and `fleet.settings_doc` the README's table (a test
checks that table is current). Values from the environment and flags are coerced to the
field's type by pydantic (`"8000"` -> 8000, `"off"` -> False).

Why not pydantic-settings' BaseSettings: it is a model, and Settings is copied with
`dataclasses.replace` in many places (tests and the commands); reading the environment is one
loop here, and the coercion is pydantic's either way.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import AfterValidator, BeforeValidator, TypeAdapter, ValidationError

from fleet.errors import InvalidSetting

# The groups of settings a kind of command reads (`fleet.cli` maps commands to groups).
GENERAL_GROUP = "general"  # every command
CONNECTION_GROUP = "connection"  # every command that connects to NATS
WORKER_GROUP = "worker"  # `fleet worker` (and `fleet up`)
GATEWAY_GROUP = "gateway"  # `fleet gateway` (and `fleet up`)
EMBEDDED_GROUP = "embedded"  # the commands that run a nats-server here (`fleet up`, `fleet nats`)
UP_GROUP = "up"  # `fleet up` alone
GROUPS = (GENERAL_GROUP, CONNECTION_GROUP, WORKER_GROUP, GATEWAY_GROUP, EMBEDDED_GROUP, UP_GROUP)


@dataclass(frozen=True)
class Declared:
    """What a setting declares besides its type and default."""

    help: str  # what it means: `--help` and the README table
    groups: tuple[str, ...]  # the kinds of command that read it
    shown_default: str = ""  # the default as the README shows it where it depends on the machine


def setting(
    default: Any = MISSING, *, help: str, groups: str | tuple[str, ...],
    factory: Any = MISSING, shown_default: str = "",
) -> Any:
    """One setting: a dataclass field whose metadata says what it means and who reads it."""
    declared = Declared(help, (groups,) if isinstance(groups, str) else groups, shown_default)
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"setting": declared})
    return field(default=default, metadata={"setting": declared})


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fleet"


def _comma_separated(raw: Any) -> Any:
    return raw.split(",") if isinstance(raw, str) else raw


# Coercions beyond the type itself (applied to flags and the environment, not to `replace`).
KeyList = Annotated[
    tuple[str, ...], BeforeValidator(_comma_separated),
    AfterValidator(lambda keys: tuple(key for key in keys if key)),
]
AbsolutePath = Annotated[Path, AfterValidator(lambda path: path.expanduser().resolve())]
# Whom the gateway fetches image URLs from (fleet/gateway/image_fetch.py), any case.
FetchPolicy = Annotated[
    Literal["public", "private", "off"],
    BeforeValidator(lambda raw: raw.strip().lower() if isinstance(raw, str) else raw),
]

_W, _G = WORKER_GROUP, GATEWAY_GROUP


@dataclass(frozen=True)
class Settings:
    nats_url: str | None = setting(  # None: `fleet up` runs an embedded nats-server
        None, groups=CONNECTION_GROUP,
        help="NATS server URL; comma-separated for a cluster (`fleet up`: none = embedded)")
    data_dir: AbsolutePath = setting(
        factory=_default_data_dir, groups=GENERAL_GROUP, shown_default="~/.local/share/fleet",
        help="data directory: models, images, the embedded server's store, auth")
    log_level: str = setting("info", groups=GENERAL_GROUP, help="debug, info, warning, error")
    # How this process proves who it is to NATS ("" = not used); see README "Operating".
    nats_creds: str = setting("", groups=CONNECTION_GROUP, help="a .creds file (JWT + NKey seed)")
    nats_nkey: str = setting("", groups=CONNECTION_GROUP, help="an NKey seed file")
    nats_user: str = setting("", groups=CONNECTION_GROUP, help="NATS user")
    nats_password: str = setting(
        "", groups=CONNECTION_GROUP, help="NATS password (prefer the env var)")
    nats_tls_ca: str = setting(
        "", groups=CONNECTION_GROUP, help="CA bundle that signed the server's certificate")
    nats_tls_cert: str = setting(
        "", groups=CONNECTION_GROUP, help="client certificate (mutual TLS)")
    nats_tls_key: str = setting("", groups=CONNECTION_GROUP, help="client certificate's key")
    nats_port: int = setting(
        4222, groups=EMBEDDED_GROUP, help="client port of the embedded nats-server")
    # `fleet up`: one Python process carrying the worker and the gateway was the node's
    # token-rate ceiling (issue 23); bench/README.md "Plumbing at rate" has the measurements.
    up_processes: Literal["split", "one"] = setting(
        "one", groups=UP_GROUP,
        help="`fleet up`: the gateway in a process of its own beside the worker's (split) or "
        "both in one process (one)")
    replicas: int = setting(
        0, groups=(_W, _G, EMBEDDED_GROUP),
        help="stream and KV replicas (0: from the cluster's size, 3 if >= 3 servers)")
    # The worker.
    slots: int = setting(
        0, groups=_W,
        help="concurrent tasks per text runner (its batch width); 0: what the engine batches "
        "(mlx-lm's 32), fewer where the node's free memory cannot hold that many KV caches of "
        "2,048 tokens (fleet/batch_width.py)")
    image_cache_bytes: int = setting(
        2 * 1024**3, groups=_W, help="bytes of images the worker keeps on disk")
    models_disk_limit: int = setting(
        0, groups=_W,
        help="bytes of model files the worker keeps on disk (0: no limit); least recently "
        "used models not placed here are evicted to make room")
    memory_limit: int = setting(
        0, groups=_W,
        help="bytes of memory this node offers models (0: the free memory); a model no node "
        "can hold is split over several (sharded instances)")
    ring_host: str = setting(
        "127.0.0.1", groups=_W,
        help="address other nodes reach this node's shard runner on (mx.distributed ring)")
    ring_port: int = setting(
        0, groups=_W,
        help="TCP port of this node's shard runner in a ring (0: a free one at start)")
    standby_runner: bool = setting(
        True, groups=_W,
        help="keep a runner process with mlx-lm imported, waiting, on a node with no model or "
        "with a shard of one, so a runner moved or restarted there skips ~10 s of imports")
    input_wait_s: float = setting(
        10.0, groups=_W, help="seconds a task waits for a missing input image")
    # One delivery more than the first plus max_continuations (3): a task whose worker dies
    # three times mid-answer still ends worker_lost, not max_deliveries; one spare for a
    # death before its output began.
    max_deliver: int = setting(5, groups=_W, help="deliveries of a task before it is given up")
    # A dead worker is seen from its connection in ~1-2 s (fleet/worker/deathwatch.py);
    # AckWait guards the rest (a paused or cut-off worker), so it can be long and never
    # hand a loaded worker's tasks over.
    ack_wait_s: float = setting(
        30.0, groups=_W,
        help="seconds a silent worker holds a task before JetStream redelivers it (its beats "
        "come every AckWait/4, at most 5 s); a dead worker's tasks move sooner, when its "
        "connection is seen gone")
    auto_place: bool = setting(
        True, groups=_W, help="place a model when tasks wait for one nobody serves")
    prefix_routing: bool = setting(
        True, groups=_W,
        help="send a task to the runner whose prefix cache holds most of its prompt")
    prefix_index_blocks: int = setting(
        4096, groups=_W, help="prompt blocks remembered per runner for routing (LRU)")
    metrics_host: str = setting(
        "127.0.0.1", groups=_W, help="address a worker serves /metrics on")
    metrics_port: int = setting(
        0, groups=_W, help="port a worker serves Prometheus /metrics on (0: not served)")
    vision_cache_mb: float = setting(
        512.0, groups=_W,
        help="MB of image features a vision runner keeps (least recently used out; 0: off)")
    ask_timeout_s: float = setting(
        300.0, groups=_W,
        help="seconds a worker waits for the end of a task asked on fleet.ask.<model> "
        "(then it answers `timeout`)")
    # The gateway, its tenants and limits; see README "Operating".
    gateway_host: str = setting("127.0.0.1", groups=_G, help="address the gateway listens on")
    gateway_port: int = setting(8000, groups=_G, help="port the gateway listens on")
    gateway_timeout_s: float = setting(
        300.0, groups=_G, help="seconds a request waits for its task to end (then 504)")
    gateway_max_body_bytes: int = setting(
        32 * 1024**2, groups=_G, help="larger request bodies get 413")
    api_keys: KeyList = setting(
        (), groups=_G,
        help="comma-separated API keys the gateway accepts (prefer the env var)")
    api_keys_file: str = setting(
        "", groups=_G, help="keys file: JSON lines {tenant, sha256}; keys map to tenants")
    gateway_protect_metrics: bool = setting(
        False, groups=_G, help="/metrics needs an API key too")
    gateway_events_idle_s: float = setting(
        30.0, groups=_G, help="a /v1/tasks/<id>/events stream ends after this quiet")
    gateway_streams_per_key: int = setting(
        256, groups=_G, help="requests waiting on task events, per tenant (then 429)")
    gateway_max_waiting: int = setting(
        4096, groups=_G, help="requests waiting on task events, in all (then 429)")
    gateway_max_connections: int = setting(
        4096, groups=_G, help="open HTTP connections (more get 429 and are closed)")
    gateway_header_timeout_s: float = setting(
        10.0, groups=_G, help="seconds to send a request's headers")
    gateway_body_timeout_s: float = setting(
        60.0, groups=_G, help="seconds to send a request's whole body (then 408)")
    gateway_keep_alive_s: float = setting(
        15.0, groups=_G, help="an idle keep-alive connection is closed after this")
    image_fetch: FetchPolicy = setting(
        "public", groups=_G,
        help="http(s) image URLs the gateway fetches: public (global addresses), private "
        "(also LAN and loopback, never link-local), off")

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


# Every setting's name, in the order declared.
NAMES: tuple[str, ...] = tuple(f.name for f in fields(Settings))


def declared(name: str) -> Declared:
    declaration: Declared = next(f for f in fields(Settings) if f.name == name).metadata["setting"]
    return declaration


def names_in(group: str) -> tuple[str, ...]:
    return tuple(name for name in NAMES if group in declared(name).groups)


GENERAL = names_in(GENERAL_GROUP)
CONNECTION = names_in(CONNECTION_GROUP)
WORKER = names_in(WORKER_GROUP)
GATEWAY = names_in(GATEWAY_GROUP)
EMBEDDED = names_in(EMBEDDED_GROUP)
UP = names_in(UP_GROUP)


def env_var(name: str) -> str:
    return "FLEET_" + name.upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def description(name: str) -> str:
    return declared(name).help


def is_switch(name: str) -> bool:
    """A bool setting: its flag is `--name` / `--no-name`."""
    return _hints()[name] is bool


def default_of(name: str) -> Any:
    return getattr(Settings(), name)


@cache
def _hints() -> dict[str, Any]:
    return get_type_hints(Settings, include_extras=True)


@cache
def _adapter(name: str) -> TypeAdapter[Any]:
    return TypeAdapter(_hints()[name])


def load_settings(
    flags: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Build Settings from flags (None means not given) over the environment over defaults.
    An empty environment variable counts as unset."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    for name in NAMES:
        if env.get(env_var(name)):
            values[name] = _checked(name, env[env_var(name)], env_var(name))
    for name, value in (flags or {}).items():
        if value is not None and name in NAMES:
            values[name] = _checked(name, value, flag(name))
    return replace(Settings(), **values)


def _checked(name: str, raw: Any, source: str) -> Any:
    value = os.fspath(raw) if isinstance(raw, os.PathLike) else raw
    try:
        return _adapter(name).validate_python(value)
    except ValidationError:
        raise InvalidSetting(f"{source}: {raw!r} is not a valid value for {name}") from None


def settings_of(namespace: object, **overrides: Any) -> Settings:
    """Settings from a parsed command line: every attribute named like a setting is a flag
    (None or absent: not given); `overrides` are flags under other names."""
    flags = {name: getattr(namespace, name, None) for name in NAMES}
    flags.update({k: v for k, v in overrides.items() if v is not None})
    return load_settings(flags)
