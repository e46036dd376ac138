"""What each connection received, as nats-server counts it (`/connz` of its monitoring port),
not as Fleet's own counters say: for `fleet bench --only scale`.

A connection's `out_msgs` / `out_bytes` are what the server sent to it, i.e. what that client
received; they are summed over the connections whose name a role uses ("fleet-worker",
"fleet-gateway").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Received:
    msgs: int = 0
    bytes: int = 0

    def __sub__(self, other: Received) -> Received:
        return Received(self.msgs - other.msgs, self.bytes - other.bytes)

    def __add__(self, other: Received) -> Received:
        return Received(self.msgs + other.msgs, self.bytes + other.bytes)


def received_by(connz: dict[str, Any], name: str) -> Received:
    """Pure: what the connections named `name` have received so far."""
    msgs = total = 0
    for conn in connz.get("connections") or []:
        if conn.get("name") == name:
            msgs += int(conn.get("out_msgs", 0))
            total += int(conn.get("out_bytes", 0))
    return Received(msgs, total)


def subscriptions_of(connz: dict[str, Any], name: str) -> list[str]:
    """Pure: the subjects the connections named `name` subscribe to (with `subs=1`)."""
    return [s for conn in connz.get("connections") or [] if conn.get("name") == name
            for s in conn.get("subscriptions_list") or []]


async def read_connz(monitor_url: str, subs: bool = False) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        params = {"limit": "100000", **({"subs": "1"} if subs else {})}
        answer = await client.get(f"{monitor_url}/connz", params=params)
        answer.raise_for_status()
        data: dict[str, Any] = answer.json()
        return data
