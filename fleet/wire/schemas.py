"""JSON Schemas of every message family, written to schemas/ and checked for drift."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from pydantic import TypeAdapter

from fleet.wire import (
    batches,
    cluster,
    codec,
    events,
    fairness,
    handoff,
    pipe,
    prefixes,
    records,
    ring,
    tasks,
    uploads,
)
from fleet.wire.examples import examples

FAMILIES: dict[str, TypeAdapter[Any]] = {
    "task": codec.TASK,
    "cancel-task": TypeAdapter(tasks.CancelTask),
    "output-event": codec.OUTPUT_EVENT,
    "cluster-event": codec.CLUSTER_EVENT,
    "runner-status": codec.RUNNER_STATUS,
    "model-card": TypeAdapter(cluster.ModelCard),
    "node-info": TypeAdapter(cluster.NodeInfo),
    "node-capabilities": TypeAdapter(cluster.NodeCapabilities),
    "capabilities-keeper": TypeAdapter(cluster.CapabilitiesKeeper),
    "instance": TypeAdapter(cluster.Instance),
    "runner-record": TypeAdapter(cluster.RunnerRecord),
    "runner-command": pipe.COMMAND,
    "runner-report": pipe.REPORT,
    "runner-spec": TypeAdapter(pipe.RunnerSpec),
    "task-refused": TypeAdapter(events.TaskRefused),
    "task-fence": TypeAdapter(events.TaskFence),
    "prefix-summary": TypeAdapter(prefixes.PrefixSummary),
    "step-plan": TypeAdapter(ring.StepPlan),
    "task-hand-off": TypeAdapter(handoff.TaskHandOff),
    "hand-off-answer": TypeAdapter(handoff.HandOffAnswer),
    "ask-reply": codec.ASK_REPLY,
    "task-record": TypeAdapter(records.TaskRecord),
    "file-record": TypeAdapter(batches.FileRecord),
    "batch-record": TypeAdapter(batches.BatchRecord),
    "batch-result": TypeAdapter(batches.BatchResult),
    "batch-lease": TypeAdapter(batches.BatchLease),
    "idempotency-record": TypeAdapter(batches.IdempotencyRecord),
    "image-upload-reply": uploads.UPLOAD_REPLY,
    "tenant-share": TypeAdapter(fairness.TenantShare),
}

_SUBJECTS = {
    "task": "fleet.tasks.<model>",
    "cancel-task": "fleet.cancel.<task_id>",
    "output-event": "fleet.out.<task_id>",
    "cluster-event": "fleet.events.>",
    "node-info": "KV FLEET_NODES, key = node id",
    "node-capabilities": "KV FLEET_CAPABILITIES, key = node.<node_id> (written by the sweeper)",
    "capabilities-keeper": "KV FLEET_CAPABILITIES, key = keeper (the sweeper's mark)",
    "instance": "KV FLEET_INSTANCES, key = instance id",
    "runner-record": "KV FLEET_RUNNERS, key = runner id",
    "prefix-summary": "KV FLEET_PREFIXES, key = runner id",
    "step-plan": "rank 0 to the other ranks of a sharded instance, over its mx.distributed ring",
    "task-hand-off": "fleet.handoff.<node_id> (a core request between workers)",
    "hand-off-answer": "the reply to a task-hand-off request",
    "task-refused": "fleet.refused.<model> (stream FLEET_REFUSED) and the task's "
    "Fleet-Reply-To inbox",
    "task-fence": "fleet.out.<task_id>.fence (stream FLEET_OUT): a takeover of the task",
    "ask-reply": "the reply to a request on fleet.ask.<model> (whose body is a task)",
    "task-record": "KV FLEET_TENANTS, key = task.<task_id>",
    "file-record": "KV FLEET_BATCHES, key = file.<file_id> (the bytes: object store FLEET_FILES)",
    "batch-record": "KV FLEET_BATCHES, key = batch.<batch_id>",
    "batch-result": "fleet.batches.<batch_id>.<line> (stream FLEET_BATCH_RESULTS, one a line)",
    "batch-lease": "KV FLEET_BATCH_LEASES, key = batch id (present while the job is not done)",
    "idempotency-record": "KV FLEET_IDEMPOTENCY, key = <tenant>.<sha256 of the key>",
    "image-upload-reply": "the reply to a request on fleet.images.put (whose body is the image)",
    "tenant-share": "KV FLEET_FAIRNESS, key = <model>.<class>.<tenant>",
}


def _dump(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def render() -> dict[str, bytes]:
    """Relative path under schemas/ -> file bytes."""
    files: dict[str, bytes] = {}
    for family, adapter in FAMILIES.items():
        schema = adapter.json_schema(mode="validation")
        schema["$id"] = f"https://fleet.dev/schemas/{family}.schema.json"
        if family in _SUBJECTS:
            schema["x-fleet-subject"] = _SUBJECTS[family]
        files[f"{family}.schema.json"] = _dump(schema)
    for stem, message in examples().items():
        files[f"examples/{stem}.json"] = _dump(message.model_dump(mode="json", exclude_none=True))
    return files


def write(directory: Path) -> list[str]:
    written = []
    for rel, data in render().items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            written.append(rel)
    return written


def drift(directory: Path) -> list[str]:
    """Paths that differ from the models, are missing, or are stale leftovers."""
    wanted = render()
    differing = [
        rel for rel, data in wanted.items()
        if not (directory / rel).exists() or (directory / rel).read_bytes() != data
    ]
    present = {str(p.relative_to(directory)) for p in directory.rglob("*.json")}
    return differing + sorted(present - wanted.keys())
