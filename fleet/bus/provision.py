"""Idempotent provisioning of Fleet's streams, buckets and consumers from ops/jetstream/.

The files are the JSON that `nats stream add --config FILE` takes, sent as they are to the
JetStream API, so what an operator reads in ops/ is exactly what the server gets, plus
`num_replicas`, which the files leave out: it follows the cluster (fleet.bus.replicas: 3 on a
cluster that can hold three copies, 1 otherwise, `replicas` to override). A stream that
exists with a different value for another key the file sets is reported, never clobbered;
an existing stream with fewer replicas than chosen is reported with the command that raises
it. The limits in LIMIT_KEYS are the exception: a stream provisioned before they existed gets
them by an update of those keys alone (everything else stays as the server has it), because
without them any client could fill FLEET_OUT with consumers that never go; an update the
server or the role's permissions refuse is logged with what to do, and the stream is used as
it is.

Every API call retries transient errors (an election, a restart) within the broker budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import ServiceUnavailableError

from fleet.bus.denials import permission_errors, refused_by_permission
from fleet.bus.embedded import ops_dir
from fleet.bus.replicas import choose_replicas, replicas_advice
from fleet.bus.retry import BROKER_BUDGET_S, pause_after, with_retry
from fleet.errors import NatsUnavailable, NotPermitted, ProvisioningConflict, ProvisioningDenied
from fleet.wire import subjects

log = logging.getLogger(__name__)

API = "$JS.API"
NO_JETSTREAM_BUDGET_S = 1.0
# Keys an existing stream is updated to have: bounds on what readers create (docs/permissions.md,
# "Consumers are bounded"), and per-message TTLs on FLEET_TASKS (a task's deadline expires it
# in the broker). The server accepts each change on a live stream (a TTL can be turned on,
# never off).
LIMIT_KEYS = frozenset({"max_consumers", "consumer_limits", "allow_msg_ttl"})
# JetStream 400 "no suitable peers for placement": fewer servers have joined the meta group
# than the stream's copies. A forming cluster answers it for its first seconds (seen in a
# loaded test run: a 3-node cluster with a meta leader but its third peer not yet joined), so
# creation is asked again within the budget; a cluster that is simply too small fails then.
# (A server outside any cluster answers "replicas > 1 not supported", final at once.)
NO_PEERS_ERR_CODE = 10005


@dataclass(frozen=True)
class Outcome:
    name: str
    action: str  # "created" | "unchanged" | "updated" (limits) | "outdated" (limits refused)
    replicas: int = 0  # what the stream has on the server (0: not asked)


def definitions(directory: Path | None = None) -> list[dict[str, Any]]:
    directory = directory or ops_dir() / "jetstream"
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


def consumer_definition(
    model: str, max_deliver: int, ack_wait_s: float, priority: str = "default"
) -> dict[str, Any]:
    """The durable of one model's tasks of one priority class (fleet.worker.priority)."""
    template = (ops_dir() / "jetstream" / "consumers" / "tasks.json").read_text()
    config = json.loads(template.replace("MODEL", model))
    config["durable_name"] = subjects.durable(model, priority)
    config["filter_subject"] = subjects.tasks(model, priority)
    config["max_deliver"] = max_deliver
    config["ack_wait"] = int(ack_wait_s * 1e9)
    return config


async def jetstream_api(
    nc: Client, subject: str, body: dict[str, Any] | None = None, *,
    budget_s: float = BROKER_BUDGET_S,
) -> dict[str, Any]:
    if not nc._server_info.get("jetstream"):
        # This server runs no JetStream itself; another server of its cluster might answer,
        # but no election is waited for.
        budget_s = min(budget_s, NO_JETSTREAM_BUDGET_S)
    payload = orjson.dumps(body) if body is not None else b""

    async def once() -> dict[str, Any]:
        try:
            reply = await nc.request(f"{API}.{subject}", payload, timeout=5.0)
        except NatsTimeout:
            _raise_if_denied(f"{API}.{subject}")
            raise
        answer: dict[str, Any] = orjson.loads(reply.data)
        if answer.get("error", {}).get("code") == 503:  # no leader yet: an election
            raise ServiceUnavailableError(**answer["error"])
        return answer

    try:
        return await with_retry(once, what=f"JetStream API {subject}", budget_s=budget_s)
    except NatsUnavailable as exc:
        raise NatsUnavailable(
            f"JetStream is not enabled or not answering on this server: {exc}"
        ) from None


def _raise_if_denied(subject: str) -> None:
    """A request the server refused by permission gets no reply, only an async error: tell
    it apart from an election's silence, which a retry outlasts."""
    # nats-py lowers the case of the server's error text
    if any(denied.subject.lower() == subject.lower() for denied in permission_errors()):
        raise ProvisioningDenied(
            f"this NATS user may not publish to {subject}: streams and buckets are created "
            "by the operator role (`fleet nats --provision` with its credentials)"
        )


def _differences(
    wanted: dict[str, Any], actual: dict[str, Any], skip: frozenset[str] = frozenset()
) -> list[str]:
    # prose may change; replicas follow the cluster
    skip = skip | {"description", "num_replicas"}
    return [
        f"{key}: server has {actual.get(key)!r}, ops/jetstream wants {value!r}"
        for key, value in wanted.items()
        if key not in skip and actual.get(key) != value
    ]


def limits_to_update(wanted: dict[str, Any], actual: dict[str, Any]) -> dict[str, Any]:
    """The limit keys whose value on the server differs from the file's."""
    return {key: wanted[key] for key in LIMIT_KEYS & wanted.keys()
            if actual.get(key) != wanted[key]}


async def _update_limits(
    nc: Client, name: str, actual: dict[str, Any], limits: dict[str, Any], budget_s: float
) -> str:
    """Give an existing stream the file's limits, leaving every other key as the server has
    it; "updated", or "outdated" with a warning when the server or a permission refuses."""
    subject = f"{API}.STREAM.UPDATE.{name}"
    try:
        answer = await refused_by_permission(
            lambda: jetstream_api(nc, f"STREAM.UPDATE.{name}", {**actual, **limits},
                                  budget_s=budget_s),
            subject,
        )
    except (NotPermitted, ProvisioningDenied):
        log.warning("stream %s lacks the limits %s: this NATS user may not update it; run "
                    "`fleet nats --provision` with the operator's credentials", name, limits)
        return "outdated"
    if "error" in answer:
        log.warning("stream %s lacks the limits %s: the server refused them: %s (delete what "
                    "it names, or the stream, as the operator and provision again)", name,
                    limits, answer["error"].get("description"))
        return "outdated"
    log.info("stream %s: limits updated to %s", name, limits)
    await _warn_of_lasting_consumers(nc, name, budget_s)
    return "updated"


async def _warn_of_lasting_consumers(nc: Client, name: str, budget_s: float) -> None:
    """The server applies a new inactive threshold only to consumers made after it: name the
    durables made before (on these streams Fleet makes none: a reader's leftover, or an
    attack's), for the operator to remove."""
    listed = await jetstream_api(nc, f"CONSUMER.LIST.{name}", {"offset": 0}, budget_s=budget_s)
    lasting = sorted(
        consumer["name"] for consumer in listed.get("consumers") or []
        if consumer.get("config", {}).get("durable_name")
        or not consumer.get("config", {}).get("inactive_threshold")
    )
    if lasting:
        log.warning("stream %s keeps consumers made before its inactive threshold, which "
                    "never expire: %s (remove them: `nats consumer rm %s NAME`)", name,
                    ", ".join(lasting), name)


async def ensure_stream(
    nc: Client, config: dict[str, Any], replicas: int | None = None, *,
    budget_s: float = BROKER_BUDGET_S,
) -> Outcome:
    """Create the stream with `replicas` copies (None: as the file says) unless it exists."""
    name = config["name"]
    info = await jetstream_api(nc, f"STREAM.INFO.{name}", budget_s=budget_s)
    if "error" not in info:
        actual = info["config"]
        if diffs := _differences(config, actual, LIMIT_KEYS):
            raise ProvisioningConflict(f"stream {name} differs: " + "; ".join(diffs))
        action = "unchanged"
        if limits := limits_to_update(config, actual):
            action = await _update_limits(nc, name, actual, limits, budget_s)
        return Outcome(name, action, actual.get("num_replicas", 1))
    if info["error"].get("err_code") != 10059:  # stream not found
        raise ProvisioningConflict(f"stream {name}: {info['error'].get('description')}")
    if replicas is not None:
        config = {**config, "num_replicas": replicas}
    await _create_stream(nc, name, config, budget_s)
    return Outcome(name, "created", config.get("num_replicas", 1))


async def _create_stream(
    nc: Client, name: str, config: dict[str, Any], budget_s: float
) -> None:
    deadline = time.monotonic() + budget_s
    attempt = 0
    while True:
        created = await jetstream_api(nc, f"STREAM.CREATE.{name}", config, budget_s=budget_s)
        error = created.get("error")
        if error is None:
            return
        attempt += 1
        pause = pause_after(attempt)
        if error.get("err_code") != NO_PEERS_ERR_CODE or time.monotonic() + pause > deadline:
            raise ProvisioningConflict(f"stream {name}: {error.get('description')}")
        if attempt == 1:
            log.warning("stream %s: %s; waiting up to %.0f s for the cluster's servers to "
                        "join", name, error.get("description"), budget_s)
        await asyncio.sleep(pause)  # a retry backoff, not synchronisation


async def provision(
    nc: Client, directory: Path | None = None, *, replicas: int = 0,
    budget_s: float = BROKER_BUDGET_S,
) -> list[Outcome]:
    """Create every stream and bucket Fleet needs; safe to run from every process at start.

    `replicas` > 0 forces that many copies for what is created; 0 picks them from the
    cluster (asked once, only when something must be created). Logs what it chose, and warns
    about existing streams with fewer copies than the cluster could keep."""
    chosen: int | None = None
    outcomes = []
    for config in definitions(directory):
        name = config["name"]
        info = await jetstream_api(nc, f"STREAM.INFO.{name}", budget_s=budget_s)
        if "error" in info and chosen is None:
            chosen = await choose_replicas(nc, replicas)
            log.info("provisioning with %d replica(s) per stream (%s)", chosen,
                     "set by --replicas / FLEET_REPLICAS" if replicas else "from the cluster")
        outcomes.append(await ensure_stream(nc, config, chosen, budget_s=budget_s))
    for advice in replicas_advice(nc, outcomes, replicas):
        log.warning("%s", advice)
    return outcomes


async def ensure_task_consumer(
    nc: Client, model: str, *, max_deliver: int = 5, ack_wait_s: float = 30.0,
    budget_s: float = BROKER_BUDGET_S, priority: str = "default",
) -> Outcome:
    """The one durable pull consumer of a model's tasks of one priority class, shared by
    every worker serving it."""
    config = consumer_definition(model, max_deliver, ack_wait_s, priority)
    name = subjects.durable(model, priority)
    info = await jetstream_api(
        nc, f"CONSUMER.INFO.{subjects.TASKS_STREAM}.{name}", budget_s=budget_s
    )
    if "error" not in info:
        if diffs := _differences(config, info["config"]):
            raise ProvisioningConflict(
                f"consumer {name} differs: " + "; ".join(diffs) + " (every worker of a model "
                "must use the same --max-deliver and --ack-wait; to change them for the fleet, "
                f"`nats consumer rm {subjects.TASKS_STREAM} {name}` while no worker runs)"
            )
        return Outcome(name, "unchanged")
    body = {"stream_name": subjects.TASKS_STREAM, "config": config}
    created = await jetstream_api(
        nc, f"CONSUMER.CREATE.{subjects.TASKS_STREAM}.{name}", body, budget_s=budget_s
    )
    if "error" in created:
        raise ProvisioningConflict(f"consumer {name}: {created['error'].get('description')}")
    return Outcome(name, "created")
