"""One ack policy: which JetStream verb a task message gets, decided in one pure function, and
the one place that sends it.

`decide(stage, since_last_verb_s, ack_wait_s)` maps a task's situation to a verb:

    stage                  verb
    receiving              in_progress when due (its intake, a child, may wait out an election)
    waiting_inputs         in_progress when due (every ack_wait/4, at most 5 s), else nothing
    waiting_slot           in_progress when due, else nothing
    running                in_progress when due, else nothing
    stopping_running       in_progress when due (its runner still ends it), else nothing
    finished_stored        ack, confirmed by the server (the terminal is in FLEET_OUT)
    redelivered_finished   ack, confirmed (a redelivery of a task that already ended)
    finished_not_stored    nothing: the terminal is not stored, so AckWait redelivers it
    invalid                term: poison, never redeliver
    stopping_not_started   nak now: another worker takes it at once
    stopped_mid_run        nak now: the worker's stop cut it short (no terminal written here);
                           its redelivery reruns it, or ends it worker_lost if output began
    handed_back            nak after HAND_BACK_DELAY_S: no runner here for its model any more
    superseded             nothing: a stale delivery (a newer one took the task over,
                           fleet.worker.takeover); any verb could touch the newer holder's

Every held message (being taken in, waiting for inputs, for a slot, or running) is thus kept
alive well inside AckWait, so JetStream never hands it to a second worker while this one still
has it.

`AckPolicy` holds the messages and applies verbs: with the broker retry policy for settling
verbs, a single try per beat for in_progress (the next beat is its retry); every failure is
logged and counted in `failures`, none is swallowed. The beats come from a timer of their own
(`beat_forever`, a child of the worker's Supervisor) over a snapshot of where each held message
stands, so no broker call of the loop's, however long it waits, can starve them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from nats.aio.msg import Msg
from nats.errors import MsgAlreadyAckdError

from fleet.bus.pipelined import pipelined_for
from fleet.bus.retry import BROKER_BUDGET_S
from fleet.bus.task_queue import settle
from fleet.worker.state import Place, WorkerState

log = logging.getLogger(__name__)

PROGRESS_CAP_S = 5.0
HAND_BACK_DELAY_S = 1.0
CONFIRM_TIMEOUT_S = 2.0
ACK = b"+ACK"  # the ack verb's body (nats-py's Msg.Ack.Ack)


class Stage(StrEnum):
    RECEIVING = "receiving"
    WAITING_INPUTS = "waiting_inputs"
    WAITING_SLOT = "waiting_slot"
    RUNNING = "running"
    STOPPING_RUNNING = "stopping_running"
    FINISHED_STORED = "finished_stored"
    REDELIVERED_FINISHED = "redelivered_finished"
    FINISHED_NOT_STORED = "finished_not_stored"
    INVALID = "invalid"
    STOPPING_NOT_STARTED = "stopping_not_started"
    STOPPED_MID_RUN = "stopped_mid_run"
    HANDED_BACK = "handed_back"
    SUPERSEDED = "superseded"


class Kind(StrEnum):
    ACK = "ack"
    NAK = "nak"
    IN_PROGRESS = "in_progress"
    TERM = "term"
    NOTHING = "nothing"


@dataclass(frozen=True)
class Verb:
    kind: Kind
    delay_s: float | None = None  # for nak: redeliver after this long
    confirm: bool = False  # wait for the server to confirm it (ack_sync)


NOTHING = Verb(Kind.NOTHING)
HELD = frozenset({
    Stage.RECEIVING, Stage.WAITING_INPUTS, Stage.WAITING_SLOT, Stage.RUNNING,
    Stage.STOPPING_RUNNING,
})


def progress_every(ack_wait_s: float) -> float:
    """How often a held message is told in_progress: a quarter of AckWait, at most 5 s."""
    return min(PROGRESS_CAP_S, ack_wait_s / 4)


def tick_every(ack_wait_s: float) -> float:
    """The heartbeat tick: half the progress period, so the longest silence is 3/8 AckWait."""
    return max(0.1, progress_every(ack_wait_s) / 2)


def decide(stage: Stage, since_last_verb_s: float, ack_wait_s: float) -> Verb:
    """The verb a message in `stage` gets now, `since_last_verb_s` after its last one."""
    if stage in HELD:
        due = since_last_verb_s >= progress_every(ack_wait_s)
        return Verb(Kind.IN_PROGRESS) if due else NOTHING
    match stage:
        case Stage.FINISHED_STORED | Stage.REDELIVERED_FINISHED:
            return Verb(Kind.ACK, confirm=True)
        case Stage.FINISHED_NOT_STORED | Stage.SUPERSEDED:
            return NOTHING
        case Stage.INVALID:
            return Verb(Kind.TERM)
        case Stage.STOPPING_NOT_STARTED | Stage.STOPPED_MID_RUN:
            return Verb(Kind.NAK)
        case Stage.HANDED_BACK:
            return Verb(Kind.NAK, delay_s=HAND_BACK_DELAY_S)
    raise ValueError(f"no verb for stage {stage!r}")


def verb_of(stage: Stage) -> str:
    """The verb a message that ends in `stage` gets, as spans and logs name it."""
    return decide(stage, 0.0, 1.0).kind.value


def intake_key(msg: Msg) -> str:
    """The key a message is held under while it is taken in, before its task id is known:
    its stream sequence, so a redelivery of it is recognised (`redelivered_while_held`)."""
    try:
        return f"intake-{msg.metadata.sequence.stream}"
    except Exception:  # not a JetStream delivery (no ack subject to read it from)
        return f"intake-local-{id(msg)}"


def ack_stage(state: WorkerState, key: str) -> Stage:
    """A held message's stage, from where its task is (`WorkerState.place_of`). A task on a
    runner, ending behind an image upload, or off a dead runner until its read-back decides
    is still this node's to answer for: running (or running while stopping); so is a task no
    longer here whose end is being stored (its message is held until its verb is sent)."""
    match state.place_of(key):
        case Place.RECEIVING:
            return Stage.RECEIVING
        case Place.WAITING_INPUTS:
            return Stage.WAITING_INPUTS
        case Place.WAITING_SLOT | Place.OFFERED:  # offered: only once its inputs are here
            return Stage.WAITING_SLOT
    return Stage.STOPPING_RUNNING if state.stopping else Stage.RUNNING


def held_stages(state: WorkerState, held: list[str]) -> dict[str, Stage]:
    """The ack stage of each held message (`ack_stage`): the beats' snapshot."""
    return {key: ack_stage(state, key) for key in held}


async def beat_forever(acks: AckPolicy, stages: Callable[[], Mapping[str, Stage]]) -> None:
    """The in_progress beats, on a timer of their own over `stages()` (a snapshot of where
    each held message stands): whatever the loop waits on, held messages stay alive."""
    period = tick_every(acks.ack_wait_s)
    while True:
        await asyncio.sleep(period)  # a timer, not synchronisation
        await acks.heartbeat(stages(), time.monotonic())


@dataclass
class _Held:
    msg: Msg
    last_verb_at: float


class AckPolicy:
    """The worker's held task messages and the one place a verb is sent for them."""

    def __init__(self, ack_wait_s: float, budget_s: float = BROKER_BUDGET_S) -> None:
        self.ack_wait_s = ack_wait_s
        self.budget_s = budget_s
        self._held: dict[str, _Held] = {}
        # Stream sequence -> the key its message is held under: a fetched message is looked
        # up here at every take (a scan of every held message was O(held) a take, issue 23).
        self._keys: dict[int, str] = {}
        self.sent: Counter[str] = Counter()  # verb -> sent (for tests and logs)
        self.failures: Counter[str] = Counter()  # verb -> failed after its retries

    def hold(self, task_id: str, msg: Msg, now: float) -> None:
        """Keep `msg` until it is settled; it was delivered (a verb of sorts) at `now`."""
        self._put(task_id, _Held(msg, now))

    def held(self) -> list[str]:
        return list(self._held)

    def message(self, task_id: str) -> Msg | None:
        """The message held for `task_id` (it stays held)."""
        held = self._held.get(task_id)
        return held.msg if held else None

    def redelivered_while_held(self, msg: Msg) -> str | None:
        """The task id when `msg` is a redelivery of a message held here (its AckWait ran out
        while an in_progress was lost, e.g. in a leader election): still ours, not new work.
        Looked up by stream sequence whatever its delivery count says: a server killed and
        restarted on its store can deliver a held message again as a first delivery (its
        consumer's last deliveries were not on disk yet); seen once in CI as the same task
        submitted twice to one runner."""
        if (seq := _stream_seq(msg)) is None:
            return None
        key = self._keys.get(seq)
        return key if key is not None and key in self._held else None

    def renew(self, task_id: str, msg: Msg, now: float) -> None:
        """Hold the newest delivery of a held message instead, due for in_progress at once
        (`beat_now`)."""
        self._put(task_id, _Held(msg, now - progress_every(self.ack_wait_s)))

    async def beat_now(self, task_id: str, now: float) -> None:
        """in_progress for one held message now, if it is due (a renewed one is)."""
        await self.heartbeat({task_id: Stage.RUNNING}, now)

    def rekey(self, old: str, new: str) -> Msg | None:
        """Hold under `new` what was held under `old` (an intake key becomes the task id once
        the intake knows it), keeping when its last verb went; the message, or None."""
        held = self._pop(old)
        if held is None:
            return None
        self._put(new, held)
        return held.msg

    def _put(self, key: str, held: _Held) -> None:
        self._pop(key)
        self._held[key] = held
        if (seq := _stream_seq(held.msg)) is not None:
            self._keys[seq] = key

    def _pop(self, key: str) -> _Held | None:
        held = self._held.pop(key, None)
        if held is not None and (seq := _stream_seq(held.msg)) is not None \
                and self._keys.get(seq) == key:
            del self._keys[seq]
        return held

    def release(self, task_id: str) -> Msg | None:
        """Stop holding a task's message (it is being settled) and return it."""
        held = self._pop(task_id)
        return held.msg if held else None

    async def heartbeat(self, stages: Mapping[str, Stage], now: float) -> None:
        """in_progress for every held message that is due. One try each: a publish that
        fails now is tried again at the next tick, still well inside AckWait."""
        for task_id, stage in stages.items():
            held = self._held.get(task_id)
            if held is None:
                continue
            verb = decide(stage, now - held.last_verb_at, self.ack_wait_s)
            if verb.kind is not Kind.IN_PROGRESS:
                continue
            try:
                await held.msg.in_progress()
            except Exception as exc:
                self._failed(task_id, verb, exc)
                continue
            held.last_verb_at = now
            self.sent[Kind.IN_PROGRESS] += 1

    async def settle(self, task_id: str | None, msg: Msg, stage: Stage) -> bool:
        """Send the verb `stage` calls for, retried through broker trouble. True when sent
        (or nothing was due); False when it failed for good: logged and counted."""
        held = self._pop(task_id or "")
        if held is not None and _stream_seq(held.msg) == _stream_seq(msg):
            msg = held.msg  # its newest delivery: renewed while its end was being stored
        verb = decide(stage, 0.0, self.ack_wait_s)
        if verb.kind is Kind.NOTHING:
            return True
        if verb.confirm and await _confirmed_now(msg):
            self.sent[verb.kind] += 1
            return True
        try:
            await settle(lambda: _send(msg, verb), what=f"{verb.kind} task {task_id}",
                         budget_s=self.budget_s)
        except MsgAlreadyAckdError:
            log.debug("task %s: already settled, %s not sent again", task_id, verb.kind)
            return True
        except Exception as exc:
            self._failed(task_id, verb, exc)
            return False
        self.sent[verb.kind] += 1
        return True

    def _failed(self, task_id: str | None, verb: Verb, exc: BaseException) -> None:
        self.failures[verb.kind] += 1
        log.warning(
            "task %s: %s failed (%s: %s); %d %s failure(s) so far",
            task_id, verb.kind, type(exc).__name__, exc, self.failures[verb.kind], verb.kind,
        )


def _stream_seq(msg: Msg) -> int | None:
    """A held message's stream sequence (the same on every delivery of it); None when it has
    none (not a JetStream delivery)."""
    try:
        return msg.metadata.sequence.stream if msg.metadata is not None else None
    except Exception:  # no ack subject to read it from
        return None


async def _confirmed_now(msg: Msg) -> bool:
    """A confirmed ack as one pipelined publish (fleet.bus.pipelined): True once the server
    confirmed it. False for anything else, and the retried `ack_sync` sends it again (an ack is
    idempotent): the one verb of the message is still decided by its stage alone."""
    if msg._ackd or not msg.reply:  # nats-py's own account of a verb already sent
        return False
    try:
        # The message's own connection, as nats-py's Msg.ack uses it.
        await pipelined_for(msg._client).request(msg.reply, ACK, timeout=CONFIRM_TIMEOUT_S)
    except Exception as exc:
        log.debug("a confirmed ack had no answer (%r): sent again, retried", exc)
        return False
    msg._ackd = True  # as ack_sync marks it: a later verb on it is known to be too late
    return True


async def _send(msg: Msg, verb: Verb) -> None:
    match verb.kind:
        case Kind.ACK if verb.confirm:
            await msg.ack_sync(timeout=CONFIRM_TIMEOUT_S)
        case Kind.ACK:
            await msg.ack()
        case Kind.NAK:
            await msg.nak(delay=verb.delay_s)
        case Kind.TERM:
            await msg.term()
        case Kind.IN_PROGRESS:
            await msg.in_progress()
