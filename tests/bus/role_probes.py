"""One probe per row of fleet.bus.roles.ACTIONS: the raw NATS operations of that action.

A probe only has to *attempt* its action: the matrix test calls an action denied when the
server reports a permission violation for it, and allowed when it completes without one (an
API error such as "consumer already exists" still means the server let the request through).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import KeyNotFoundError

from fleet.bus.objects import ObjectBucket
from fleet.bus.replies import inbox_prefix

TIMEOUT = 5.0
MODEL = "probe-model"
TASK_ID = "probe-task"
VICTIM = "tasks-victim"  # a FLEET_TASKS durable that delete probes aim at
IMAGE_BYTES = b"probe image bytes"
IMAGE = hashlib.sha256(IMAGE_BYTES).hexdigest()  # a stored image is named by its hash


@dataclass
class Probe:
    nc: Client
    admin: Client  # an operator connection, to set up what a probe aims at
    role: str

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream(timeout=TIMEOUT)

    async def request(self, subject: str, body: dict | None = None) -> bytes:
        payload = json.dumps(body).encode() if body is not None else b""
        return (await self.nc.request(subject, payload, timeout=TIMEOUT)).data

    async def sent(self, subject: str, data: bytes = b"{}") -> None:
        await self.nc.publish(subject, data)
        await self.nc.flush(timeout=TIMEOUT)

    async def subscribed(self, subject: str) -> None:
        await self.nc.subscribe(subject)
        await self.nc.flush(timeout=TIMEOUT)


async def _publish_task(p: Probe) -> None:
    await p.js.publish(f"fleet.tasks.{MODEL}", b"{}")


async def _cancel_task(p: Probe) -> None:
    kv = await p.js.key_value("FLEET_CANCELS")
    await kv.put(TASK_ID, b"{}")
    await p.sent(f"fleet.cancel.{TASK_ID}")


async def _replay_output(p: Probe) -> None:
    sub = await p.js.subscribe(f"fleet.out.{TASK_ID}", stream="FLEET_OUT", ordered_consumer=True)
    await sub.next_msg(timeout=TIMEOUT)
    await sub.unsubscribe()


async def _consume_tasks(p: Probe) -> None:
    await p.admin.jetstream().publish(f"fleet.tasks.{MODEL}", b"{}")
    sub = await p.js.pull_subscribe_bind(f"tasks-{MODEL}", stream="FLEET_TASKS")
    for msg in await sub.fetch(1, timeout=TIMEOUT):
        await msg.term()  # nobody else should see a probe's task again


async def _create_task_consumer(p: Probe) -> None:
    name = f"tasks-made-by-{p.role}"
    config = {"durable_name": name, "ack_policy": "explicit",
              "filter_subject": f"fleet.tasks.made-by-{p.role}"}
    await p.request(f"$JS.API.CONSUMER.CREATE.FLEET_TASKS.{name}",
                    {"stream_name": "FLEET_TASKS", "config": config})


async def _delete_task_consumer(p: Probe) -> None:
    await p.request(f"$JS.API.CONSUMER.DELETE.FLEET_TASKS.{VICTIM}")


async def _delete_out_consumer(p: Probe) -> None:
    made = await p.admin.jetstream().add_consumer(
        "FLEET_OUT", api.ConsumerConfig(inactive_threshold=30.0, filter_subject="fleet.out.x")
    )
    await p.request(f"$JS.API.CONSUMER.DELETE.FLEET_OUT.{made.name}")


async def _scratch(p: Probe, name: str) -> str:
    await p.admin.jetstream().add_stream(name=name, subjects=[f"scratch.{name}"])
    return name


async def _create_stream(p: Probe) -> None:
    name = f"MADE_BY_{p.role.upper()}"
    await p.request(f"$JS.API.STREAM.CREATE.{name}", {"name": name, "subjects": [f"m.{name}"]})


async def _update_stream(p: Probe) -> None:
    name = await _scratch(p, f"UPDATED_BY_{p.role.upper()}")
    await p.request(f"$JS.API.STREAM.UPDATE.{name}",
                    {"name": name, "subjects": [f"scratch.{name}"], "max_msgs": 10})


async def _delete_stream(p: Probe) -> None:
    name = await _scratch(p, f"DELETED_BY_{p.role.upper()}")
    await p.request(f"$JS.API.STREAM.DELETE.{name}")


async def _purge_stream(p: Probe) -> None:
    await p.request("$JS.API.STREAM.PURGE.FLEET_OUT", {"filter": "fleet.out.nothing-here"})


async def _purge_model_tasks(p: Probe) -> None:
    await p.request("$JS.API.STREAM.PURGE.FLEET_TASKS", {"filter": "fleet.tasks.no-such-model"})


async def _read_state(p: Probe) -> None:
    for bucket in ("FLEET_NODES", "FLEET_CAPABILITIES", "FLEET_INSTANCES", "FLEET_RUNNERS"):
        kv = await p.js.key_value(bucket)
        with contextlib.suppress(KeyNotFoundError):  # FLEET_NODES keys expire in 15 s
            await kv.get("probe")
        watcher = await kv.watchall()
        await watcher.updates(timeout=TIMEOUT)
        await watcher.stop()


async def _write_state(p: Probe) -> None:
    for bucket in ("FLEET_NODES", "FLEET_CAPABILITIES", "FLEET_RUNNERS"):
        await p.js.publish(f"$KV.{bucket}.written-by-{p.role}", b"{}")


async def _advertise_prefixes(p: Probe) -> None:
    """As fleet.worker.prefix_adverts does it: an advert never to expire by age."""
    await p.js.publish(f"$KV.FLEET_PREFIXES.written-by-{p.role}", b"{}",
                       headers={"Nats-TTL": "never"})
    kv = await p.js.key_value("FLEET_PREFIXES")
    with contextlib.suppress(KeyNotFoundError):
        await kv.get("probe")


async def _hold_lease(p: Probe) -> None:
    """As fleet.worker.sweeper does it: a create, then a renewal on its revision."""
    kv = await p.js.key_value("FLEET_LEASES")
    revision = await kv.create(f"held-by-{p.role}", b"probe")
    await kv.update(f"held-by-{p.role}", b"probe", last=revision)


async def _write_instances(p: Probe) -> None:
    """As fleet.placement does it: a create (compare-and-set) and a delete marker."""
    kv = await p.js.key_value("FLEET_INSTANCES")
    await kv.create(f"placed-by-{p.role}", b"{}")
    await kv.delete(f"placed-by-{p.role}")


async def _put_image(p: Probe) -> None:
    await ObjectBucket(p.nc, timeout=TIMEOUT).put_by_hash(f"image of {p.role}".encode())


async def _upload_image(p: Probe) -> None:
    await p.sent("fleet.images.put", f"upload of {p.role}".encode())


async def _durable_out_consumer(p: Probe) -> None:
    """The attack of issue 31: a durable on a named create whose filter token is `>`."""
    name = f"durable-of-{p.role}"
    for stream, filter_subject in (("FLEET_OUT", "fleet.out.>"),
                                   ("OBJ_FLEET_IMAGES", "$O.FLEET_IMAGES.M.>")):
        config = {"durable_name": name, "ack_policy": "none", "filter_subject": filter_subject,
                  "deliver_subject": f"_INBOX.{name}"}
        await p.request(f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter_subject}",
                        {"stream_name": stream, "config": config})
        await p.request(f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}",
                        {"stream_name": stream, "config": config})


async def _read_models(p: Probe) -> None:
    kv = await p.js.key_value("FLEET_MODELS")
    await kv.get("probe-model")
    await ObjectBucket(p.nc, "FLEET_WEIGHTS", timeout=TIMEOUT, named_by_hash=True).get(IMAGE)


async def _publish_models(p: Probe) -> None:
    weights = ObjectBucket(p.nc, "FLEET_WEIGHTS", timeout=TIMEOUT, named_by_hash=True)
    await weights.put_by_hash(f"weights of {p.role}".encode())
    kv = await p.js.key_value("FLEET_MODELS")
    await kv.put(f"made-by-{p.role}", b"{}")


async def _remove_model_files(p: Probe) -> None:
    await p.js.purge_stream("OBJ_FLEET_WEIGHTS", subject="$O.FLEET_WEIGHTS.C.nothing")


async def _get_image(p: Probe) -> None:
    await ObjectBucket(p.nc, timeout=TIMEOUT).get(IMAGE)


async def _read_traces(p: Probe) -> None:
    sub = await p.js.subscribe("fleet.traces.probe", stream="FLEET_TRACES", ordered_consumer=True)
    await sub.next_msg(timeout=TIMEOUT)
    await sub.unsubscribe()


async def _claim_task_id(p: Probe) -> None:
    kv = await p.js.key_value("FLEET_CLAIMS")
    await kv.create(f"claimed-by-{p.role}", b"probe")
    await p.js.publish(f"fleet.refused.{MODEL}", b"{}")


async def _answer_asks(p: Probe) -> None:
    await p.nc.subscribe("fleet.ask.*", queue="fleet-ask")
    await p.nc.flush(timeout=TIMEOUT)


async def _tenant_records(p: Probe) -> None:
    kv = await p.js.key_value("FLEET_TENANTS")
    await kv.put(f"task.owned-by-{p.role}", b"tenant")
    await kv.get(f"task.owned-by-{p.role}")


async def _batch_jobs(p: Probe) -> None:
    for bucket in ("FLEET_BATCHES", "FLEET_BATCH_LEASES", "FLEET_IDEMPOTENCY"):
        kv = await p.js.key_value(bucket)
        await kv.put(f"made-by-{p.role}", b"{}")
        await kv.get(f"made-by-{p.role}")
    await ObjectBucket(p.nc, "FLEET_FILES", named_by_hash=False, timeout=TIMEOUT).put(
        f"file-of-{p.role}", b'{"custom_id": "1"}')
    await p.js.publish(f"fleet.batches.by-{p.role}.0", b"{}")


async def _fair_share(p: Probe) -> None:
    kv = await p.js.key_value("FLEET_FAIRNESS")
    await kv.put(f"m.default.by-{p.role}", b"{}")
    await kv.get(f"m.default.by-{p.role}")
    await p.subscribed("$KV.FLEET_FAIRNESS.m.default.*")


async def _charge_fair_share(p: Probe) -> None:
    kv = await p.js.key_value("FLEET_FAIRNESS")
    await kv.put(f"m.default.charged-by-{p.role}", b"{}")
    await kv.get(f"m.default.charged-by-{p.role}")


async def _set_deadline(p: Probe) -> None:
    await p.js.publish(f"fleet.deadlines.{MODEL}.probe-{p.role}", b"", headers={"Nats-TTL": "60s"})


async def _expire_deadlines(p: Probe) -> None:
    await p.admin.jetstream().publish(f"fleet.deadlines.{MODEL}.for-{p.role}", b"",
                                      headers={"Nats-TTL": "60s"})
    sub = await p.js.pull_subscribe("", durable="deadlines", stream="FLEET_DEADLINES")
    await sub.fetch(1, timeout=TIMEOUT)


async def _hand_off_task(p: Probe) -> None:
    await p.subscribed("fleet.handoff.probe")
    await p.sent("fleet.handoff.probe")


async def _liveness_probes(p: Probe) -> None:
    await p.subscribed("fleet.alive.probe")
    await p.sent("fleet.alive.probe")


def _another_role(role: str) -> str:
    return "client" if role == "worker" else "worker"


PROBES: dict[str, Callable[[Probe], Awaitable[None]]] = {
    "publish_task": _publish_task,
    "cancel_task": _cancel_task,
    "ask": lambda p: p.sent(f"fleet.ask.{MODEL}"),
    "answer_asks": _answer_asks,
    "follow_output": lambda p: p.subscribed(f"fleet.out.{TASK_ID}"),
    "replay_output": _replay_output,
    "publish_output": lambda p: p.sent(f"fleet.out.{TASK_ID}"),
    "read_queued_task": lambda p: p.js.get_msg("FLEET_TASKS", seq=1),
    "direct_get_task": lambda p: p.request("$JS.API.DIRECT.GET.FLEET_TASKS", {"seq": 1}),
    "subscribe_tasks": lambda p: p.subscribed("fleet.tasks.>"),
    "consume_tasks": _consume_tasks,
    "create_task_consumer": _create_task_consumer,
    "task_consumer_info": lambda p: p.js.consumer_info("FLEET_TASKS", f"tasks-{MODEL}"),
    "delete_task_consumer": _delete_task_consumer,
    "reset_task_consumer": lambda p: p.request(
        f"$JS.API.CONSUMER.RESET.FLEET_TASKS.{VICTIM}", {"seq": 1}),
    "delete_out_consumer": _delete_out_consumer,
    "stream_info": lambda p: p.js.stream_info("KV_FLEET_NODES"),
    "create_stream": _create_stream,
    "update_stream": _update_stream,
    "delete_stream": _delete_stream,
    "purge_stream": _purge_stream,
    "purge_model_tasks": _purge_model_tasks,
    "read_state": _read_state,
    "write_state": _write_state,
    "advertise_prefixes": _advertise_prefixes,
    "hold_lease": _hold_lease,
    "write_instances": _write_instances,
    "read_dead_letters": lambda p: p.js.get_msg("FLEET_DEAD", seq=1),
    "put_image": _put_image,
    "upload_image": _upload_image,
    "answer_uploads": lambda p: p.subscribed("fleet.images.put"),
    "durable_out_consumer": _durable_out_consumer,
    "get_image": _get_image,
    "read_models": _read_models,
    "publish_models": _publish_models,
    "remove_model_files": _remove_model_files,
    "read_traces": _read_traces,
    "publish_traces": lambda p: p.sent("fleet.traces.probe"),
    "publish_events": lambda p: p.sent("fleet.events.node.probe"),
    "subscribe_cancels": lambda p: p.subscribed("fleet.cancel.*"),
    "dead_letter": lambda p: p.sent(f"fleet.dead.{MODEL}"),
    "claim_task_id": _claim_task_id,
    "tenant_records": _tenant_records,
    "batch_jobs": _batch_jobs,
    "fair_share": _fair_share,
    "charge_fair_share": _charge_fair_share,
    "expire_deadlines": _expire_deadlines,
    "set_deadline": _set_deadline,
    "hand_off_task": _hand_off_task,
    "liveness_probes": _liveness_probes,
    "own_inbox": lambda p: p.subscribed(f"{inbox_prefix(p.role)}.probe.>"),
    "all_inboxes": lambda p: p.subscribed("_INBOX.>"),
    "other_inbox": lambda p: p.subscribed(f"{inbox_prefix(_another_role(p.role))}.>"),
    "unprefixed_inbox": lambda p: p.subscribed("_INBOX.Xk3pQz9RfL2mYv8TnW4aBc.*"),
    "answer_on_inbox": lambda p: p.sent("_INBOX.client.probe.1"),
    "publish_gateway_inbox": lambda p: p.sent("_INBOX.gateway.probe.1"),
}
# Rows whose bucket another change provisions: skipped where ops/jetstream lacks it.
NEEDS = {"claim_task_id": "KV_FLEET_CLAIMS.json", "tenant_records": "KV_FLEET_TENANTS.json",
         "batch_jobs": "KV_FLEET_BATCHES.json", "expire_deadlines": "FLEET_DEADLINES.json",
         "set_deadline": "FLEET_DEADLINES.json"}


async def prepare(admin: Client) -> None:
    """What the probes aim at: a queued task and its model's durable, a victim durable, one
    output, one trace span, one image and one key per state bucket."""
    from fleet.bus.provision import ensure_task_consumer

    js = admin.jetstream()
    await ensure_task_consumer(admin, MODEL)
    await ensure_task_consumer(admin, "victim")
    await js.publish(f"fleet.tasks.{MODEL}", b"{}")
    await js.publish(f"fleet.out.{TASK_ID}", b"{}")
    await js.publish("fleet.traces.probe", b"{}")
    await js.publish(f"fleet.dead.{MODEL}", b"{}")
    for bucket in ("FLEET_NODES", "FLEET_INSTANCES", "FLEET_RUNNERS"):
        await js.publish(f"$KV.{bucket}.probe", b"{}")
    await ObjectBucket(admin).put_by_hash(IMAGE_BYTES)
    await ObjectBucket(admin, "FLEET_WEIGHTS", named_by_hash=True).put_by_hash(IMAGE_BYTES)
    await js.publish("$KV.FLEET_MODELS.probe-model", b"{}")
