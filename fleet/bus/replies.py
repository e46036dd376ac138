"""Subjects taken from a message are capabilities: the shapes a Fleet process will write to.

A responder publishes with its own grants, so a reply subject the requester chose freely
(`$KV.FLEET_NODES.evil`, `$O.FLEET_WEIGHTS.M.x`, `fleet.out.<someone's task>`) would make it
write there for them: a confused deputy. Every place that publishes on a subject it read from
a message (a request's reply, a `Fleet-Reply-To` header, a hand-off's ack subject, a flow
control request) checks it here first and answers only a shape it expects:

    reply, Fleet-Reply-To      an inbox: `_INBOX.<token>...`  (inbox_reply); an ask's
                               not one of the answering worker's own inboxes
    hand-off ack subject       a FLEET_TASKS delivery: `$JS.ACK.FLEET_TASKS....` (task_ack)
    flow control               `$JS.FC.<token>...` (flow_control)

Inboxes are per role (or user): every Fleet connection makes its inboxes under
`_INBOX.<role>` (fleet.bus.connect), and the shipped roles may subscribe only there
(fleet.bus.roles), so no role reads another's replies and no stored state lives under
`_INBOX`. Tokens are letters, digits, `-` and `_` (what nats-py's NUIDs and role names use):
no wildcard, no empty token, nothing a subject parser could read twice.
"""

from __future__ import annotations

import re

INBOX_ROOT = "_INBOX"
MAX_SUBJECT = 256  # far above what nats-py's inboxes (~60 chars) and JetStream acks use
_TOKEN = r"[A-Za-z0-9_-]+"
_INBOX = re.compile(rf"_INBOX(\.{_TOKEN})+")
_FLOW_CONTROL = re.compile(rf"\$JS\.FC(\.{_TOKEN})+")
_NUMBER = re.compile(r"[0-9]+")
_V1_ACK_TOKENS = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
_V2_ACK_TOKENS = (11, 12)  # $JS.ACK.<domain>.<account>.<stream>.<consumer>....[.<random>]


def inbox_prefix(owner: str) -> str:
    """The inbox prefix of a role or user: `_INBOX.<owner>` (nats-py adds `.<nuid>`)."""
    if not re.fullmatch(_TOKEN, owner):
        raise ValueError(f"an inbox owner is one subject token, not {owner!r}")
    return f"{INBOX_ROOT}.{owner}"


def inbox_reply(subject: str | None, not_under: str | None = None) -> str | None:
    """`subject` when it is an inbox a responder may answer on, else None. `not_under`: an
    inbox prefix the answer must stay out of (a responder's own, when its requesters are
    never of its role: nobody may make it write into its own pulls and requests)."""
    if not subject or len(subject) > MAX_SUBJECT or not _INBOX.fullmatch(subject):
        return None
    if not_under and subject.startswith(f"{not_under}."):
        return None
    return subject


def flow_control(subject: str | None) -> str | None:
    """`subject` when it is a JetStream flow-control subject, else None."""
    if subject and len(subject) <= MAX_SUBJECT and _FLOW_CONTROL.fullmatch(subject):
        return subject
    return None


def task_ack(subject: str | None, stream: str = "FLEET_TASKS") -> str | None:
    """`subject` when it acks a delivery of `stream` (the v1 form, or the v2 form with domain
    and account hash), else None: the verbs a worker sends on it (+ACK, -NAK, +WPI, +TERM)
    then reach a delivery of that stream and nothing else."""
    if not subject or len(subject) > MAX_SUBJECT:
        return None
    tokens = subject.split(".")
    if tokens[:2] != ["$JS", "ACK"] or not all(re.fullmatch(_TOKEN, t) for t in tokens[2:]):
        return None
    if len(tokens) == _V1_ACK_TOKENS:
        named, numbers = tokens[2], tokens[4:9]
    elif len(tokens) in _V2_ACK_TOKENS:
        named, numbers = tokens[4], tokens[6:11]
    else:
        return None
    if named != stream or not all(_NUMBER.fullmatch(n) for n in numbers):
        return None
    return subject
