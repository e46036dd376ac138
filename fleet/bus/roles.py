"""Who may do what on the bus: the one source of the role table in docs/permissions.md, of
ops/nats/auth.conf, and of the server config `fleet nats --auth` generates.

NATS permissions are per subject, so every grant below is a subject (a JetStream API call is a
request on `$JS.API.<VERB>.<stream>...`). Facts that shape them: nats-py creates an ephemeral
consumer on `$JS.API.CONSUMER.CREATE.<stream>` (no suffix), where the server refuses a durable
name, and a named one (durable or not: the body says, which permissions cannot see) on
`...CREATE.<stream>.<name>[.<filter>]`, so only the roles that own durables get the named
form; `>` matches whole tokens only, so a bucket's stream (`KV_FLEET_NODES`) is named in full,
never as `KV_>`; and a JetStream ack subject has a v1 form `$JS.ACK.<stream>.>` and a v2 form
`$JS.ACK.<domain>.<account hash>.<stream>.>` (nats-server's `js_ack_fc_v2`), granted both.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.bus.replies import inbox_prefix
from fleet.wire.uploads import IMAGE_UPLOAD  # fleet.worker.uploads stores a client's image

ROLES = ("client", "gateway", "worker", "operator")

TASKS = "FLEET_TASKS"
OUT = "FLEET_OUT"
EVENTS = "FLEET_EVENTS"
TRACES = "FLEET_TRACES"
DEAD = "FLEET_DEAD"
ADVISORIES = "FLEET_ADVISORIES"
REFUSED = "FLEET_REFUSED"
IMAGES = "OBJ_FLEET_IMAGES"
WEIGHTS = "OBJ_FLEET_WEIGHTS"
VISION = "OBJ_FLEET_VISION"  # the vision cache's encoded images (fleet/bus/vision_store.py)
MODELS = "FLEET_MODELS"
INSTANCES = "FLEET_INSTANCES"
# FLEET_CAPABILITIES: what gateways read of the nodes, kept by the sweeper (a worker) from
# the heartbeats (fleet/worker/capabilities.py), so no gateway watches FLEET_NODES for it.
STATE_BUCKETS = ("FLEET_NODES", "FLEET_CAPABILITIES", INSTANCES, "FLEET_RUNNERS")
CANCELS = "FLEET_CANCELS"
CLAIMS = "FLEET_CLAIMS"
TENANTS = "FLEET_TENANTS"
PREFIXES = "FLEET_PREFIXES"
# Batch jobs (fleet/bus/batch_store.py): the gateway's alone.
FILES = "OBJ_FLEET_FILES"
BATCH_RESULTS = "FLEET_BATCH_RESULTS"
BATCH_BUCKETS = ("FLEET_BATCHES", "FLEET_BATCH_LEASES", "FLEET_IDEMPOTENCY")
FAIRNESS = "FLEET_FAIRNESS"  # tenants' virtual token counters (fleet/gateway/fair_share.py)
DEADLINES = "FLEET_DEADLINES"  # a sentinel per task with a deadline (fleet/worker/janitor.py)
LEASES = "FLEET_LEASES"  # fleet-wide duties held by one worker (fleet.worker.sweeper)
ALL_STREAMS = (
    TASKS, OUT, EVENTS, TRACES, DEAD, ADVISORIES, REFUSED, IMAGES, WEIGHTS, VISION,
    *(f"KV_{b}" for b in (*STATE_BUCKETS, CANCELS, CLAIMS, TENANTS, MODELS, PREFIXES, LEASES)),
    FILES, BATCH_RESULTS, *(f"KV_{b}" for b in BATCH_BUCKETS), DEADLINES, f"KV_{FAIRNESS}",
)


def _api(*parts: str) -> str:
    return "$JS.API." + ".".join(parts)


def _info(*streams: str) -> list[str]:
    return [_api("STREAM", "INFO", s) for s in streams]


def _readers(stream: str) -> list[str]:
    """Short-lived consumers of one stream: ephemeral only (the unsuffixed CREATE, where the
    server refuses a durable), pulled or pushed, deleted by their owner when done (only on
    this stream) or else by the stream's inactive threshold (`consumer_limits`)."""
    return [
        _api("CONSUMER", "CREATE", stream),
        _api("CONSUMER", "INFO", stream, "*"), _api("CONSUMER", "MSG", "NEXT", stream, "*"),
        _api("CONSUMER", "DELETE", stream, "*"),
    ]


def _acks(stream: str) -> list[str]:
    """Acks of one stream's messages, in the v1 and the v2 (domain, account hash) form."""
    return [f"$JS.ACK.{stream}.>", f"$JS.ACK.*.*.{stream}.>"]


def _kv_read(bucket: str) -> list[str]:
    stream = f"KV_{bucket}"
    return [
        *_info(stream), _api("DIRECT", "GET", stream), _api("DIRECT", "GET", stream, ">"),
        _api("STREAM", "MSG", "GET", stream), *_readers(stream),
    ]


def _images_read() -> list[str]:
    return [*_info(IMAGES), _api("STREAM", "MSG", "GET", IMAGES), *_readers(IMAGES)]


def _weights_read() -> list[str]:
    return [*_info(WEIGHTS), _api("STREAM", "MSG", "GET", WEIGHTS), *_readers(WEIGHTS)]


FLOW_CONTROL = "$JS.FC.>"  # a push consumer's flow-control answers go here (v1 and v2)


def inbox(role: str) -> str:
    """A role's own inboxes (fleet.bus.connect makes every inbox under `_INBOX.<role>`): the
    only ones it may subscribe to, so no role reads another's replies or deliveries."""
    return f"{inbox_prefix(role)}.>"




@dataclass(frozen=True)
class Grant:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # Refused even where an allow would match: what a role must never do, said explicitly so
    # that a broader allow added later cannot grant it (nats-server >= 2.12.7 applies denies
    # that overlap allows).
    deny_publish: tuple[str, ...] = ()


def _grant(publish: list[str], subscribe: list[str], deny: tuple[str, ...] = ()) -> Grant:
    return Grant(tuple(dict.fromkeys(publish)), tuple(dict.fromkeys(subscribe)), deny)


# Durable (or named) consumers, on any stream: the legacy DURABLE.CREATE and the named CREATE
# forms, six tokens or more (a reader's ephemeral CREATE.<stream> has five).
NO_DURABLES = (
    _api("CONSUMER", "DURABLE", "CREATE", ">"), _api("CONSUMER", "CREATE", "*", "*"),
    _api("CONSUMER", "CREATE", "*", "*", ">"),
)


GRANTS: dict[str, Grant] = {
    # Submits tasks and follows them; can never see the queue itself nor change the fleet.
    "client": _grant(
        publish=[
            "fleet.tasks.>", "fleet.ask.>", "fleet.cancel.>", f"$KV.{CANCELS}.>",
            "fleet.traces.>", FLOW_CONTROL,
            # Images are uploaded through a worker, which stores them by hash and never
            # replaces one: who may publish on $O.FLEET_IMAGES may delete any image.
            IMAGE_UPLOAD,
            # Replay of one task: an ephemeral (ordered) consumer only, which the server
            # removes within FLEET_OUT's inactive threshold. No named form (it could be
            # durable), no DELETE.
            _api("CONSUMER", "CREATE", OUT),
            *_info(OUT, f"KV_{CANCELS}"),
            *_info(IMAGES), _api("STREAM", "MSG", "GET", IMAGES),
            # An image is read through a short-lived consumer its reader deletes when done;
            # the image store holds no durable consumer, so that is all DELETE reaches.
            *_readers(IMAGES),
        ],
        subscribe=[inbox("client"), "fleet.out.>"],
        deny=NO_DURABLES,
    ),
    # The HTTP front door: publishes tasks and cancels, reads outputs, state and metrics;
    # on FLEET_TASKS only publish and information, never a consumer of it.
    "gateway": _grant(
        publish=[
            "fleet.tasks.>", "fleet.cancel.>", f"$KV.{CANCELS}.>", "fleet.traces.>",
            f"$KV.{TENANTS}.>", "$O.FLEET_IMAGES.>", FLOW_CONTROL, _api("INFO"),
            # The dashboard's operator actions: place and remove an instance (a put or a
            # delete marker on one key of FLEET_INSTANCES; nodes and runners stay the
            # workers'), and the dead letters list (reads of FLEET_DEAD, no consumer).
            f"$KV.{INSTANCES}.>", _api("STREAM", "MSG", "GET", DEAD),
            *_info(*ALL_STREAMS),
            _api("CONSUMER", "INFO", TASKS, "*"), _api("CONSUMER", "LIST", TASKS),
            _api("CONSUMER", "NAMES", TASKS),
            _api("CONSUMER", "CREATE", OUT), _api("STREAM", "MSG", "GET", OUT),
            _api("CONSUMER", "CREATE", TRACES), _api("STREAM", "MSG", "GET", TRACES),
            *(s for b in (*STATE_BUCKETS, CANCELS, TENANTS, MODELS) for s in _kv_read(b)),
            *_images_read(), *_weights_read(),
            # Batch jobs: files (written, read, deleted: a purge of one file's chunks),
            # records, leases, idempotency keys, and one result per request line.
            "$O.FLEET_FILES.>", _api("STREAM", "MSG", "GET", FILES), *_readers(FILES),
            _api("STREAM", "PURGE", FILES),
            *(f"$KV.{b}.>" for b in BATCH_BUCKETS),
            *(s for b in BATCH_BUCKETS for s in _kv_read(b)),
            "fleet.batches.>", *_readers(BATCH_RESULTS),
            _api("STREAM", "MSG", "GET", BATCH_RESULTS),
            "fleet.deadlines.>",  # the sentinel of a task it publishes with a deadline
            f"$KV.{FAIRNESS}.>", *_kv_read(FAIRNESS),  # fair tenants: counters it keeps
        ],
        # and the fair-share counters' changes as they are put (a core subscription: a
        # request held for its tenant's turn wakes on them without a consumer of its own)
        subscribe=[inbox("gateway"), "fleet.out.>", f"$KV.{FAIRNESS}.>"],
        deny=NO_DURABLES,
    ),
    # A node: consumes tasks, writes outputs, state, images; purges one model's tasks
    # (the janitor, for a model no card names) but never a whole stream or another one.
    "worker": _grant(
        publish=[
            "fleet.out.>", "fleet.events.>", "fleet.traces.>", "fleet.dead.>", "fleet.refused.>",
            # Answers on the asker's inbox (asks, hand-offs) and refusals on a publisher's
            # `Fleet-Reply-To`, which fleet.bus.replies checks is an inbox. Not the
            # gateway's inbox (it asks nothing of workers), and no allow_responses: that
            # would let a requester choose any reply subject the worker then may write.
            inbox("client"), inbox("operator"), inbox("worker"),
            "fleet.tasks.>",  # an ask on fleet.ask.<model> is published as a task
            "fleet.handoff.*",  # a held task message passed to the node that should run it
            "fleet.alive.*",  # probing whether a node's process lives (worker/deathwatch.py)
            *(f"$KV.{b}.>" for b in (*STATE_BUCKETS, CLAIMS, MODELS, PREFIXES, LEASES)),
            "$O.FLEET_IMAGES.>", "$O.FLEET_WEIGHTS.>", "$O.FLEET_VISION.>", FLOW_CONTROL,
            _api("INFO"), *_acks(TASKS), *_acks(ADVISORIES),
            *_info(*ALL_STREAMS),
            # The per-model durable is made when a model is placed, so a worker may create
            # (or update) consumers on FLEET_TASKS; it may not delete them.
            _api("CONSUMER", "CREATE", TASKS, ">"), _api("CONSUMER", "INFO", TASKS, "*"),
            # A restored durable is reset to the tasks passed over while it was changed
            # (fleet/worker/consumer_guard.py); moving a position deletes nothing.
            _api("CONSUMER", "RESET", TASKS, "*"),
            _api("CONSUMER", "MSG", "NEXT", TASKS, "*"), _api("CONSUMER", "LIST", TASKS),
            _api("CONSUMER", "NAMES", TASKS),
            _api("STREAM", "MSG", "GET", TASKS), _api("STREAM", "MSG", "DELETE", TASKS),
            _api("STREAM", "PURGE", TASKS),
            _api("CONSUMER", "CREATE", ADVISORIES, ">"), _api("CONSUMER", "INFO", ADVISORIES, "*"),
            _api("CONSUMER", "MSG", "NEXT", ADVISORIES, "*"),
            # Deadlines: the shared durable of the sentinels' expiry markers.
            *_acks(DEADLINES), _api("CONSUMER", "CREATE", DEADLINES, ">"),
            _api("CONSUMER", "INFO", DEADLINES, "*"),
            _api("CONSUMER", "MSG", "NEXT", DEADLINES, "*"),
            # Continuing a dead worker's task replays what it stored (an ephemeral consumer
            # on FLEET_OUT). No DELETE: it could remove a gateway's shared consumer; the
            # replay's consumer goes by its inactive threshold.
            _api("CONSUMER", "CREATE", OUT), _api("STREAM", "MSG", "GET", OUT),
            *(s for b in (*STATE_BUCKETS, CANCELS, CLAIMS, MODELS, PREFIXES, LEASES)
              for s in _kv_read(b)),
            *_images_read(), *_weights_read(),
            _api("STREAM", "MSG", "GET", VISION), *_readers(VISION),
            # A NATS-published task's served tokens, charged to its tenant's counter
            # (fleet/worker/fair_charge.py); no subscription to the counters' changes.
            f"$KV.{FAIRNESS}.>", *_kv_read(FAIRNESS),
        ],
        # fleet.ask.*: the asks a worker answers (queue group fleet-ask); fleet.out.>: the
        # asked task's terminal, watched live; fleet.handoff.*: tasks other nodes pass here;
        # fleet.images.put: clients' image uploads (queue group fleet-images)
        # No fleet.tasks.>: a task reaches workers only through its model's pull consumer
        # (the triage of unknown models reads FLEET_TASKS' counts, fleet/worker/janitor.py).
        subscribe=[inbox("worker"), "fleet.cancel.*", "fleet.ask.*", "fleet.out.>",
                   "fleet.handoff.*", "fleet.alive.*", IMAGE_UPLOAD],
    ),
    # Provisions streams, buckets and consumers, and repairs: everything.
    "operator": _grant(publish=[">"], subscribe=[">"]),
}


@dataclass(frozen=True)
class Action:
    """One row of the permission table: something a role may or may not do."""

    key: str
    what: str
    allowed: frozenset[str]
    why: str = ""


def _who(*roles: str) -> frozenset[str]:
    return frozenset(("operator", *roles))


ACTIONS: tuple[Action, ...] = (
    Action("publish_task", "publish a task on `fleet.tasks.<model>`",
           _who("client", "gateway", "worker"),
           "a worker publishes the task of an ask it answers (`fleet.ask.<model>`)"),
    Action("ask", "ask on `fleet.ask.<model>` (request-reply: the task's final answer)",
           _who("client")),
    Action("answer_asks", "answer asks: subscribe to `fleet.ask.*` (queue group fleet-ask)",
           _who("worker")),
    Action("cancel_task", "cancel a task (`fleet.cancel.<id>` and its FLEET_CANCELS record)",
           _who("client", "gateway")),
    Action("follow_output", "subscribe to a task's output `fleet.out.<id>`",
           _who("client", "gateway", "worker"),
           "subjects cannot be limited per task id: any client reads any task's output; a "
           "worker watches for the end of a task it was asked for"),
    Action("replay_output", "replay a task's output (an ordered consumer on FLEET_OUT)",
           _who("client", "gateway", "worker"),
           "a worker continuing a dead worker's task reads the events that one stored"),
    Action("publish_output", "publish on `fleet.out.<id>` (a task's events)", _who("worker")),
    Action("read_queued_task", "read a queued task (STREAM.MSG.GET on FLEET_TASKS)",
           _who("worker")),
    Action("direct_get_task", "direct-get from FLEET_TASKS", _who()),
    Action("subscribe_tasks", "subscribe to `fleet.tasks.>` (see every task published)",
           _who(), "a worker gets its tasks from its models' pull consumers only: each task "
           "body is delivered once"),
    Action("consume_tasks", "fetch tasks from a model's durable `tasks-<model>`",
           _who("worker")),
    Action("create_task_consumer", "create a consumer on FLEET_TASKS", _who("worker"),
           "models are placed at run time; the worker makes the model's durable then"),
    Action("reset_task_consumer", "reset a FLEET_TASKS durable's position (`CONSUMER.RESET`)",
           _who("worker"), "a worker that restores a changed durable delivers the tasks "
           "passed over meanwhile (fleet/worker/consumer_guard.py)"),
    Action("task_consumer_info", "read FLEET_TASKS consumer info (queue metrics)",
           _who("gateway", "worker")),
    Action("delete_task_consumer", "delete a FLEET_TASKS consumer (halts a model)", _who()),
    Action("delete_out_consumer", "delete a FLEET_OUT consumer", _who()),
    Action("stream_info", "read stream info (FLEET_TASKS, KV_FLEET_NODES, ...)",
           _who("gateway", "worker")),
    Action("create_stream", "create a stream or bucket", _who()),
    Action("update_stream", "change a stream's configuration", _who()),
    Action("delete_stream", "delete a stream", _who()),
    Action("purge_stream", "purge FLEET_OUT or the image store", _who()),
    Action("purge_model_tasks", "purge one model's subject from FLEET_TASKS", _who("worker"),
           "the janitor drops tasks of a model that no card names"),
    Action("read_state", "read FLEET_NODES / FLEET_CAPABILITIES / FLEET_INSTANCES / "
           "FLEET_RUNNERS",
           _who("gateway", "worker")),
    Action("write_state", "write FLEET_NODES / FLEET_CAPABILITIES / FLEET_RUNNERS",
           _who("worker"), "FLEET_CAPABILITIES only by the sweeper's holder in practice: a "
           "NATS permission cannot tell one worker from another"),
    Action("write_instances", "place or remove an instance (write FLEET_INSTANCES)",
           _who("gateway", "worker"),
           "the gateway only for the dashboard's operator keys (fleet/gateway/keys.py)"),
    Action("read_dead_letters", "read the dead letters (STREAM.MSG.GET on FLEET_DEAD)",
           _who("gateway"), "the dashboard lists them, to operator keys only"),
    Action("put_image", "write FLEET_IMAGES directly (chunks and descriptions)",
           _who("gateway", "worker"),
           "whoever may write there may also delete or replace any image (a description "
           "marked deleted, a roll-up): only the processes that check an image's hash"),
    Action("upload_image", "upload an image (`fleet.images.put`: a worker stores it by hash, "
           "never replacing one)", _who("client"),
           "the way a `client` provides an input image: `fleet images put` or `nats req`"),
    Action("answer_uploads", "answer image uploads: subscribe to `fleet.images.put`",
           _who("worker")),
    Action("durable_out_consumer", "create a named or durable consumer on FLEET_OUT or "
           "FLEET_IMAGES", _who(),
           "readers make ephemeral ones, which the server removes within the stream's "
           "inactive threshold"),
    Action("get_image", "read an image from FLEET_IMAGES",
           _who("client", "gateway", "worker")),
    Action("read_models", "read model cards (FLEET_MODELS) and weight files (FLEET_WEIGHTS)",
           _who("gateway", "worker")),
    Action("publish_models", "publish a model: its card and its files (FLEET_MODELS, "
           "FLEET_WEIGHTS)", _who("worker"),
           "the first node that builds a built-in model publishes it for the others"),
    Action("remove_model_files", "delete a model's files from FLEET_WEIGHTS (purge)", _who(),
           "`fleet models remove` runs with the operator's credentials"),
    Action("read_traces", "read stored spans (a consumer on FLEET_TRACES)", _who("gateway")),
    Action("publish_traces", "publish spans on `fleet.traces.<trace>`",
           _who("client", "gateway", "worker")),
    Action("publish_events", "publish cluster events on `fleet.events.>`", _who("worker")),
    Action("subscribe_cancels", "subscribe to `fleet.cancel.*`", _who("worker")),
    Action("dead_letter", "publish a dead letter on `fleet.dead.<model>`", _who("worker")),
    Action("claim_task_id", "claim a task id (FLEET_CLAIMS) and record a refusal "
           "(`fleet.refused.<model>`)", _who("worker")),
    Action("advertise_prefixes", "read and write runners' prefix summaries (FLEET_PREFIXES)",
           _who("worker"), "a worker advertises what its runners' prefix caches hold"),
    Action("hold_lease", "take and renew a fleet-wide duty's lease (FLEET_LEASES)",
           _who("worker"), "one worker at a time watches heartbeats, sweeps dead nodes and "
           "places on demand (fleet/worker/sweeper.py)"),
    Action("hand_off_task", "pass a held task message to another node (`fleet.handoff.<node>`)",
           _who("worker"), "it carries the message's ack subject: only workers may send or "
           "receive one"),
    Action("liveness_probes", "answer and send liveness probes (`fleet.alive.<node>`)",
           _who("worker"), "every worker answers on its own node's subject while its process "
           "lives; the holders of the sweeper and sentinel leases probe the others, and 'no "
           "responders' there declares a node dead (fleet/worker/deathwatch.py): another role "
           "that could answer there would keep a dead node's tasks waiting for AckWait, and "
           "one that could send only wastes a worker's answer"),
    Action("batch_jobs", "run batch jobs: files (FLEET_FILES), job records, leases and "
           "idempotency keys (FLEET_BATCHES, FLEET_BATCH_LEASES, FLEET_IDEMPOTENCY), results "
           "(`fleet.batches.<id>.<line>`)", _who("gateway"),
           "the /v1/files and /v1/batches of every gateway replica share them"),
    Action("fair_share", "keep tenants' fair-share counters (FLEET_FAIRNESS) and follow "
           "their changes (`$KV.FLEET_FAIRNESS.>`)", _who("gateway"),
           "every gateway replica holds a tenant back by the same counters"),
    Action("charge_fair_share", "add tokens served to a tenant's fair-share counter "
           "(FLEET_FAIRNESS, compare-and-set)", _who("gateway", "worker"),
           "the worker that ends a task published straight on NATS charges its tenant, so "
           "the gateways' fair turn sees what that tenant was served"),
    Action("set_deadline", "set a task's deadline sentinel (`fleet.deadlines.<model>.<id>`, "
           "per-message TTL)", _who("gateway"),
           "its expiry ends the task if it never started: only trusted publishers, since a "
           "forged marker header could expire another's task (fleet/bus/deadlines.py)"),
    Action("expire_deadlines", "consume the sentinels' expiry markers (durable `deadlines` "
           "on FLEET_DEADLINES) and end unstarted tasks `expired`", _who("worker"),
           "one worker handles each deadline that passes (fleet/worker/janitor.py)"),
    Action("tenant_records", "read and write which tenant owns a task or image (FLEET_TENANTS)",
           _who("gateway"), "tenants are the gateway's: NATS users are roles, not tenants"),
    Action("own_inbox", "receive replies on its own inbox `_INBOX.<role>.>` (requests, "
           "JetStream pulls, KV and object reads)", _who("client", "gateway", "worker"),
           "every Fleet connection makes its inboxes there (nats-py's `inbox_prefix`); a "
           "client outside Fleet sets it too: `nats --inbox-prefix _INBOX.client`, nats-py "
           "`inbox_prefix=\"_INBOX.client\"`. One role's users share its inboxes: give "
           "people who must not read each other's replies users of their own"),
    Action("all_inboxes", "subscribe to `_INBOX.>` (every role's replies and deliveries)",
           _who()),
    Action("other_inbox", "subscribe to another role's inbox (`_INBOX.worker.>`; a worker "
           "tries `_INBOX.client.>`)", _who()),
    Action("unprefixed_inbox", "subscribe to an inbox without a role (`_INBOX.<id>`, the "
           "default of nats-py and the nats CLI)", _who()),
    Action("answer_on_inbox", "publish on a client's inbox (answers to asks, refusals on "
           "`Fleet-Reply-To`)", _who("worker"),
           "a worker answers only on a subject of inbox shape (fleet/bus/replies.py): an ask "
           "or header whose reply names `$KV.…`, `$O.…`, `$JS.…` or `fleet.…` gets no write"),
    Action("publish_gateway_inbox", "publish on the gateway's inbox (into its replies and "
           "deliveries)", _who()),
)


def table_markdown() -> str:
    """The permission table of docs/permissions.md (a test checks the file shows it)."""
    head = "| action | " + " | ".join(ROLES) + " |"
    rule = "|---|" + "---|" * len(ROLES)
    rows = [
        f"| {a.what} | " + " | ".join("yes" if r in a.allowed else "no" for r in ROLES) + " |"
        for a in ACTIONS
    ]
    notes = [f"- {a.what}: {a.why}" for a in ACTIONS if a.why]
    return "\n".join([head, rule, *rows, "", "Notes:", "", *notes]) + "\n"
