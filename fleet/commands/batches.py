"""`fleet batches list` and `fleet batches show ID`: batch jobs and their progress, read from
KV FLEET_BATCHES (every gateway writes there), so they need no gateway, only NATS (the
operator's or the gateway's credentials under auth)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from fleet.bus.batch_store import BatchStore
from fleet.bus.connect import connect_with
from fleet.config import settings_of
from fleet.errors import FleetError
from fleet.gateway.batch_lines import openai_batch
from fleet.wire.batches import BatchRecord


def progress_line(record: BatchRecord, now: float) -> str:
    """One line a job: id, status, done of total with failures, endpoint, age, tenant."""
    counts = record.request_counts
    done = counts.completed + counts.failed
    share = f"{100 * done / counts.total:5.1f}%" if counts.total else "    -"
    age = _age(now - record.created_at)
    return (f"{record.id:40} {record.status:11} {done:>7,}/{counts.total:<7,} {share} "
            f"failed {counts.failed:<6,} {record.endpoint:24} {age:>6} {record.tenant or '-'}")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


async def _records(args: argparse.Namespace) -> list[BatchRecord]:
    nc = await connect_with(settings_of(args), "fleet-cli")
    try:
        return await BatchStore(lambda: nc).batches()
    finally:
        await nc.close()


def cmd_list(args: argparse.Namespace) -> int:
    records = sorted(asyncio.run(_records(args)), key=lambda r: r.created_at, reverse=True)
    if args.active:
        records = [r for r in records if r.status in ("validating", "in_progress",
                                                        "finalizing", "cancelling")]
    if args.json:
        print(json.dumps([openai_batch(r) for r in records], indent=2))
        return 0
    if not records:
        print("no batch jobs")
        return 0
    now = time.time()
    print(f"{'id':40} {'status':11} {'done/total':>15}        {'failures':13} "
          f"{'endpoint':24} {'age':>6} tenant")
    for record in records:
        print(progress_line(record, now))
    return 0


async def _one(args: argparse.Namespace) -> BatchRecord | None:
    nc = await connect_with(settings_of(args), "fleet-cli")
    try:
        found = await BatchStore(lambda: nc).batch(args.batch_id)
    finally:
        await nc.close()
    return found[0] if found else None


def cmd_show(args: argparse.Namespace) -> int:
    record = asyncio.run(_one(args))
    if record is None:
        raise FleetError(f"no batch {args.batch_id} is known")
    body: dict[str, Any] = openai_batch(record)
    body["tenant"] = record.tenant
    print(json.dumps(body, indent=2))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("batches", help="batch jobs (/v1/batches) and their progress")
    verbs = parser.add_subparsers(dest="batches_command", required=True)
    listing = verbs.add_parser("list", help="every job, newest first, with its progress")
    listing.add_argument("--active", action="store_true", help="only jobs not done yet")
    listing.add_argument("--json", action="store_true", help="the Batch objects as JSON")
    listing.set_defaults(func=cmd_list)
    show = verbs.add_parser("show", help="one job as the API reports it, and its tenant")
    show.add_argument("batch_id")
    show.set_defaults(func=cmd_show)
