"""The worker: the node's one loop. Receive, apply, plan, act.

`Worker.run` owns every coroutine of the worker with one Supervisor (one TaskGroup): the
tick, the in_progress beats, the cancel listener, pulls, intakes, input fetches, image
uploads, runner starts, stops and report pumps, crash read-backs, task endings, and the
cluster link's own loops. Children talk to the loop only through the typed inbox
(`InboxItem`); a child that fails is logged with its traceback and restarted with backoff
(loops) or reported to the loop (one-shot work).

The loop does not wait on the broker for a task's sake: a message's intake (claim, cancel
lookup, read-backs, refusals) and the read-back of a task whose runner crashed run as
children that post their outcome (`TakenIn`, `CrashJudged`); the beats that keep held
messages alive run on their own timer. What the loop still awaits is the runner pipes and the
token path's core publish (fleet.bus.confirmed: never an ack; a full window queues).
Two parts of the loop are composed, not mixed in: `RunnerReports` (reports.py: what a runner
says) and `Stopping` (stopping.py); each asks the loop only what its protocol names. Where a
task is comes from `WorkerState.place_of` (state.py), changed only by `apply`.
The task tree and the ack table are drawn in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Span

from fleet import telemetry
from fleet.aio import Supervisor
from fleet.bus.connect import connect_with, redact_urls
from fleet.bus.provision import provision
from fleet.config import Settings
from fleet.wire import pipe, subjects
from fleet.wire.events import (
    ErrorReason,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.runners import ACCEPTS_TASKS
from fleet.wire.tasks import CancelTask
from fleet.wire.token_frames import TokenFrame
from fleet.worker import plan as rules
from fleet.worker import state as ev
from fleet.worker.acks import AckPolicy, Stage, beat_forever, held_stages, intake_key, verb_of
from fleet.worker.asks import AskResponder
from fleet.worker.children import Feeds
from fleet.worker.cluster import ClusterLink
from fleet.worker.continuation import with_seed
from fleet.worker.endings import Endings
from fleet.worker.fair_charge import FairCharges
from fleet.worker.handoff import TAKE_WITHIN_S, HandOffs, RemoteRunners, rebuilt
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import (
    CancelSeen,
    CrashJudged,
    Fenced,
    Fetched,
    HandedIn,
    ImageUploaded,
    Inbox,
    InboxItem,
    InputsFailed,
    InputsFetched,
    RunnerExited,
    RunnerReported,
    Stop,
    TakenIn,
    Tick,
)
from fleet.worker.intake import Intake, Queued
from fleet.worker.node import sample_cores_forever
from fleet.worker.outputs import TaskOutput
from fleet.worker.preemption import Preempt
from fleet.worker.prefix_adverts import PrefixAdverts, ServedPrefixes
from fleet.worker.pulls import TaskPuller
from fleet.worker.reports import RunnerReports, accept_of
from fleet.worker.routing import Weights
from fleet.worker.runners import RunnerPool
from fleet.worker.spans import TaskSpans
from fleet.worker.state import WorkerState, apply
from fleet.worker.stopping import Stopping
from fleet.worker.takeover import FencedFate, fenced_fate
from fleet.worker.uploads import ImageUploads

log = logging.getLogger(__name__)

# Inbox items handled at most between two passes of the planner: enough to fold a fetched
# batch's intakes into one pass, few enough that a freed slot waits for little.
PLAN_EVERY = 64

class Worker:
    def __init__(self, settings: Settings, ready: asyncio.Event | None = None) -> None:
        self.settings = settings
        self.ready = ready or asyncio.Event()
        self.inbox: Inbox = asyncio.Queue()
        self.acks = AckPolicy(settings.ack_wait_s)
        self.spans = TaskSpans()
        self.handler_failures = 0  # inbox items whose handling raised (logged each time)
        # Set to end a model's preemption probe early (a slot freed): its last pull's.
        self._probe_ends: dict[str, asyncio.Event | None] = {}
        self._held_wake: asyncio.TimerHandle | None = None  # plans when a held pull may go

    def _held_acks(self) -> list[str]:
        msgs = (self.acks.message(key) for key in self.acks.held())
        return [msg.reply for msg in msgs if msg is not None and msg.reply]

    async def run(self) -> None:
        """Serve until stopped; /metrics (when a port is set) from before the connection to
        after the drain, and the metrics' last OTLP export at the end."""
        metrics = self.spans.metrics
        try:
            with metrics.served(self.settings.metrics_host, self.settings.metrics_port):
                await self._run()
        finally:
            metrics.meters.shutdown()

    async def _run(self) -> None:
        settings = self.settings
        self.nc = await connect_with(settings, "fleet-worker", role="worker")
        self.js = self.nc.jetstream()
        telemetry.export_to_nats(lambda: self.nc)
        await provision(self.nc, replicas=settings.replicas)
        self.output = TaskOutput(
            self.nc, self.js, on_fenced=lambda task_id: self.inbox.put_nowait(Fenced(task_id))
        )
        async with Supervisor("worker") as owner:
            self.owner = owner
            self.cluster = ClusterLink(settings, self.nc, self.js, self.inbox)
            await self.cluster.start(owner)
            # The heartbeat lists what we hold, for the death watch (fleet.worker.deathwatch).
            self.cluster.heartbeat.held = self._held_acks
            node = self.cluster.node_id
            self.state = WorkerState(
                node_id=node, cards=dict(self.cluster.cards),  # CardsChanged after
                routing=Weights(prefix=settings.prefix_routing),
                prefix_capacity=settings.prefix_index_blocks,
            )
            self.intake = Intake(self.js, self.output, self.cluster)
            self.endings = Endings(self.output, self.acks, self.spans, owner, node,
                                   FairCharges(self.js))
            self.runners = RunnerPool(settings, node, self.inbox, owner, self.cluster)
            self.images = ImageOutputs(
                self.cluster, self.spans, self.runners.send, self.inbox, owner
            )
            self.reports = RunnerReports(
                self, images=self.images, output=self.output, intake=self.intake,
                cluster=self.cluster, runners=self.runners, spans=self.spans,
                inbox=self.inbox, owner=owner,
            )
            self.puller = TaskPuller(
                self.nc, self.js, settings, self.spans.metrics.meters.meter("fleet.worker")
            )
            self.puller.on_fetched = self.intake.ahead  # claims out before the loop's hops
            owner.forever("consumer guard", self.puller.guard.forever)
            self.feeds = Feeds(
                self.nc, self.inbox, self.puller, self.cluster, self.spans, settings.ack_wait_s
            )
            await self.feeds.subscribe_cancels()
            owner.forever("cancel listener", self.feeds.follow_cancels)
            self.handoffs = HandOffs(self.nc, node, self.inbox)
            if settings.prefix_routing:  # across nodes: other workers' adverts, hand-offs
                await self.handoffs.subscribe()
                owner.forever("hand-off listener", self.handoffs.listen)
                remote = RemoteRunners(node, self.inbox)
                # Only the adverts of the models placed here (fleet.worker.prefix_adverts).
                served = ServedPrefixes(self.cluster.models_placed_here, remote.changed)
                owner.forever("prefix mirror", lambda: served.run(_Link(self)))
            owner.forever("tick", self.feeds.tick_forever)
            owner.forever("in_progress beats", lambda: beat_forever(
                self.acks, lambda: held_stages(self.state, self.acks.held())))
            owner.forever("core sampler", lambda: sample_cores_forever(self.inbox.put_nowait))
            owner.forever("prefix adverts", PrefixAdverts(self.js, lambda: self.state).forever)
            self.asks = AskResponder(self.nc, self.js, settings.ask_timeout_s, owner)
            await self.asks.start()
            self.uploads = ImageUploads(self.nc, self.cluster.store, owner)
            await self.uploads.start()
            self.stopping = Stopping(
                self, nc=self.nc, inbox=self.inbox, asks=self.asks, uploads=self.uploads,
                handoffs=self.handoffs, acks=self.acks, spans=self.spans,
                endings=self.endings, runners=self.runners, puller=self.puller,
                output=self.output, cluster=self.cluster,
            )
            log.info("worker %s serving on %s", node, redact_urls(settings.urls))
            self.ready.set()
            try:
                await self._loop()
            finally:
                await self.stopping.shutdown()
                await owner.cancel_all()
        await self.stopping.disconnect()

    def stop(self) -> None:
        """Ask the loop to end and shut down cleanly. A message, not a cancel: nats-py
        swallows CancelledError inside publish, so a cancel can be lost mid-await."""
        self.inbox.put_nowait(Stop())

    # ---- the loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        """Handle what the inbox holds (up to PLAN_EVERY items), then plan once: under load
        a fetched batch's intakes and its tasks' terminals arrive together, and planning
        after each of them cost a pass of the planner per item (issue 23). Alone in the
        inbox, an item is planned after at once, as before."""
        stop = False
        while not stop:
            item = await self.inbox.get()
            due = False
            handled = 0
            while True:
                if isinstance(item, Stop):
                    stop = True
                    break
                try:
                    needs_plan = not plans_nothing(item, self.state)  # the state before it
                    await self.handle(item)
                    due = due or needs_plan
                except Exception:  # one item's trouble must not end the node's work
                    self.handler_failures += 1
                    log.exception("worker: handling %s failed; going on", type(item).__name__)
                handled += 1
                if handled >= PLAN_EVERY or self.inbox.empty():
                    break
                item = self.inbox.get_nowait()  # in order: the rest wait in the queue
            if not due and self.reports.plan_due and not self.state.pending:
                # A prefill ended (reports.py): what it changes is read for waiting tasks
                # only (routes, preempt; pull_to_preempt can only turn to no), and none wait.
                self.reports.plan_due = False
            if due or self.reports.plan_due:
                try:
                    await self._drive()
                except Exception:
                    self.handler_failures += 1
                    log.exception("worker: planning failed; going on")

    def apply(self, event: ev.StateEvent) -> None:
        self.state = apply(self.state, event)

    async def _drive(self) -> None:
        self.reports.plan_due = False
        chain = rules.RULES
        dispatched = False
        while (action := rules.plan(self.state, now := time.time(), chain)) is not None:
            await self._act(action)
            # After a dispatch only the rules from dispatch on can find work (plan.py).
            chain = rules.AFTER_DISPATCH if isinstance(action, rules.Dispatch) else rules.RULES
            if chain is rules.AFTER_DISPATCH and not dispatched:
                dispatched = True
                # Its accept, queued on the connection, and its task, on the runner's pipe,
                # are written in the pass given up here, not after the rest of this plan:
                # at light load ~0.15 ms of the accept's way (issue 23). Once a plan: under
                # batches the others follow the first without a pass each.
                await asyncio.sleep(0)
        self.runners.tend_standby(self.state)
        # The holds as the last plan saw them (its `now`): a hold that ran out since then
        # still gets its wake, so the pull it kept back is planned.
        until = rules.pulls_held_until(self.state, now)
        if self._held_wake is None and until:
            # A pull held for intakes (plan.pull_held_until): plan again when the hold ends,
            # should no intake answer before.
            self._held_wake = asyncio.get_running_loop().call_later(
                until - now, self._wake_held)
        elif self._held_wake is not None and rules.pulls_held_until(self.state, 0.0) is None:
            # No intake holds a pull at all any more (they answered first: the plan just
            # made saw every pull free), so the wake would only plan once more for nothing,
            # every other task at light load. (A hold that merely ran out keeps its wake.)
            self._held_wake.cancel()
            self._held_wake = None

    def _wake_held(self) -> None:
        self._held_wake = None
        self.inbox.put_nowait(Tick())

    async def handle(self, item: InboxItem) -> None:
        match item:
            case Fetched(model=model, msgs=msgs, drained=drained):
                self.apply(ev.PullEnded(model, drained=drained))
                for msg in msgs:
                    self._take(msg)
            case TakenIn() as taken:
                self._taken_in(taken)
            case CrashJudged() as judged:
                await self.reports.crash_judged(judged)
            case RunnerReported() as reported:
                if self.reports.admit(reported):
                    await self.reports.report(reported)
            case ImageUploaded() as done:
                for ready in self.images.uploaded(done):
                    await self.reports.report(ready)
            case RunnerExited() as exited:
                await self.reports.runner_exited(exited)
            case InputsFetched(task_id=task_id, paths=paths):
                self._inputs_fetched(task_id, paths)
            case InputsFailed(task_id=task_id, reason=reason, message=message):
                if task_id in self.state.pending:  # else it already ended (cancel, deadline)
                    self.end(task_id, reason, message)
            case CancelSeen(task_id=task_id):
                await self._cancel(task_id)
            case Fenced(task_id=task_id):
                await self._fenced(task_id)
            case HandedIn() as offer:
                await self._handed_in(offer)
            case ev.HandOffEnded() as ended:
                self._hand_off_ended(ended)
            case Tick() | Stop():
                pass  # a tick only makes the loop plan again
            case _:
                self.apply(item)

    def _take(self, msg: Msg, *, handed_in: bool = False) -> None:
        """Hold a fetched (or handed-in) message and take it in in a child (`_receive`): its
        claim and checks may wait out an election, and the loop must not."""
        now = time.monotonic()
        if (task_id := self.acks.redelivered_while_held(msg)) is not None:
            # Never run twice, never judged "lost" by our own intake: keep it, renewed.
            log.warning("task %s redelivered while it is held here: kept, not run twice",
                        task_id)
            self._renew(task_id, msg, now)
            return
        key = intake_key(msg)
        span = self.spans.received(msg)
        if handed_in:  # tell JetStream at once: its sender's last word may be old
            self._renew(key, msg, now)
        else:
            self.acks.hold(key, msg, now)  # the beats keep it alive while it is taken in
        self.apply(ev.IntakeStarted(key, subjects.model_of_task_subject(msg.subject),
                                    time.time()))
        self.owner.spawn(f"intake {key}", self._receive(key, msg, span, handed_in))

    def _renew(self, key: str, msg: Msg, now: float) -> None:
        self.acks.renew(key, msg, now)
        self.owner.spawn(f"in_progress {key}", self.acks.beat_now(key, now))

    async def _receive(self, key: str, msg: Msg, span: Span, handed_in: bool) -> None:
        """A child: the intake's outcome (or why it has none) goes back to the loop."""
        try:
            with self.spans.current(span):
                # Listed in a stored heartbeat before it can run: a death from then on is
                # handed on in a second or two, not at AckWait (fleet.worker.heartbeat). The
                # beat is asked for first, so its round trip overlaps the intake's own (its
                # claim) and the wait after the intake rarely waits; a listing that failed is
                # logged (the intake goes on).
                heartbeat = self.cluster.heartbeat
                heartbeat.ask_to_list(msg.reply)
                outcome = await self.intake.receive(msg, handed_in=handed_in)
                try:
                    await heartbeat.list_held(msg.reply)
                except Exception as failed:
                    log.warning("listing a taken message failed: %s", failed)
        except Exception as exc:  # not taken in: the loop gives it back for another try soon
            error = f"{type(exc).__name__}: {exc}"
            self.inbox.put_nowait(TakenIn(key, msg, None, span, handed_in, error))
            return
        self.inbox.put_nowait(TakenIn(key, msg, outcome, span, handed_in))

    def _taken_in(self, taken: TakenIn) -> None:
        """An intake answered: queue the task under its id, or settle its message."""
        self.apply(ev.IntakeEnded(taken.key))
        outcome, span = taken.outcome, taken.span
        if isinstance(outcome, Queued):
            task = outcome.pending.task
            if self.acks.rekey(taken.key, task.task_id) is None:  # cannot happen: held at take
                self.acks.hold(task.task_id, taken.msg, time.monotonic())
            self.spans.queued(task, span)
            pending = outcome.pending
            if taken.handed_in:
                pending = ev.evolve(pending, local_only=True)
            self.apply(ev.TaskQueued(pending))
            if task.task_id in self.cluster.cancelled:  # cancelled while it was taken in
                self.end(task.task_id, ErrorReason.CANCELLED, "cancelled before it started")
            return
        msg = self.acks.release(taken.key) or taken.msg  # the newest delivery of it
        if outcome is None:
            log.warning("a task on %s was not taken in (%s); given back", msg.subject,
                        taken.error)
            self.spans.settled(None, "nak", span, "intake_failed")
            self.endings.settle(None, msg, Stage.HANDED_BACK)
            return
        self.spans.settled(outcome.task_id, verb_of(outcome.stage), span,
                           outcome.reason)
        self.endings.settle(outcome.task_id, msg, outcome.stage, outcome.finished)

    async def _act(self, action: rules.Action) -> None:
        match action:
            case rules.StopRunner(runner_id=runner_id, now=now):
                self.apply(ev.CommandSent(runner_id, "shutdown"))
                self.runners.stop(runner_id, kill=now)
            case rules.SpawnRunner(instance=instance):
                self.apply(ev.RunnerStarting(instance.instance_id))
                self.runners.spawn(instance, self.state.cards.get(instance.model))
            case rules.AdvanceRunner(runner_id=runner_id, command=command):
                self.apply(ev.CommandSent(runner_id, command))
                await self.runners.send(runner_id, _LIFECYCLE[command]())  # gone: RunnerExited
            case rules.FinishPending(task_id=task_id, reason=reason, message=message):
                self.end(task_id, reason, message)
            case rules.FetchInputs(task_id=task_id, hashes=hashes):
                self.apply(ev.InputsFetching(task_id))
                self.owner.spawn(
                    f"fetch inputs {task_id}", self.feeds.fetch_inputs(task_id, hashes)
                )
            case rules.Dispatch(task_id=task_id, runner_id=runner_id):
                await self._dispatch(task_id, runner_id)
            case rules.HandOff(task_id=task_id, node_id=node_id, runner_id=runner_id):
                msg = self.acks.message(task_id)
                if msg is None:  # not held (cannot happen for a pending task): run it here
                    self.apply(ev.HandOffEnded(task_id, node_id, runner_id, False, time.time()))
                    return
                self.apply(ev.HandOffStarted(task_id, node_id))
                self.owner.spawn(f"hand off {task_id}",
                                 self.handoffs.send(task_id, node_id, runner_id, msg))
            case rules.HandBack(task_id=task_id):
                self.hand_back(task_id)
            case rules.Pull(model=model, batch=batch, reserve=reserve, only=only):
                self.apply(ev.PullStarted(model, probe=only is not None))
                ends = self._probe_ends[model] = asyncio.Event() if only else None
                self.owner.spawn(f"pull {model}",
                                 self.feeds.pull(model, batch, reserve, only, ends))
            case rules.EndProbe(model=model):
                self.apply(ev.ProbeEnding(model))
                if (ends := self._probe_ends.get(model)) is not None:
                    ends.set()  # its Fetched (so PullEnded) comes at once
            case Preempt(task_id=task_id, runner_id=runner_id):
                await self._preempt(task_id, runner_id)

    # ---- actions ----------------------------------------------------------------------

    def _inputs_fetched(self, task_id: str, paths: dict[str, Path]) -> None:
        if task_id not in self.state.pending:  # it ended while they were fetched: unpin
            self.cluster.release_inputs(list(paths))
            return
        self.apply(ev.InputsPinned(task_id, tuple(paths)))
        self.apply(ev.InputsReady(task_id, {sha: str(path) for sha, path in paths.items()}))

    async def _dispatch(self, task_id: str, runner_id: str) -> None:
        pending = self.state.pending[task_id]
        earlier = self.intake.book.dispatched(pending)  # a continued task's earlier attempts
        if earlier.attempt:  # the seam, on the attempt's process span (`fleet trace` shows it)
            with self.spans.active(task_id):
                trace.get_current_span().add_event("seam", {
                    "fleet.attempt": earlier.attempt,
                    "fleet.continued_from": len(earlier.generated),
                    "fleet.moved_from": earlier.moved_from or "",
                })
        task = with_seed(pending.task, earlier.seed)
        # Queued again after a preemption, it runs with this seed (its accept recorded it).
        self.intake.book.running[task_id] = (
            pending if task is pending.task else ev.evolve(pending, task=task))
        traceparent, tracestate = self.spans.dispatched(task_id, runner_id)
        # In flight from here on, in WorkerState only: if the send fails (the runner has just
        # died) its RunnerExited, which always follows, ends this task runner_crashed.
        self.apply(ev.TaskDispatched(task_id, runner_id))
        now = time.time()
        # Its accept first: queued on the task's output before the runner can report a thing.
        await self.reports.accepted(accept_of(
            task, runner_id, self.state.node_id, traceparent, pending, earlier,
            self.intake.book.seams.get(task_id), now))
        sent = await self.runners.send(runner_id, pipe.SubmitTask(
            task=task, inputs=pending.inputs or {},
            delivery=pending.delivery,
            generated=list(earlier.generated), attempt=earlier.attempt,
            delivered_images=sorted(earlier.delivered_images),
            queue_wait_s=max(0.0, now - pending.received_at),
            traceparent=traceparent, tracestate=tracestate,
        ))
        if not sent:
            self.runners.abandon(runner_id)

    async def _handed_in(self, offer: HandedIn) -> None:
        """Another node offers a task it holds: take it only into a free slot, and only while
        its sender still waits; once the answer says taken, the message is this worker's
        (fleet.worker.handoff)."""
        hand_off, reply = offer.hand_off, offer.reply
        model = subjects.model_of_task_subject(hand_off.subject)
        msg = rebuilt(self.nc, hand_off)
        reason = rules.declines_hand_off(self.state, model)
        if reason is None and time.monotonic() - offer.received_at > TAKE_WITHIN_S:
            reason = "reached too late"
        if self.acks.redelivered_while_held(msg) is not None:
            # A redelivery of a message held here, passed back by the node it reached
            # (fleet.worker.takeover): ours still, whatever the slots; `_take` renews it.
            reason = None
        taken = reason is None
        self.owner.spawn("answer a hand-off", self.handoffs.answer(reply, taken, reason or ""))
        if taken:
            log.info("task message from node %s taken in (for runner %s)",
                     hand_off.from_node, hand_off.runner_id)
            self._take(msg, handed_in=True)

    def _hand_off_ended(self, ended: ev.HandOffEnded) -> None:
        task_id = ended.task_id
        cancelled = self.state.task(task_id).cancel is ev.CancelOrigin.WHILE_OFFERED
        self.apply(ev.CancelNoted(task_id, None))  # spent: whoever holds it now ends it
        if ended.taken is False:  # still ours: run it here
            self.apply(ended)
            if cancelled:
                self.end(task_id, ErrorReason.CANCELLED, "cancelled before it started")
            return
        # Taken, or perhaps taken: the message is not ours to verb any more, nor its output
        # ours to write (its taker fences it, fleet.worker.takeover).
        self.release(task_id)
        self.output.forget(task_id)
        self.apply(ended)
        self.acks.release(task_id)
        self.spans.settled(task_id, "handed_off" if ended.taken else "hand_off_unanswered")

    async def _preempt(self, task_id: str, runner_id: str) -> None:
        """A waiting interactive task takes this task's slot (fleet.worker.preemption): its
        runner stops it; its cancelled terminal queues it here again (`requeue`)."""
        log.info("task %s preempted on runner %s before its first token", task_id, runner_id)
        self.apply(ev.CancelNoted(task_id, ev.CancelOrigin.PREEMPTED))
        with self.spans.active(task_id):
            trace.get_current_span().add_event("preempted", {"fleet.runner": runner_id})
        await self.runners.send(runner_id, CancelTask(task_id=task_id))

    def requeue(self, task_id: str) -> None:
        """A preempted task's runner stopped it before its first token: it waits here again
        for a slot, its message still held (no verb: no delivery spent), from the start."""
        pending = self.intake.book.running.pop(task_id, None)
        self.apply(ev.CancelNoted(task_id, None))
        self.apply(ev.TaskEnded(task_id))  # off the runner: its slot is free
        if pending is None or self.state.stopping:  # cannot happen / the shutdown has it
            self.hand_back(task_id, Stage.STOPPED_MID_RUN)
            return
        self.apply(ev.TaskQueued(pending))

    def hand_back(self, task_id: str, stage: Stage = Stage.HANDED_BACK) -> None:
        """Give a task back to JetStream (nak): no terminal is written for it here."""
        log.info("task %s given back (%s)", task_id, stage)
        self.release(task_id)
        self.apply(ev.TaskEnded(task_id))
        self.spans.settled(task_id, "nak")
        if (msg := self.acks.release(task_id)) is not None:
            self.endings.settle(task_id, msg, stage)

    def end(self, task_id: str, reason: ErrorReason, message: str) -> None:
        """End a task that never reached a runner; its slot is free at once."""
        self.release(task_id)
        self.apply(ev.TaskEnded(task_id))
        with self.spans.active(task_id):  # the ending child inherits the task's context
            # Held until its verb: beaten while the end is stored (fleet.worker.endings).
            self.endings.fail(task_id, reason, message, self.acks.message(task_id))

    def finish(self, report: TaskFinished) -> None:
        self.release(report.task_id)
        self.apply(ev.TaskEnded(report.task_id))
        # Held until its verb: beaten while the end is stored (fleet.worker.endings).
        self.endings.finish(report, self.acks.message(report.task_id))

    def release(self, task_id: str) -> None:
        self.intake.book.released(task_id)
        if pinned := self.state.task(task_id).pinned:
            self.cluster.release_inputs(list(pinned))
        self.apply(ev.TaskReleased(task_id))

    async def _fenced(self, task_id: str) -> None:
        """Another attempt has taken this task over (this node was paused past AckWait, or
        its beats were lost): stop it here without a word on its stream or its message."""
        runner = self.state.runner_of(task_id)
        runner_id = runner.runner_id if runner is not None else None
        fate = fenced_fate(in_flight=runner_id is not None,
                           pending=task_id in self.state.pending)
        log.warning("task %s was taken over by another attempt: given up here (%s)",
                    task_id, fate)
        if fate is FencedFate.CANCEL_RUNNER and runner_id is not None:
            self.apply(ev.CancelNoted(task_id, ev.CancelOrigin.FENCED))
            await self.runners.send(runner_id, CancelTask(task_id=task_id))
        elif fate is FencedFate.RELEASE:
            self.give_up(task_id)

    def give_up(self, task_id: str) -> None:
        """Let a fenced task go: no terminal, no verb (its message is another holder's)."""
        self.release(task_id)
        self.apply(ev.TaskEnded(task_id))
        self.acks.release(task_id)
        self.output.forget(task_id)
        self.spans.settled(task_id, "fenced")

    async def _cancel(self, task_id: str) -> None:
        match self.state.place_of(task_id):
            case ev.Place.OFFERED:
                # Offered to another node: whoever holds it after the answer ends it (the other
                # node heard this cancel too, or reads it from FLEET_CANCELS at its intake).
                self.apply(ev.CancelNoted(task_id, ev.CancelOrigin.WHILE_OFFERED))
            case ev.Place.WAITING_INPUTS | ev.Place.WAITING_SLOT:
                self.end(task_id, ErrorReason.CANCELLED, "cancelled before it started")
            case ev.Place.RUNNING if (runner := self.state.runner_of(task_id)) is not None:
                self.apply(ev.CancelNoted(task_id, ev.CancelOrigin.WHILE_RUNNING))
                await self.runners.send(runner.runner_id, CancelTask(task_id=task_id))
            case ev.Place.ENDING:
                pass  # its runner has ended it: its terminal follows its images
            case _:
                # Not taken in yet (a fetch still on its way here, or not fetched at all):
                # remembered, so the intake ends the task cancelled as soon as it arrives.
                self.cluster.remember_cancel(task_id)


class _Link:
    """The worker's connection as a KV mirror wants it (fleet.bus.kv_mirror.Connection)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    @property
    def nc(self) -> Client | None:
        return self.worker.nc

    @property
    def connected(self) -> bool:
        return self.worker.nc.is_connected


def plans_nothing(item: InboxItem, state: WorkerState) -> bool:
    """Whether handling `item` leaves the planner (and the standby's tending) nothing new to
    read, so the loop need not plan for it. Pure. A runner's chunk: the token path. A
    runner's status from one state that takes tasks to another (ready <-> running, or
    running with another count: statuses come as a runner leaves Ready and at a step that
    changed its count, two a task at light load): the rules read a runner's state only as
    whether it takes tasks and which lifecycle step it is at (none for either)."""
    if not isinstance(item, RunnerReported):
        return False
    report = item.report
    if isinstance(report, STREAMED_REPORTS):
        return True
    if isinstance(report, pipe.RunnerStatusReport):
        runner = state.runners.get(item.runner_id)
        return (runner is not None and runner.status.state in ACCEPTS_TASKS
                and report.status.state in ACCEPTS_TASKS)
    return False


STREAMED_REPORTS = (TaskAccepted, TokenFrame, TokenChunk, ToolCallChunk)

_LIFECYCLE = {
    "connect_to_group": pipe.ConnectToGroup,
    "load_model": pipe.LoadModel,
    "warm_up": pipe.WarmUp,
}
