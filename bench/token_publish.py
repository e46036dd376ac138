"""`python -m bench.token_publish`: what confirmed token events cost, against core publishes.

One embedded nats-server with Fleet's streams. Per repetition, both modes, in alternating
order: `core` publishes each TokenChunk with a core publish (the worker before issue 10),
`confirmed` goes through TaskOutput (a JetStream publish per event with a window of pending
acks per task, fleet.bus.confirmed). `streams` tasks emit `tokens` tokens each, interleaved
and paced `pace_ms` apart (a decode step). Reported per mode: delivery p50/p99 (from just before
the publish call to arrival), the publish call's own time p50/p99, and CPU µs per token of
the publishing process. The client (a core subscriber on `fleet.out.>`) runs in a process of
its own, as the gateway does, and records arrivals with the wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.connect import connect, publish
from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import provision
from fleet.wire import subjects
from fleet.wire.events import TaskFinished, TokenChunk
from fleet.worker.outputs import TaskOutput


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _listen(url: str, out: Path) -> None:
    """The client side, in a process of its own (as the gateway is): every token's arrival."""
    nc = await connect(url, "bench-token-listener")
    arrived: dict[str, float] = {}
    finished = asyncio.Event()

    async def on_token(msg: Msg) -> None:
        now = time.time()
        event = json.loads(msg.data)
        if event.get("type") == "token":
            arrived[f"{event['task_id']}/{event['index']}"] = now

    await nc.subscribe("fleet.out.>", cb=on_token)
    async def on_done(_: Msg) -> None:
        finished.set()

    await nc.subscribe("bench.done", cb=on_done)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.wait_for(finished.wait(), 600)
    out.write_text(json.dumps(arrived))
    await nc.close()


async def _one(
    nc: Client, mode: str, rep: int, streams: int, tokens: int, pace_s: float
) -> tuple[dict[str, float], dict[str, float]]:
    output = TaskOutput(nc, nc.jetstream())
    ids = [f"bench-{mode}-{rep}-{s}-{time.time_ns()}" for s in range(streams)]
    sent: dict[str, float] = {}
    call_s: list[float] = []
    cpu0 = time.process_time()
    for index in range(tokens):
        for task_id in ids:
            event = TokenChunk(task_id=task_id, at=time.time(), index=index, token_id=1, text="x")
            start = time.perf_counter()
            sent[f"{task_id}/{index}"] = time.time()
            if mode == "core":
                await publish(nc, subjects.out(task_id), event)
            else:
                await output.chunk(event)
            call_s.append(time.perf_counter() - start)
        await asyncio.sleep(pace_s)  # the pace of a decode step, not a synchronisation
    if mode == "confirmed":  # every token confirmed before the terminal, as a worker ends one
        for task_id in ids:
            await output.finish(TaskFinished(task_id=task_id, at=time.time(), status="completed"))
    await nc.flush()
    cpu = time.process_time() - cpu0
    stats = {
        "call_p50_us": _pct(call_s, 0.5) * 1e6, "call_p99_us": _pct(call_s, 0.99) * 1e6,
        "cpu_us_per_token": cpu / (streams * tokens) * 1e6,
    }
    return sent, stats


async def run(reps: int, streams: int, tokens: int, pace_ms: float) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", port=0) as server:
        out = Path(tmp) / "arrivals.json"
        listener = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.token_publish", "--listen", server.url, str(out),
            stdout=asyncio.subprocess.PIPE,
        )
        assert listener.stdout is not None
        nc = await connect(server.url, "bench-token-publish")
        await provision(nc)
        await asyncio.wait_for(listener.stdout.readline(), 30)
        results: dict[str, list[dict]] = {"core": [], "confirmed": []}
        for rep in range(reps):
            for mode in ("core", "confirmed") if rep % 2 == 0 else ("confirmed", "core"):
                sent, stats = await _one(nc, mode, rep, streams, tokens, pace_ms / 1000)
                results[mode].append({**stats, "sent": sent})
        await nc.publish("bench.done", b"")
        await nc.flush()
        await asyncio.wait_for(listener.wait(), 60)
        arrived = json.loads(out.read_text())
        await nc.close()
    for rows in results.values():
        for row in rows:
            sent = row.pop("sent")
            delivery = [(arrived[key] - at) * 1000 for key, at in sent.items() if key in arrived]
            row["lost"] = len(sent) - len(delivery)
            row["delivery_p50_ms"] = _pct(delivery, 0.5)
            row["delivery_p99_ms"] = _pct(delivery, 0.99)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--pace-ms", type=float, default=2.0)
    parser.add_argument("--listen", nargs=2, metavar=("URL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.listen:
        asyncio.run(_listen(args.listen[0], Path(args.listen[1])))
        return
    results = asyncio.run(run(args.reps, args.streams, args.tokens, args.pace_ms))
    keys = ("delivery_p50_ms", "delivery_p99_ms", "call_p50_us", "call_p99_us",
            "cpu_us_per_token", "lost")
    print("| mode | delivery p50 ms | delivery p99 ms | publish call p50 µs | p99 µs | "
          "publisher CPU µs/token | lost |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, rows in results.items():
        cells = [statistics.median(float(r[key]) for r in rows) for key in keys]
        print(f"| {mode} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"(median over {args.reps} repetitions; {args.streams} streams x {args.tokens} tokens, "
          f"{args.pace_ms} ms apart; the client in a process of its own; load "
          f"{os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
