"""`python -m bench.ask`: what an answer by request-reply costs, against publish-and-watch.

`fleet up` serves the fault-injection engine (a plumbing double: its tokens cost nothing, so
what is measured is Fleet's path, not a model). Per round, in alternating order:

- `ask`: `nc.request("fleet.ask.fault-llm", task)` until the reply (the AskAnswer): what a
  `nats req` user waits;
- `publish`: a core subscription to `fleet.out.<id>`, the task published with an awaited
  JetStream ack, until its `task_finished` arrives: what a `nats pub` + `nats sub` user waits.

The ask adds a hop to the answering worker, its publish, and reading the task's events back
from FLEET_OUT. Also timed: one TaskRecord write (a KV put with a TTL in FLEET_TENANTS), which a
gateway now makes before every task. Prints p50/p95 and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.cli import RESULTS_DIR, subprocess_env
from bench.fleet_stack import FleetStack
from bench.machine import load_average
from fleet.bus.connect import js_publish
from fleet.gateway.owners import TASK_TTL_S, subject_of, task_key
from fleet.models.catalog import custom_cards_dir
from fleet.runner.fault_engine import fault_card
from fleet.wire import subjects
from fleet.wire.ask import AskAnswer
from fleet.wire.codec import ASK_REPLY, decode_event, decode_with, encode
from fleet.wire.events import TaskFinished
from fleet.wire.records import TaskRecord
from fleet.wire.tasks import ChatMessage, TextGeneration

MODEL = "fault-llm"


def task(task_id: str, tokens: int) -> TextGeneration:
    return TextGeneration(task_id=task_id, model=MODEL, max_tokens=tokens,
                          messages=[ChatMessage(role="user", content=f"tokens:{tokens}")])


async def asked(nc: Client, tokens: int) -> float:
    began = time.perf_counter()
    reply = await nc.request(subjects.ask(MODEL), encode(task(_id("ask"), tokens)), timeout=60)
    took = time.perf_counter() - began
    answer = decode_with(ASK_REPLY, reply.data)
    assert isinstance(answer, AskAnswer) and answer.status == "completed", answer
    return took


async def published(nc: Client, tokens: int) -> float:
    task_id = _id("pub")
    done = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        if isinstance(decode_event(msg.data), TaskFinished):
            done.set()

    began = time.perf_counter()
    watch = await nc.subscribe(subjects.out(task_id), cb=on_event)
    await js_publish(nc.jetstream(), subjects.tasks(MODEL), task(task_id, tokens),
                     msg_id=task_id)
    await asyncio.wait_for(done.wait(), 60)
    took = time.perf_counter() - began
    await watch.unsubscribe()
    return took


async def record_written(nc: Client) -> float:
    record = encode(TaskRecord(api="chat.completions", model=MODEL, created=int(time.time())))
    began = time.perf_counter()
    await nc.jetstream().publish(subject_of(task_key(_id("rec"))), record,
                                 headers={"Nats-TTL": f"{TASK_TTL_S}s"})
    return time.perf_counter() - began


def _id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 3),
    }


async def run_ask(rounds: int, tokens: int, data_dir: Path) -> dict[str, object]:
    folder = custom_cards_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)  # data_dir too, when a caller names a new one
    card = fault_card(MODEL).model_copy(update={"source": str(data_dir)})
    (folder / f"{MODEL}.json").write_bytes(encode(card))
    stack = FleetStack(data_dir, [MODEL], slots=4, env=subprocess_env(1))
    nc = await stack.start()
    try:
        for _ in range(5):  # warm both paths: first consumer fetches, first subscriptions
            await asked(nc, tokens)
            await published(nc, tokens)
        load_before = load_average()
        times: dict[str, list[float]] = {"ask": [], "publish": [], "record": []}
        for index in range(rounds):
            pair = (("ask", asked), ("publish", published))
            for name, path in pair if index % 2 == 0 else reversed(pair):
                times[name].append(await path(nc, tokens))
            times["record"].append(await record_written(nc))
        return {
            "bench": "ask", "rounds": rounds, "tokens": tokens, "model": MODEL,
            "load_average_before": load_before, "load_average_after": load_average(),
            **{name: summary(values) for name, values in times.items()},
        }
    finally:
        await stack.stop()


def print_summary(result: dict[str, object]) -> None:
    print(f"ask vs publish-and-watch, {result['tokens']} tokens of {MODEL}:")
    for name in ("ask", "publish", "record"):
        row = result[name]
        assert isinstance(row, dict)
        print(f"  {name:8} p50 {row['p50_ms']:8.2f} ms  p95 {row['p95_ms']:8.2f} ms  "
              f"mean {row['mean_ms']:8.2f} ms  (n={row['n']})")
    print(f"  load average before {result['load_average_before']}, "
          f"after {result['load_average_after']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, help="JSON file (default: bench/results/ask-*.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-ask-") as scratch:
        result = asyncio.run(run_ask(args.rounds, args.tokens, Path(scratch)))
    print_summary(result)
    out = args.out or RESULTS_DIR / f"ask-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
