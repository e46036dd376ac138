"""Task id claims: the pure verdicts as tables, and the FLEET_CLAIMS bucket on a real server."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.connect import js_publish
from fleet.errors import ProvisioningConflict
from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.events import ErrorReason, TaskRefused, failed
from fleet.worker.claims import (
    REPORTED_ID_CHARS,
    Claim,
    Claims,
    created,
    judge,
    one_off_owner,
    refusal,
    reply_subject,
)


@pytest.mark.parametrize(
    ("mine", "holder", "claim"),
    [
        ("17", None, Claim.FRESH),
        ("17", "17", Claim.OWN),
        ("17", "18", Claim.TAKEN),
        ("17", "", Claim.TAKEN),  # unreadable holder: fail closed
        ("once-a", "once-b", Claim.TAKEN),
    ],
)
def test_judge(mine: str, holder: str | None, claim: Claim) -> None:
    assert judge(mine, holder) is claim


@pytest.mark.parametrize(
    ("answer", "stored"),
    [
        (b'{"stream":"KV_FLEET_CLAIMS","seq":12}', True),
        (b'{"stream":"KV_FLEET_CLAIMS","seq":12,"duplicate":true}', True),
        # The key has a message (a live claim, or a marker only the retried create reads).
        (b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 7"}}',
         False),
        # Anything else is the retried create's to decide: an error, no sequence, no JSON.
        (b'{"error":{"code":503,"err_code":10008,"description":"jetstream not enabled"}}',
         None),
        (b'{"error":"odd"}', None),
        (b'{"stream":"KV_FLEET_CLAIMS"}', None),
        (b"", None),
        (b"[1]", None),
    ],
)
def test_created(answer: bytes, stored: bool | None) -> None:
    assert created(answer) is stored


@pytest.mark.parametrize(
    ("claim", "earlier_events", "reason"),
    [
        (Claim.FRESH, False, None),
        (Claim.FRESH, True, "task_id_used"),
        (Claim.OWN, False, None),
        (Claim.OWN, True, None),  # a redelivery: the redelivery rules decide
        (Claim.TAKEN, False, "task_id_taken"),
        (Claim.TAKEN, True, "task_id_taken"),
    ],
)
def test_refusal(claim: Claim, earlier_events: bool, reason: str | None) -> None:
    assert refusal(claim, earlier_events) == reason


@pytest.mark.parametrize(
    ("headers", "reply"),
    [
        (None, None),
        ({}, None),
        ({subjects.REPLY_HEADER: "_INBOX.abc123"}, "_INBOX.abc123"),
        ({subjects.REPLY_HEADER: "_INBOX.abc.def-9_x"}, "_INBOX.abc.def-9_x"),
        ({subjects.REPLY_HEADER: "fleet.out.victim"}, None),  # never a task's events
        ({subjects.REPLY_HEADER: "fleet.tasks.tiny-llm"}, None),
        ({subjects.REPLY_HEADER: "_INBOX.>"}, None),
        ({subjects.REPLY_HEADER: "_INBOX.*"}, None),
        ({subjects.REPLY_HEADER: "_INBOX"}, None),
        ({subjects.REPLY_HEADER: "_INBOX..x"}, None),
        ({subjects.REPLY_HEADER: "_INBOX.a b"}, None),
        ({subjects.REPLY_HEADER: "$KV.FLEET_CLAIMS.victim"}, None),
        ({"Reply-To": "_INBOX.abc"}, None),
    ],
)
def test_reply_subject(headers: dict[str, str] | None, reply: str | None) -> None:
    assert reply_subject(headers) == reply


async def test_the_first_owner_keeps_an_id(provisioned_nc: Client) -> None:
    claims = await Claims.open(provisioned_nc, provisioned_nc.jetstream())
    assert await claims.claim("t-1", "5") is Claim.FRESH
    assert await claims.claim("t-1", "5") is Claim.OWN
    assert await claims.claim("t-1", "6") is Claim.TAKEN
    assert await claims.claim("t-1", one_off_owner()) is Claim.TAKEN
    assert await claims.claim("t-2", "6") is Claim.FRESH


async def test_a_purged_claim_is_claimed_afresh_by_the_retried_create(
    provisioned_nc: Client,
) -> None:
    """The pipelined create expects no message on the key; a purge leaves a marker there, so
    it is refused, and the retried create (which reads the marker) claims the id."""
    claims = await Claims.open(provisioned_nc, provisioned_nc.jetstream())
    assert await claims.claim("p-1", "5") is Claim.FRESH
    await claims.records.kv.purge("p-1")
    assert await claims.claim("p-1", "6") is Claim.FRESH
    assert await claims.claim("p-1", "5") is Claim.TAKEN


async def test_admit_says_when_an_earlier_delivery_of_the_message_claimed_the_id(
    provisioned_nc: Client,
) -> None:
    """The intake reads OWN as "delivered before", whatever the delivery count says
    (fleet.worker.takeover.takes_fence): sent ahead or not, FRESH the first time only."""
    claims = await Claims.open(provisioned_nc, provisioned_nc.jetstream())
    await claims.ahead("o-1", "7")
    assert await claims.admit_claim("o-1", "7") == (Claim.FRESH, None)
    assert await claims.admit_claim("o-1", "7") == (Claim.OWN, None)
    await claims.ahead("o-1", "7")
    assert await claims.admit_claim("o-1", "7") == (Claim.OWN, None)
    assert await claims.admit_claim("o-1", "8") == (Claim.TAKEN, "task_id_taken")


async def test_concurrent_claims_have_exactly_one_winner(provisioned_nc: Client) -> None:
    claims = await Claims.open(provisioned_nc, provisioned_nc.jetstream())
    results = await asyncio.gather(*(claims.claim("race", str(n)) for n in range(20)))
    assert sorted(results).count(Claim.FRESH) == 1
    assert results.count(Claim.TAKEN) == 19


async def test_an_id_with_events_but_no_claim_is_used(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    claims = await Claims.open(provisioned_nc, js)
    old = failed("old-1", 0.0, ErrorReason.INTERNAL, "from before claims (or expired)")
    await js_publish(js, subjects.out("old-1"), old)
    assert await claims.has_events("old-1")
    assert not await claims.has_events("new-1")
    assert await claims.admit("old-1", "9") == "task_id_used"
    assert await claims.admit("old-1", "9") == "task_id_taken"  # not its own on redelivery
    assert await claims.admit("new-1", "9") is None
    assert await claims.admit("new-1", "9") is None  # its redelivery
    assert await claims.admit("new-1", "10") == "task_id_taken"


async def test_claims_sent_ahead_are_admitted_as_claims_sent_at_the_intake(
    provisioned_nc: Client,
) -> None:
    """`ahead` sends the same create and look-up `admit` would: the same verdicts, each
    read once (an id admitted again, or never sent ahead, sends its own)."""
    js = provisioned_nc.jetstream()
    claims = await Claims.open(provisioned_nc, js)
    await js_publish(js, subjects.out("old-2"),
                     failed("old-2", 0.0, ErrorReason.INTERNAL, "from an earlier life"))
    for task_id, owner in (("a-1", "3"), ("a-1", "4"), ("old-2", "5")):
        await claims.ahead(task_id, owner)
    assert await claims.admit("a-1", "3") is None  # fresh, no events
    assert await claims.admit("a-1", "4") == "task_id_taken"  # its create was refused
    assert await claims.admit("old-2", "5") == "task_id_used"  # its look-up found events
    assert await claims.admit("a-1", "3") is None  # a redelivery, nothing sent ahead: own
    assert not claims._ahead


async def test_claims_sent_ahead_and_never_admitted_are_not_kept_forever(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("fleet.worker.claims.AHEAD_KEPT", 2)
    claims = await Claims.open(provisioned_nc, provisioned_nc.jetstream())
    for n in range(4):
        await claims.ahead(f"k-{n}", "1")
    assert list(claims._ahead) == [("k-2", "1"), ("k-3", "1")]
    assert await claims.admit("k-0", "1") is None  # pushed out: admitted by its own calls


async def test_a_refusal_is_recorded_and_answered_only_on_the_inbox(
    provisioned_nc: Client,
) -> None:
    nc = provisioned_nc
    js = nc.jetstream()
    claims = await Claims.open(nc, js)
    inbox = nc.new_inbox()
    answered: asyncio.Queue[Msg] = asyncio.Queue()
    written: list[Msg] = []

    async def on_answer(msg: Msg) -> None:
        await answered.put(msg)

    async def on_out(msg: Msg) -> None:
        written.append(msg)

    await nc.subscribe(inbox, cb=on_answer)
    await nc.subscribe("fleet.out.>", cb=on_out)
    msg = _core_msg(nc, "fleet.tasks.tiny-llm", {subjects.REPLY_HEADER: inbox})
    await claims.refuse(msg, "tiny-llm", "victim", "task_id_taken")

    answer = decode_model(TaskRefused, (await asyncio.wait_for(answered.get(), 10)).data)
    assert answer.task_id == "victim" and answer.reason == "task_id_taken"
    stored = await js.get_last_msg(subjects.REFUSED_STREAM, subjects.refused("tiny-llm"))
    assert decode_model(TaskRefused, stored.data or b"") == answer
    await nc.flush()
    assert written == []


def _core_msg(nc: Client, subject: str, headers: dict[str, Any]) -> Msg:
    return Msg(nc, subject=subject, data=b"{}", headers=headers)


async def test_a_missing_bucket_says_how_to_provision(nats_url: str) -> None:
    nc = await nats.connect(nats_url)  # a server nobody provisioned
    try:
        with pytest.raises(ProvisioningConflict, match="fleet nats --provision"):
            await Claims.open(nc, nc.jetstream())
    finally:
        await nc.close()


async def test_a_huge_id_is_reported_cut_so_the_refusal_fits(provisioned_nc: Client) -> None:
    nc = provisioned_nc
    claims = await Claims.open(nc, nc.jetstream())
    msg = _core_msg(nc, "fleet.tasks.tiny-llm", {})
    huge = "y" * (nc.max_payload + 10)
    event = await claims.refuse(msg, "tiny-llm", huge, "invalid_task_id", "task_id: too long")
    assert event.task_id == "y" * REPORTED_ID_CHARS
    assert f"of {len(huge)} chars" in event.message
