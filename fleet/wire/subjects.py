"""Subject, stream, bucket and consumer names, as functions so nobody formats them by hand."""

from __future__ import annotations

import hashlib

TASKS_STREAM = "FLEET_TASKS"
OUT_STREAM = "FLEET_OUT"
EVENTS_STREAM = "FLEET_EVENTS"
TRACES_STREAM = "FLEET_TRACES"
DEAD_LETTERS_STREAM = "FLEET_DEAD"
ADVISORIES_STREAM = "FLEET_ADVISORIES"
NODES_BUCKET = "FLEET_NODES"
# What gateways read of the nodes, kept by the sweeper (fleet/worker/capabilities.py).
CAPABILITIES_BUCKET = "FLEET_CAPABILITIES"
CAPABILITIES_KEEPER = "keeper"
INSTANCES_BUCKET = "FLEET_INSTANCES"
RUNNERS_BUCKET = "FLEET_RUNNERS"
PREFIXES_BUCKET = "FLEET_PREFIXES"
CANCELS_BUCKET = "FLEET_CANCELS"
IMAGES_BUCKET = "FLEET_IMAGES"
CLAIMS_BUCKET = "FLEET_CLAIMS"
REFUSED_STREAM = "FLEET_REFUSED"

# A header a task's publisher may set to hear, on a subject of its own, why its task was
# refused (only `_INBOX.` subjects are answered: see fleet.worker.claims.reply_subject).
REPLY_HEADER = "Fleet-Reply-To"

TASKS_ALL = "fleet.tasks.>"
DEAD_LETTERS_ALL = "fleet.dead.>"
REFUSED_ALL = "fleet.refused.>"
# Request-reply asks (`nats req fleet.ask.<model> ...`): every worker listens in one queue
# group, so each ask is answered once.
ASK_ALL = "fleet.ask.*"
ASK_QUEUE = "fleet-ask"


def tasks(model: str, priority: str = "default") -> str:
    """A model's tasks of one priority class (fleet.worker.priority): the default class on
    `fleet.tasks.<model>` (as before classes existed), the others on
    `fleet.tasks.<model>.<class>`; a model id has no dots, so the model is the 3rd token."""
    return f"fleet.tasks.{model}" if priority == "default" else f"fleet.tasks.{model}.{priority}"


def model_of_task_subject(subject: str) -> str:
    return subject.removeprefix("fleet.tasks.").split(".", 1)[0]


def priority_of_task_subject(subject: str) -> str:
    """The class a task message was published in (`tasks`' and `lane`'s inverse)."""
    tokens = subject.removeprefix("fleet.tasks.").split(".")
    return tokens[1] if len(tokens) > 1 else "default"


def lane(model: str, priority: str, tenant: str) -> str:
    """A tenant's lane of a model's class (fleet.worker.lanes): `fleet.tasks.<model>.<class>.
    <tenant>`, the class named even when it is `default`; `tenant` is one subject token
    (fleet.bus.fairness.tenant_token) or `*` for every lane of the class."""
    return f"fleet.tasks.{model}.{priority}.{tenant}"


def tenant_of_task_subject(subject: str) -> str | None:
    """The tenant token of a lane's subject; None for a class's shared subject."""
    tokens = subject.removeprefix("fleet.tasks.").split(".")
    return tokens[2] if len(tokens) > 2 else None


def ask(model: str) -> str:
    return f"fleet.ask.{model}"


def model_of_ask_subject(subject: str) -> str:
    return subject.removeprefix("fleet.ask.")


def out(task_id: str) -> str:
    return f"fleet.out.{task_id}"


def cancel(task_id: str) -> str:
    return f"fleet.cancel.{task_id}"


def handoff(node_id: str) -> str:
    """Where a worker passes a pulled task message to the node whose runner should run it."""
    return f"fleet.handoff.{node_id}"


def runner_event(node_id: str, runner_id: str) -> str:
    return f"fleet.events.runner.{node_id}.{runner_id}"


def alive(node_id: str) -> str:
    """A worker answers requests here while its process lives (fleet.worker.deathwatch)."""
    return f"fleet.alive.{node_id}"


def node_event(node_id: str) -> str:
    return f"fleet.events.node.{node_id}"


def traces(trace_id: str) -> str:
    return f"fleet.traces.{trace_id}"


def dead_letter(model: str) -> str:
    return f"fleet.dead.{model}"


def refused(model: str) -> str:
    """Where a refused task's TaskRefused is recorded (stream FLEET_REFUSED)."""
    return f"fleet.refused.{model}"


def model_of_dead_letter(subject: str) -> str:
    return subject.removeprefix("fleet.dead.")


def durable(model: str, priority: str = "default") -> str:
    """One durable pull consumer per model and priority class: every worker serving it
    shares the queue (`tasks-<model>` for the default class, `<class>-tasks-<model>`)."""
    return f"tasks-{model}" if priority == "default" else f"{priority}-tasks-{model}"


def lane_durable(model: str, priority: str, tenant: str) -> str:
    """The durable of one tenant lane, shared by every worker serving the model. The digest
    keeps names apart that the dashes would join (model `a-b`, tenant `c`; `a`, `b-c`)."""
    digest = hashlib.sha256(f"{model}\0{priority}\0{tenant}".encode()).hexdigest()[:10]
    return f"lane-{priority}-{model}-{tenant}-{digest}"


def model_of_durable(name: str) -> str | None:
    """The model a FLEET_TASKS consumer serves (any class), or None for a consumer Fleet did
    not make. `tasks-` is tried first: a class's prefix never starts with it."""
    for prefix in ("tasks-", "interactive-tasks-", "batch-tasks-"):
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return None


def capabilities_key(node_id: str) -> str:
    """A node's record in FLEET_CAPABILITIES (a node id has no dots: one token)."""
    return f"node.{node_id}"


def node_of_capabilities_key(key: str) -> str | None:
    """The node a FLEET_CAPABILITIES key names, or None (the keeper's key)."""
    return key.removeprefix("node.") if key.startswith("node.") else None
