"""A KV value written never to expire by age (fleet.bus.kv_lasting), on a real nats-server:
the advert of an idle runner outlives its bucket's max age without a rewrite, and a bucket
provisioned before it allowed per-message TTLs is told apart (nothing written)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from fleet.bus.kv_calls import kv_put
from fleet.bus.kv_lasting import put_lasting
from fleet.wire import subjects
from fleet.worker.prefix_adverts import PrefixAdverts
from fleet.worker.state import WorkerState

MAX_AGE_S = 1.0


async def _bucket(nc: Client, name: str, allow_ttl: bool) -> None:
    config = {"name": f"KV_{name}", "subjects": [f"$KV.{name}.>"], "max_msgs_per_subject": 1,
              "max_age": int(MAX_AGE_S * 1e9), "allow_rollup_hdrs": True,
              "allow_direct": True, "storage": "memory", "discard": "new",
              "allow_msg_ttl": allow_ttl}
    answer = orjson.loads((await nc.request(f"$JS.API.STREAM.CREATE.KV_{name}",
                                            orjson.dumps(config), timeout=5)).data)
    assert "error" not in answer, answer


async def _gone(kv: object, key: str, within_s: float) -> bool:
    """Whether the key expires within `within_s` (the server removes it at its max age)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            await kv.get(key)  # type: ignore[attr-defined]
        except KeyNotFoundError:
            return True
        await asyncio.sleep(0.1)  # polling an expiry the server does not announce
    return False


async def test_a_lasting_value_outlives_the_max_age_a_plain_one_does_not(
    provisioned_nc: Client,
) -> None:
    await _bucket(provisioned_nc, "LASTING", allow_ttl=True)
    js = provisioned_nc.jetstream()
    kv = await js.key_value("LASTING")
    assert await put_lasting(js, kv, "m.r1", b"advert")
    await kv_put(kv, "m.r2", b"plain")
    # The plain one goes at the bucket's max age; by then the lasting one would have too.
    assert await _gone(kv, "m.r2", MAX_AGE_S * 10)
    assert not await _gone(kv, "m.r1", MAX_AGE_S * 2)
    assert (await kv.get("m.r1")).value == b"advert"


async def test_a_bucket_without_per_message_ttls_is_told_apart(provisioned_nc: Client) -> None:
    await _bucket(provisioned_nc, "OLDER", allow_ttl=False)
    js = provisioned_nc.jetstream()
    kv = await js.key_value("OLDER")
    assert not await put_lasting(js, kv, "m.r1", b"advert")
    with contextlib.suppress(KeyNotFoundError):
        assert (await kv.get("m.r1")).value is None  # nothing was written


async def test_the_provisioned_prefixes_bucket_takes_lasting_adverts(
    provisioned_nc: Client,
) -> None:
    js = provisioned_nc.jetstream()
    adverts = PrefixAdverts(js, lambda: WorkerState(node_id="n"))
    kv = await js.key_value(subjects.PREFIXES_BUCKET)
    await adverts._put(kv, "m.r1", b"{}")
    assert adverts.lasting  # ops/jetstream allows them: no refresh needed
    entry = await js.get_last_msg("KV_FLEET_PREFIXES", "$KV.FLEET_PREFIXES.m.r1")
    assert (entry.headers or {}).get("Nats-TTL") == "never"
