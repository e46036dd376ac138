"""Reply subjects are capabilities (issue 31): every place a Fleet process publishes on a
subject taken from a message answers only the shape it expects, and each role reads only its
own inboxes. Everything runs against a real nats-server with the shipped roles
(ops/nats/auth.conf), each side connected as its own role; the attacks are the issue's probes
made with raw nats-py as a `client`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from fleet.aio import Supervisor
from fleet.bus.chunks import STALLED_HEADER, _answer_control
from fleet.bus.connect import ConnectOptions, connect, inbox_owner, js_publish
from fleet.bus.objects import ObjectBucket
from fleet.bus.provision import ensure_task_consumer, provision
from fleet.bus.replies import flow_control, inbox_prefix, inbox_reply, task_ack
from fleet.bus.roles import ALL_STREAMS
from fleet.commands.tasks import cancel_task, follow_task
from fleet.config import Settings
from fleet.placement import remove
from fleet.wire import subjects
from fleet.wire.ask import AskAnswer, AskError
from fleet.wire.codec import ASK_REPLY, decode_model, decode_task, decode_with, encode
from fleet.wire.events import TaskFinished, TaskRefused, TokenChunk
from fleet.wire.handoff import HandOffAnswer, TaskHandOff
from fleet.worker.asks import AskResponder
from fleet.worker.claims import Claims
from fleet.worker.handoff import HandOffs
from fleet.worker.inbox import HandedIn, Inbox
from fleet.worker.outputs import event_msg_id
from tests.secured import PASSWORDS, shipped_auth_server

MODEL = "probe-model"
VICTIM_TASK = "victim-task"
WEIGHTS = b"weights of a published model"
ACK_V1 = "$JS.ACK.FLEET_TASKS.tasks-tiny-llm.1.7.7.1764700000000000000.0"
ACK_V2 = "$JS.ACK._.ACCHASH.FLEET_TASKS.tasks-tiny-llm.1.7.7.1764700000000000000.0.rNd"
INVALID_TASK = b'{"prompt": "x", "max_tokens": -1}'  # answered at once, never published


# -- the pure checks ---------------------------------------------------------------------------

@pytest.mark.parametrize(("subject", "expected"), [
    ("_INBOX.client.Xk3pQz9RfL2mYv8TnW4aBc.1", True),
    ("_INBOX.Xk3pQz9RfL2mYv8TnW4aBc.Xk3pQz9RfL2mYv8TnW4aBc", True),  # nats-py's default
    ("_INBOX.worker.a-b_c", True),
    ("_INBOX.x", True),
    (None, False), ("", False), ("_INBOX", False), ("_INBOX.", False), ("_INBOX..x", False),
    ("_INBOX.x.", False), ("_INBOX.*", False), ("_INBOX.>", False), ("_INBOX.client.>", False),
    ("_INBOX.a b", False), ("_INBOX.ü", False), ("_INBOXES.x", False), ("_inbox.x", False),
    ("x._INBOX.y", False), ("_INBOX." + "x" * 300, False),
    ("$KV.FLEET_NODES.evil", False), ("$O.FLEET_WEIGHTS.M.abc", False),
    ("$JS.API.STREAM.PURGE.FLEET_TASKS", False), ("$JS.ACK.FLEET_TASKS.x", False),
    ("fleet.out.victim", False), ("fleet.tasks.m", False), ("$SYS.REQ.SERVER.PING", False),
])
def test_only_an_inbox_is_a_reply_a_responder_answers(subject: str | None,
                                                       expected: bool) -> None:
    assert inbox_reply(subject) == (subject if expected else None)


@pytest.mark.parametrize(("subject", "expected"), [
    ("_INBOX.client.Xk3pQz9RfL2mYv8TnW4aBc.1", True), ("_INBOX.Xk3pQz9RfL2mYv8TnW4aBc.1", True),
    ("_INBOX.workers.x", True), ("_INBOX.worker.Xk3pQz9RfL2mYv8TnW4aBc.1", False),
    ("_INBOX.worker", True),  # not under it: the prefix itself is no inbox of its
])
def test_an_answer_can_be_kept_out_of_the_responders_own_inboxes(subject: str,
                                                                  expected: bool) -> None:
    assert inbox_reply(subject, not_under="_INBOX.worker") == (subject if expected else None)


@pytest.mark.parametrize(("subject", "expected"), [
    ("$JS.FC.FLEET_OUT.Xk3pQz9RfL2mYv8TnW4aBc.1", True), ("$JS.FC.x", True),
    (None, False), ("$JS.FC", False), ("$JS.FC.>", False), ("$JS.FC.*", False),
    ("$KV.FLEET_NODES.evil", False), ("_INBOX.client.x", False), ("$JS.FCX.a", False),
])
def test_only_a_flow_control_subject_gets_a_flow_control_answer(subject: str | None,
                                                                 expected: bool) -> None:
    assert flow_control(subject) == (subject if expected else None)


@pytest.mark.parametrize(("subject", "expected"), [
    (ACK_V1, True), (ACK_V2, True), (ACK_V2.rsplit(".", 1)[0], True),
    (None, False), ("$JS.ACK.FLEET_TASKS.x", False), ("$JS.ACK.FLEET_OUT.c.1.7.7.1.0", False),
    ("$JS.ACK.FLEET_TASKS.c.1.7.7.1.x", False), ("$JS.ACK.FLEET_TASKS.c.1.7.7.1.0.9", False),
    ("$JS.ACK.FLEET_TASKS.>", False), ("$JS.ACK.FLEET_TASKS.c.1.7.*.1.0", False),
    ("$JS.ACK._.H.FLEET_OUT.c.1.7.7.1.0", False), ("$KV.FLEET_NODES.evil", False),
    ("_INBOX.worker.x", False),
])
def test_a_handed_over_ack_subject_acks_a_fleet_tasks_delivery_only(subject: str | None,
                                                                    expected: bool) -> None:
    assert task_ack(subject) == (subject if expected else None)


@pytest.mark.parametrize(("user", "role", "owner"), [
    ("client", "client", "client"), ("worker", "worker", "worker"),
    ("alice", "client", "alice"),  # a user of one's own: a prefix of one's own
    ("", "worker", "worker"),  # a .creds / NKey login or an open server: the process's role
    ("bob@corp", "gateway", "gateway"), ("a.b", "client", "client"),  # not one token
])
def test_a_connection_makes_its_inboxes_under_its_user_or_role(user: str, role: str,
                                                               owner: str) -> None:
    assert inbox_owner(user, role) == owner
    assert inbox_prefix(owner) == f"_INBOX.{owner}"


@pytest.mark.parametrize("owner", ["", "a.b", "*", ">", "a b"])
def test_an_inbox_prefix_is_one_token(owner: str) -> None:
    with pytest.raises(ValueError, match="one subject token"):
        inbox_prefix(owner)


# -- a server with the shipped roles, and state worth attacking -------------------------------

@pytest.fixture(scope="module")
def secured_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shipped_auth_server(tmp_path_factory.mktemp("replies")) as url:
        asyncio.run(_prepare(url))
        yield url


async def _prepare(url: str) -> None:
    """One record in every store the issue's probes aimed at, none in the buckets whose keys
    expire within a test (FLEET_NODES, FLEET_RUNNERS, FLEET_PREFIXES: any write there shows)."""
    admin = await as_role(url, "operator")
    try:
        await provision(admin)
        js = admin.jetstream()
        await ensure_task_consumer(admin, MODEL)
        await js.publish(subjects.tasks(MODEL), b"{}")  # a queued task a purge would remove
        await js.publish(subjects.out(VICTIM_TASK), b"{}")
        for bucket in ("FLEET_INSTANCES", "FLEET_CLAIMS", "FLEET_MODELS", "FLEET_CANCELS",
                       "FLEET_TENANTS"):
            await js.publish(f"$KV.{bucket}.{VICTIM_TASK}", b"{}")
        await ObjectBucket(admin, "FLEET_WEIGHTS", named_by_hash=True).put_by_hash(WEIGHTS)
        await ObjectBucket(admin).put_by_hash(b"an image")
    finally:
        await admin.close()


async def as_role(url: str, role: str, **options: Any) -> Client:
    """Raw nats-py as `role`, with the inbox prefix its grants allow (as a NATS CLI user
    passes `--inbox-prefix`)."""
    return await nats.connect(url, user=role, password=PASSWORDS[role], connect_timeout=5,
                              allow_reconnect=False, inbox_prefix=inbox_prefix(role), **options)


async def as_fleet(url: str, role: str) -> Client:
    """The way a Fleet process connects (fleet.bus.connect), as `role`."""
    return await connect(url, f"test-{role}", inbox_owner=role,
                         options=ConnectOptions(user=role, password=PASSWORDS[role]))


Snapshot = dict[str, tuple[int, int, list[str]]]


async def snapshot(admin: Client) -> Snapshot:
    """Every stream, bucket and object store: messages, last sequence and consumers."""
    js = admin.jetstream()
    found: Snapshot = {}
    for stream in ALL_STREAMS:
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            continue
        consumers = sorted(c.name for c in await js.consumers_info(stream))
        found[stream] = (info.state.messages, info.state.last_seq, consumers)
    return found


@contextlib.asynccontextmanager
async def responding(url: str) -> AsyncIterator[Client]:
    """A worker's ask responder, connected as the worker role, owned by a supervisor."""
    worker = await as_fleet(url, "worker")
    try:
        async with Supervisor("asks") as owner:
            responder = AskResponder(worker, worker.jetstream(), 10.0, owner)
            await responder.start()
            try:
                yield worker
            finally:
                await responder.close()
                await owner.cancel_all()
    finally:
        await worker.close()


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def weights_name() -> str:
    return hashlib.sha256(WEIGHTS).hexdigest()


def refusals(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- item 1: the ask responder is no confused deputy ------------------------------------------

async def test_the_issues_ask_probes_write_nothing_and_an_honest_ask_is_answered(
    secured_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A `client` asks a valid task with a reply naming a key, an object's description or
    another task's output: the worker runs nothing and writes nothing. Then a real ask on the
    client's own inbox gets its answer (an operator plays the runner)."""
    caplog.set_level(logging.WARNING, logger="fleet.worker.asks")
    admin = await as_role(secured_url, "operator")
    client = await as_role(secured_url, "client")
    weights = weights_name()
    hostile = [
        "$KV.FLEET_NODES.evil", f"$KV.FLEET_CLAIMS.{VICTIM_TASK}",
        f"$KV.FLEET_INSTANCES.{VICTIM_TASK}", f"$KV.FLEET_MODELS.{MODEL}",
        meta_subject("FLEET_WEIGHTS", weights), subjects.out(VICTIM_TASK),
    ]
    task = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        async with responding(secured_url):
            before = await snapshot(admin)
            for reply in hostile:
                await client.publish(subjects.ask(MODEL), json.dumps(task).encode(), reply=reply)
            await client.flush()
            # The honest ask comes after them on the same subscription: once answered, they
            # have been taken (and refused) before it.
            runner = await _play_runner(admin)
            asked = await client.request(subjects.ask(MODEL), json.dumps(task).encode(),
                                         timeout=30)
            answer = decode_with(ASK_REPLY, asked.data)
            assert isinstance(answer, AskAnswer), answer
            assert (answer.status, answer.text) == ("completed", "hi")
            await runner.unsubscribe()
        after = await snapshot(admin)
    finally:
        await client.close()
        await admin.close()
    changed = {s for s in before if before[s] != after[s]}
    # The honest ask published one task and its runner two events; nothing else moved.
    assert changed <= {"FLEET_TASKS", "FLEET_OUT", "KV_FLEET_CLAIMS"}, changed
    assert after["FLEET_TASKS"][1] == before["FLEET_TASKS"][1] + 1  # the honest one only
    assert after["FLEET_OUT"][1] == before["FLEET_OUT"][1] + 2
    assert after["KV_FLEET_CLAIMS"] == before["KV_FLEET_CLAIMS"]
    logged = refusals(caplog, "is not an inbox")
    assert len(logged) == len(hostile) and all(any(r in line for line in logged)
                                               for r in hostile[:4]), logged


async def _play_runner(admin: Client) -> Any:
    """The operator as the runner of `MODEL`: each task published gets a token and its end."""
    js = admin.jetstream()

    async def run(msg: Msg) -> None:
        task_id = decode_task(msg.data).task_id
        for event in (TokenChunk(task_id=task_id, at=time.time(), index=0, token_id=0, text="hi"),
                      TaskFinished(task_id=task_id, at=time.time(), status="completed",
                                   finish_reason="length")):
            await js_publish(js, subjects.out(task_id), event, msg_id=event_msg_id(event))

    sub = await admin.subscribe(subjects.tasks(MODEL), cb=run)
    await admin.flush()
    return sub


def hostile_replies(weights: str) -> list[str]:
    """~60 reply subjects of every kind a requester could choose."""
    buckets = ("FLEET_NODES", "FLEET_INSTANCES", "FLEET_RUNNERS", "FLEET_CANCELS",
               "FLEET_CLAIMS", "FLEET_TENANTS", "FLEET_MODELS", "FLEET_PREFIXES")
    return [
        *(f"$KV.{b}.evil" for b in buckets), *(f"$KV.{b}.{VICTIM_TASK}" for b in buckets),
        meta_subject("FLEET_WEIGHTS", weights), f"$O.FLEET_WEIGHTS.C.{weights[:22]}",
        meta_subject("FLEET_IMAGES", "x"), "$O.FLEET_IMAGES.C.x",
        subjects.out(VICTIM_TASK), subjects.out("fresh-task"), subjects.tasks(MODEL),
        subjects.ask(MODEL), subjects.cancel(VICTIM_TASK), subjects.handoff("node-1"),
        subjects.node_event("node-1"), subjects.traces("t"), subjects.dead_letter(MODEL),
        subjects.refused(MODEL), "fleet.images.put",
        "$JS.API.STREAM.PURGE.FLEET_TASKS", "$JS.API.STREAM.DELETE.FLEET_OUT",
        f"$JS.API.CONSUMER.DELETE.FLEET_TASKS.tasks-{MODEL}",
        "$JS.API.STREAM.MSG.DELETE.FLEET_TASKS", "$JS.API.INFO", ACK_V1, ACK_V2,
        "$JS.FC.FLEET_OUT.x.1", "$SYS.REQ.SERVER.PING",
        # inboxes' near-misses and inboxes not the asker's
        "_INBOX", "_INBOX..x", "_INBOXx.y", "_inbox.client.x", "_INBOX.client.x.",
        "_INBOX." + "x" * 300, "_INBOX.ü", "x._INBOX.client.y",
        "_INBOX.gateway.Xk3pQz9RfL2mYv8TnW4aBc.1", "_INBOX.worker.Xk3pQz9RfL2mYv8TnW4aBc.1",
        "_INBOX.Xk3pQz9RfL2mYv8TnW4aBc.1",
        "x", "fleet", "evil.subject", "$KV", "$O", "$JS",
    ]


async def test_asks_with_sixty_kinds_of_reply_subject_change_no_stream_bucket_or_object(
    secured_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="fleet.worker.asks")
    admin = await as_role(secured_url, "operator")
    client = await as_role(secured_url, "client")
    replies = hostile_replies(weights_name())
    assert len(replies) >= 50
    try:
        async with responding(secured_url) as worker:
            before = await snapshot(admin)
            for reply in replies:
                await client.publish(subjects.ask(MODEL), INVALID_TASK, reply=reply)
            await client.flush()
            honest = await client.request(subjects.ask(MODEL), INVALID_TASK, timeout=30)
            await worker.flush()  # every answer the worker sent has reached the server
            after = await snapshot(admin)
        answer = decode_with(ASK_REPLY, honest.data)
        assert isinstance(answer, AskError) and answer.reason == "invalid_task"
    finally:
        await client.close()
        await admin.close()
    assert after == before
    inboxes = [r for r in replies if inbox_reply(r, "_INBOX.worker")]
    assert len(inboxes) == 2  # the gateway's and an unprefixed one: the server denies them
    # The server itself drops a publish whose reply is an ack the client may not send; every
    # other reply reached the worker, which refused it and said so.
    logged = "\n".join(refusals(caplog, "is not an inbox"))
    reached = [r for r in replies if r not in inboxes and not r.startswith("$JS.ACK.")]
    assert [r for r in reached if f"subject {r[:256]!r} is not" not in logged] == []
    assert "'_INBOX.worker.Xk3pQz9RfL2mYv8TnW4aBc.1' is not" in logged


# -- item 2: inboxes are per role ---------------------------------------------------------------

async def test_a_client_reads_no_inbox_but_its_own_while_workers_pull_and_gateways_read(
    secured_url: str,
) -> None:
    """The issue's spy: a `client` subscribed to `_INBOX.>` read the worker's pull deliveries
    and the gateway's KV reads. Now every such subscription is refused by the server, while
    the worker pulls, the gateway reads and the client's own request is answered."""
    violations: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            violations.put_nowait(str(exc).lower())

    spy = await as_role(secured_url, "client", error_cb=on_error)
    admin = await as_role(secured_url, "operator")
    worker = await as_fleet(secured_url, "worker")
    gateway = await as_fleet(secured_url, "gateway")
    seen: list[Msg] = []

    async def heard(msg: Msg) -> None:
        seen.append(msg)

    try:
        wanted = ["_INBOX.>", "_INBOX.worker.>", "_INBOX.gateway.>", "_INBOX.*.>", "_INBOX.*"]
        for subject in wanted:
            await spy.subscribe(subject, cb=heard)
        await spy.flush()
        denied = {await asyncio.wait_for(violations.get(), 10) for _ in wanted}
        assert all(any(f'"{s.lower()}"' in d for d in denied) for s in wanted), denied

        secret = b'{"messages": [{"role": "user", "content": "a tenant secret"}]}'
        await admin.jetstream().publish(subjects.tasks(MODEL), secret)
        pull = await worker.jetstream().pull_subscribe_bind(subjects.durable(MODEL),
                                                            stream="FLEET_TASKS")
        pulled = await pull.fetch(1, timeout=10)
        assert pulled and pull._deliver.startswith("_INBOX.worker.")  # the deliveries' inbox
        for msg in pulled:
            await msg.term()
        tenants = await gateway.jetstream().key_value("FLEET_TENANTS")
        assert (await tenants.get(VICTIM_TASK)).value == b"{}"

        # The client's own inbox works: a JetStream call's reply comes back to it.
        assert (await spy.jetstream().stream_info("FLEET_OUT")).config.name == "FLEET_OUT"
        assert spy._resp_sub_prefix and spy._resp_sub_prefix.startswith(b"_INBOX.client.")
        await spy.flush()
    finally:
        for nc in (spy, admin, worker, gateway):
            await nc.close()
    assert not seen, [msg.subject for msg in seen]


# -- every other place a subject is taken from a message --------------------------------------

async def test_a_hand_off_answers_only_on_an_inbox_and_takes_only_a_task_ack(
    secured_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="fleet.worker.handoff")
    admin = await as_role(secured_url, "operator")
    receiving = await as_fleet(secured_url, "worker")
    sender = await as_role(secured_url, "worker")
    inbox: Inbox = asyncio.Queue()
    receiver = HandOffs(receiving, "node-b", inbox)
    await receiver.subscribe()
    listening = asyncio.create_task(receiver.listen())

    def offer(ack: str) -> bytes:
        return encode(TaskHandOff(from_node="node-a", runner_id="run-b",
                                  subject=subjects.tasks(MODEL), ack_subject=ack, data="{}"))

    try:
        before = await snapshot(admin)
        # A hostile reply: dropped unanswered, nothing taken in.
        for reply in ("$KV.FLEET_NODES.evil", f"$KV.FLEET_CLAIMS.{VICTIM_TASK}",
                      subjects.out(VICTIM_TASK), "_INBOX.>"):
            await sender.publish(subjects.handoff("node-b"), offer(ACK_V1), reply=reply)
        # An ack subject that acks no FLEET_TASKS delivery (the wire pattern lets it by):
        # declined, nothing taken in.
        declined = await sender.request(subjects.handoff("node-b"),
                                        offer("$JS.ACK.FLEET_TASKS.evil"), timeout=10)
        assert decode_model(HandOffAnswer, declined.data).taken is False
        # The honest offer is taken in, with the sender's inbox to answer on.
        honest = asyncio.ensure_future(
            sender.request(subjects.handoff("node-b"), offer(ACK_V1), timeout=10))
        taken = await asyncio.wait_for(inbox.get(), 10)
        assert isinstance(taken, HandedIn) and taken.hand_off.ack_subject == ACK_V1
        assert taken.reply.startswith("_INBOX.worker.")
        assert inbox.empty()  # nothing before it: the hostile ones were never queued
        await receiver.answer(taken.reply, True)
        assert decode_model(HandOffAnswer, (await honest).data).taken is True
        await receiver.answer("$KV.FLEET_NODES.evil", False, "declined")  # refused as well
        await receiving.flush()
        assert await snapshot(admin) == before
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)
        for nc in (admin, receiving, sender):
            await nc.close()
    assert len(refusals(caplog, "is not an inbox was dropped")) == 4
    assert len(refusals(caplog, "acks no FLEET_TASKS delivery")) == 1


async def test_a_refusal_goes_to_a_fleet_reply_to_inbox_only(
    secured_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused task's publisher hears why on its `Fleet-Reply-To`: a header naming a key or
    another task's output gets the refusal recorded on FLEET_REFUSED and nothing else."""
    admin = await as_role(secured_url, "operator")
    worker = await as_fleet(secured_url, "worker")
    client = await as_role(secured_url, "client")
    claims = await Claims.open(worker, worker.jetstream())
    mine = client.new_inbox()
    heard = await client.subscribe(mine)
    try:
        before = await snapshot(admin)
        for target in ("$KV.FLEET_NODES.evil", f"$KV.FLEET_MODELS.{MODEL}",
                       subjects.out(VICTIM_TASK), "_INBOX.>"):
            msg = Msg(_client=worker, subject=subjects.tasks(MODEL), reply="", data=b"{}",
                      headers={subjects.REPLY_HEADER: target})
            await claims.refuse(msg, MODEL, VICTIM_TASK, "task_id_taken")
        await worker.flush()
        after = await snapshot(admin)
        changed = {s for s in before if before[s] != after[s]}
        assert changed == {"FLEET_REFUSED"}, changed  # the four records, nothing else
        assert after["FLEET_REFUSED"][0] == before["FLEET_REFUSED"][0] + 4

        honest = Msg(_client=worker, subject=subjects.tasks(MODEL), reply="", data=b"{}",
                     headers={subjects.REPLY_HEADER: mine})
        await claims.refuse(honest, MODEL, VICTIM_TASK, "task_id_taken")
        told = decode_model(TaskRefused, (await heard.next_msg(timeout=10)).data)
        assert (told.task_id, told.reason) == (VICTIM_TASK, "task_id_taken")
    finally:
        for nc in (admin, worker, client):
            await nc.close()


async def test_a_control_message_is_answered_on_a_flow_control_subject_only(
    secured_url: str,
) -> None:
    """A push consumer's inbox answers flow control; a control message someone else put
    there, asking for an answer on a key, gets none."""
    admin = await as_role(secured_url, "operator")
    reader = await as_fleet(secured_url, "worker")
    answered = await admin.subscribe("$JS.FC.>")
    await admin.flush()
    try:
        before = await snapshot(admin)
        await _answer_control(reader, "$KV.FLEET_NODES.evil", {})
        await _answer_control(reader, None, {STALLED_HEADER: f"$KV.FLEET_MODELS.{MODEL}"})
        await _answer_control(reader, None, {STALLED_HEADER: subjects.out(VICTIM_TASK)})
        await _answer_control(reader, "$JS.FC.FLEET_OUT.honest.1", {})
        await reader.flush()
        assert (await answered.next_msg(timeout=10)).subject == "$JS.FC.FLEET_OUT.honest.1"
        assert await snapshot(admin) == before
    finally:
        await admin.close()
        await reader.close()


@pytest.mark.parametrize("instance_id", [">", "*", "a.>", "x.*", ""])
async def test_a_dashboard_removal_names_one_key_of_fleet_instances_or_nothing(
    secured_url: str, instance_id: str,
) -> None:
    """The dashboard's remove takes the instance id from the URL: a key of FLEET_INSTANCES,
    so at worst one key there; a wildcard or an empty id writes nothing anywhere."""
    admin = await as_role(secured_url, "operator")
    gateway = await as_fleet(secured_url, "gateway")
    try:
        before = await snapshot(admin)
        with pytest.raises(Exception):  # noqa: B017 - nats-py's InvalidKeyError, or a denial
            await remove(gateway.jetstream(), instance_id)
        await gateway.flush()
        assert await snapshot(admin) == before
    finally:
        await admin.close()
        await gateway.close()


async def test_the_cli_follows_and_cancels_as_the_client_role_through_its_own_inbox(
    secured_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """`fleet follow` and `fleet cancel` with client.env: JetStream calls, a KV write and an
    ordered consumer, every reply and delivery on `_INBOX.client`."""
    admin = await as_role(secured_url, "operator")
    js = admin.jetstream()
    for event in (TokenChunk(task_id="cli-task", at=time.time(), index=0, token_id=0, text="ok"),
                  TaskFinished(task_id="cli-task", at=time.time(), status="completed",
                               finish_reason="stop")):
        await js_publish(js, subjects.out("cli-task"), event, msg_id=event_msg_id(event))
    await admin.close()
    settings = Settings(nats_url=secured_url, nats_user="client",
                        nats_password=PASSWORDS["client"])
    assert await follow_task(settings, "cli-task", raw=False, timeout=20) == 0
    assert await cancel_task(settings, "cli-task") == 0
    shown = capsys.readouterr().out
    assert "ok" in shown and "[completed" in shown and "cancel sent for cli-task" in shown
