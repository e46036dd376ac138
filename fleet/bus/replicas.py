"""How many copies Fleet's streams and buckets keep: 3 on a cluster that can hold three, 1 on
a single server, or what the operator set (`--replicas` / FLEET_REPLICAS).

Whether a cluster can hold three copies is asked of JetStream itself, not guessed from the
server list a client happens to know (gossip fills `connect_urls` only over the first moments
of a cluster's life, and a server may hide it): a throw-away in-memory R3 stream is created
and deleted. The server refuses it on a single server and when fewer than three JetStream
servers are up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import orjson
from nats.aio.client import Client
from nats.js.errors import ServiceUnavailableError
from nats.nuid import NUID

from fleet.bus.retry import with_retry

log = logging.getLogger(__name__)

CLUSTER_REPLICAS = 3
PROBE_BUDGET_S = 15.0


class _Stored(Protocol):
    name: str
    replicas: int


def pick_replicas(override: int, clustered: bool, holds_three: bool) -> int:
    """The decision, pure: an override wins; a cluster that holds three copies gets three."""
    if override > 0:
        return override
    return CLUSTER_REPLICAS if clustered and holds_three else 1


def advice(name: str, has: int, wanted: int) -> str | None:
    """The warning for an existing stream with fewer copies than wanted, with its fix."""
    if has >= wanted:
        return None
    return (
        f"stream {name} keeps {has} cop{'y' if has == 1 else 'ies'} but this cluster can keep "
        f"{wanted}: one lost server loses its data; raise it with "
        f"`nats stream edit {name} --replicas {wanted}`"
    )


def is_clustered(nc: Client) -> bool:
    return bool(nc._server_info.get("cluster"))


def known_servers(nc: Client) -> int:
    """Servers this client knows of: its list and what the cluster told it (a lower bound)."""
    found = {f"{uri.hostname}:{uri.port}" for uri in nc.servers}
    found.update(str(url) for url in nc._server_info.get("connect_urls") or [])
    return len(found)


async def choose_replicas(nc: Client, override: int = 0) -> int:
    if override > 0:
        return override
    clustered = is_clustered(nc)
    holds_three = clustered and await _holds(nc, CLUSTER_REPLICAS)
    chosen = pick_replicas(override, clustered, holds_three)
    log.info(
        "replicas: %d (%s)", chosen,
        "a cluster that holds 3 copies" if holds_three
        else "a cluster with fewer than 3 JetStream servers up" if clustered
        else "a single server",
    )
    return chosen


def replicas_advice(nc: Client, outcomes: Iterable[_Stored], override: int = 0) -> list[str]:
    """Warnings for existing streams with fewer copies than this cluster should keep."""
    if override > 0:
        wanted = override
    elif is_clustered(nc) and known_servers(nc) >= CLUSTER_REPLICAS:
        wanted = CLUSTER_REPLICAS
    else:
        return []
    return [text for o in outcomes if o.replicas and (text := advice(o.name, o.replicas, wanted))]


async def _holds(nc: Client, replicas: int) -> bool:
    """Create and delete an in-memory stream with `replicas` copies: can the cluster?"""
    name = f"FLEET_REPLICAS_PROBE_{NUID().next().decode()}"
    config = {
        "name": name, "subjects": [f"_fleet.replicas_probe.{name}"], "storage": "memory",
        "num_replicas": replicas, "max_msgs": 1,
    }
    created = await _request(nc, f"$JS.API.STREAM.CREATE.{name}", config)
    if "error" in created:
        log.info("replicas: the cluster cannot keep %d copies: %s", replicas,
                 created["error"].get("description"))
        return False
    with contextlib.suppress(Exception):
        await _request(nc, f"$JS.API.STREAM.DELETE.{name}", None)
    return True


async def _request(nc: Client, subject: str, body: dict[str, Any] | None) -> dict[str, Any]:
    payload = orjson.dumps(body) if body is not None else b""

    async def once() -> dict[str, Any]:
        reply = await nc.request(subject, payload, timeout=5.0)
        answer: dict[str, Any] = orjson.loads(reply.data)
        if answer.get("error", {}).get("code") == 503:  # no meta leader yet
            raise ServiceUnavailableError(**answer["error"])
        return answer

    return await with_retry(once, what=subject, budget_s=PROBE_BUDGET_S)
