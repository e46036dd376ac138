"""A KV value that outlives its bucket's max age: written with a per-message TTL of `never`
(`Nats-TTL: never`, on a bucket whose stream allows per-message TTLs), so its writer need
not rewrite it to keep it, and its readers hear it only when it changes.

FLEET_PREFIXES keeps its 60 s max age for anything written without the header (and for the
delete markers), but a runner's advert is written this way: an idle runner's summary used to
be rewritten every 20 s to stay alive, and each rewrite reached every worker of its model,
so a worker's idle traffic grew with the number of nodes serving its model (issue 22).

A bucket provisioned before it allowed per-message TTLs refuses the header (10166); the
caller is told (False) and writes plainly, refreshing as before.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from fleet.bus.denials import refused_by_permission
from fleet.bus.retry import BROKER_BUDGET_S, with_retry

NEVER = {"Nats-TTL": "never"}
TTL_DISABLED = 10166  # the stream does not allow per-message TTLs


async def put_lasting(js: JetStreamContext, kv: KeyValue, key: str, value: bytes, *,
                      budget_s: float = BROKER_BUDGET_S) -> bool:
    """Write the key never to expire by age; False (nothing written) where the bucket does
    not allow per-message TTLs."""
    subject = f"{kv._pre}{key}"  # nats-py's prefix for the bucket's keys: `$KV.<bucket>.`

    async def once() -> bool:
        try:
            await refused_by_permission(lambda: js.publish(subject, value, headers=NEVER),
                                        subject)
        except BadRequestError as exc:
            if exc.err_code == TTL_DISABLED:
                return False
            raise
        return True

    return await with_retry(once, what=f"write {kv._name}/{key}", budget_s=budget_s)
