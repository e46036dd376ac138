"""The hand-off listener on a real nats-server: offers reach the inbox while it listens; once
a stopping worker closes it, an offer finds no responder, so its sender runs the task at once
(an offer left unanswered would cost the task an AckWait); offers already queued are declined."""

from __future__ import annotations

import asyncio
from typing import cast

import nats
from nats.aio.msg import Msg

from fleet.wire import subjects
from fleet.worker.handoff import HandOffs
from fleet.worker.inbox import HandedIn, Inbox, Tick
from fleet.worker.state import HandOffEnded
from fleet.worker.stopping import decline_queued_offers

ACK_SUBJECT = "$JS.ACK.FLEET_TASKS.tasks-tiny-llm.1.7.7.1764700000000000000.0"


def held_message(nc: nats.NATS) -> Msg:
    return Msg(_client=nc, subject=subjects.tasks("tiny-llm"), reply=ACK_SUBJECT, data=b"{}")


class WatchedInbox(asyncio.Queue):  # type: ignore[type-arg]
    """An inbox that says when an offer was put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.offered = asyncio.Event()

    def put_nowait(self, item: object) -> None:
        super().put_nowait(item)
        if isinstance(item, HandedIn):
            self.offered.set()


async def ended(inbox: Inbox) -> HandOffEnded:
    item = await asyncio.wait_for(inbox.get(), timeout=10)
    assert isinstance(item, HandOffEnded)
    return item


async def test_a_closed_listener_leaves_offers_without_a_responder(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    receiver_inbox: Inbox = asyncio.Queue()
    receiver = HandOffs(nc, "node-b", receiver_inbox)
    await receiver.subscribe()
    listening = asyncio.create_task(receiver.listen())
    sender_inbox: Inbox = asyncio.Queue()
    sender = HandOffs(nc, "node-a", sender_inbox)
    try:
        sending = asyncio.create_task(sender.send("t-1", "node-b", "run-b", held_message(nc)))
        offer = await asyncio.wait_for(receiver_inbox.get(), timeout=10)
        assert isinstance(offer, HandedIn) and offer.hand_off.from_node == "node-a"
        await receiver.answer(offer.reply, False, "no free slot")
        await sending
        assert (await ended(sender_inbox)).taken is False

        await receiver.close()
        await sender.send("t-2", "node-b", "run-b", held_message(nc))
        # No responder: declined at once (an offer nobody answers ends taken=None, AckWait).
        assert (await ended(sender_inbox)).taken is False
        assert receiver_inbox.empty()
        assert not listening.done()  # closed: it waits for its owner, it does not resubscribe
    finally:
        listening.cancel()
        await nc.close()


async def test_offers_queued_before_the_stop_are_declined_and_the_rest_keep_their_order(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    inbox = WatchedInbox()
    receiver = HandOffs(nc, "node-b", cast(Inbox, inbox))
    await receiver.subscribe()
    listening = asyncio.create_task(receiver.listen())
    sender_inbox: Inbox = asyncio.Queue()
    sender = HandOffs(nc, "node-a", sender_inbox)
    try:
        first, second = Tick(), Tick()
        inbox.put_nowait(first)
        sending = asyncio.create_task(sender.send("t-1", "node-b", "run-b", held_message(nc)))
        await asyncio.wait_for(inbox.offered.wait(), timeout=10)  # queued behind the first
        inbox.put_nowait(second)
        await receiver.close()
        await decline_queued_offers(cast(Inbox, inbox), receiver)
        await sending
        assert (await ended(sender_inbox)).taken is False
        kept = [inbox.get_nowait() for _ in range(inbox.qsize())]
        assert len(kept) == 2 and kept[0] is first and kept[1] is second
    finally:
        listening.cancel()
        await nc.close()
