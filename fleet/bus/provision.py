"""Idempotent provisioning of Fleet's streams, buckets and consumers from ops/jetstream/.

The files are the JSON that `nats stream add --config FILE` takes, sent as they are to the
JetStream API, so what an operator reads in ops/ is exactly what the server gets. A stream
that exists with a different value for a key the file sets is reported, never clobbered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from fleet.bus.embedded import ops_dir
from fleet.errors import NatsUnavailable, ProvisioningConflict
from fleet.wire import subjects

API = "$JS.API"


@dataclass(frozen=True)
class Outcome:
    name: str
    action: str  # "created" | "unchanged"


def definitions(directory: Path | None = None) -> list[dict[str, Any]]:
    directory = directory or ops_dir() / "jetstream"
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


def consumer_definition(model: str, max_deliver: int, ack_wait_s: float) -> dict[str, Any]:
    template = (ops_dir() / "jetstream" / "consumers" / "tasks.json").read_text()
    config = json.loads(template.replace("MODEL", model))
    config["max_deliver"] = max_deliver
    config["ack_wait"] = int(ack_wait_s * 1e9)
    return config


async def _api(nc: Client, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = orjson.dumps(body) if body is not None else b""
    try:
        reply = await nc.request(f"{API}.{subject}", payload, timeout=5.0)
    except (NoRespondersError, NatsTimeout):
        raise NatsUnavailable("JetStream is not enabled or not answering on this server") from None
    return orjson.loads(reply.data)


def _differences(wanted: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    skip = {"description"}  # prose may change without a migration
    return [
        f"{key}: server has {actual.get(key)!r}, ops/jetstream wants {value!r}"
        for key, value in wanted.items()
        if key not in skip and actual.get(key) != value
    ]


async def ensure_stream(nc: Client, config: dict[str, Any]) -> Outcome:
    name = config["name"]
    info = await _api(nc, f"STREAM.INFO.{name}")
    if "error" not in info:
        if diffs := _differences(config, info["config"]):
            raise ProvisioningConflict(f"stream {name} differs: " + "; ".join(diffs))
        return Outcome(name, "unchanged")
    if info["error"].get("err_code") != 10059:  # stream not found
        raise ProvisioningConflict(f"stream {name}: {info['error'].get('description')}")
    created = await _api(nc, f"STREAM.CREATE.{name}", config)
    if "error" in created:
        raise ProvisioningConflict(f"stream {name}: {created['error'].get('description')}")
    return Outcome(name, "created")


async def provision(nc: Client, directory: Path | None = None) -> list[Outcome]:
    """Create every stream and bucket Fleet needs; safe to run from every process at start."""
    return [await ensure_stream(nc, config) for config in definitions(directory)]


async def ensure_task_consumer(
    nc: Client, model: str, *, max_deliver: int = 3, ack_wait_s: float = 30.0
) -> Outcome:
    """The one durable pull consumer of a model's tasks, shared by every worker serving it."""
    config = consumer_definition(model, max_deliver, ack_wait_s)
    name = subjects.durable(model)
    info = await _api(nc, f"CONSUMER.INFO.{subjects.TASKS_STREAM}.{name}")
    if "error" not in info:
        if diffs := _differences(config, info["config"]):
            raise ProvisioningConflict(f"consumer {name} differs: " + "; ".join(diffs))
        return Outcome(name, "unchanged")
    body = {"stream_name": subjects.TASKS_STREAM, "config": config}
    created = await _api(nc, f"CONSUMER.CREATE.{subjects.TASKS_STREAM}.{name}", body)
    if "error" in created:
        raise ProvisioningConflict(f"consumer {name}: {created['error'].get('description')}")
    return Outcome(name, "created")
