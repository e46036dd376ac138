"""`fleet bench --only sharded [--models M]`: one model unsharded against the same model as a
2-shard pipeline on this machine (default smollm2-135m; tiny-llm with --quick).

Both run as real runner subprocesses driven over their pipes, as their workers drive them
(no NATS: the broker's share is the same either way and measured elsewhere). One stream at a
time, greedy, end-of-sequence masked so every request decodes `max_tokens`: time to first
token and decode tokens/s from each task's own stats. Then what the ring costs per token: two
processes exchange, `steps` times, exactly what a decode step of the pipeline sends (rank 0's
plan length, its hidden state to rank 1, every rank gathering rank 1's output), with no model
in between: the send/recv time a 2-shard decode step pays on top of its layers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.machine import load_average
from fleet.models.catalog import get_card
from fleet.wire.events import TaskFinished
from fleet.wire.pipe import ConnectToGroup, LoadModel, RunnerSpec, SubmitTask, WarmUp
from fleet.wire.ring import GroupSpec
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.inbox import RunnerExited, RunnerReported
from fleet.worker.node import free_port
from fleet.worker.supervisor import RunnerProcess

WAIT_S = 600.0


class _Owner:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, name: str, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        return task


async def _finished(reports: asyncio.Queue[Any], task_id: str) -> TaskFinished:
    while True:
        item = await asyncio.wait_for(reports.get(), WAIT_S)
        if isinstance(item, RunnerExited):
            raise RuntimeError(f"runner {item.runner_id} {item.how}")
        report = item.report if isinstance(item, RunnerReported) else item
        if isinstance(report, TaskFinished) and report.task_id == task_id:
            return report


async def _ready(reports: asyncio.Queue[Any]) -> None:
    while True:
        item = await asyncio.wait_for(reports.get(), WAIT_S)
        if isinstance(item, RunnerExited):
            raise RuntimeError(f"runner {item.runner_id} {item.how}")
        report = item.report
        if getattr(report, "type", "") == "runner_status":
            if report.status.state == "ready":
                return
            if report.status.state == "failed":
                raise RuntimeError(report.status.error)


async def run_setup(
    model_id: str, path: Path, shards: int, requests: int, max_tokens: int,
    env: dict[str, str], logs: Path,
) -> dict[str, Any]:
    """TTFT and decode speed of one stream on `shards` ranks (1: a plain runner)."""
    card = get_card(model_id)
    ports = [free_port("127.0.0.1") for _ in range(shards)]
    bounds = [round(card.n_layers * r / shards) for r in range(shards + 1)]
    owner = _Owner()
    ranks: list[tuple[RunnerProcess, asyncio.Queue[Any]]] = []
    for rank in range(shards):
        group = None if shards == 1 else GroupSpec(
            rank=rank, start_layer=bounds[rank], end_layer=bounds[rank + 1],
            ring=[f"127.0.0.1:{port}" for port in ports],
        )
        spec = RunnerSpec(
            runner_id=f"bench-{shards}-{rank}", instance_id="bench", node_id=f"rank-{rank}",
            card=card, model_path=str(path), images_dir=str(logs), slots=4, group=group,
        )
        reports: asyncio.Queue[Any] = asyncio.Queue()
        process = RunnerProcess(spec, reports, env=env, log_path=logs / f"{spec.runner_id}.log")
        await process.start(owner)
        ranks.append((process, reports))
    started = time.perf_counter()
    for command in (ConnectToGroup(), LoadModel(), WarmUp()):
        for process, _ in ranks:
            await process.send(command)
    for _, reports in ranks:
        await _ready(reports)
    ready_s = time.perf_counter() - started
    # What each rank holds once ready: its layers (a share), plus what every rank repeats.
    rss_mb = [round(psutil.Process(p.pid).memory_info().rss / 1e6) for p, _ in ranks if p.pid]
    leader, reports = ranks[0]
    eos = _eos_ids(path)
    rows = []
    try:
        for index in range(requests):
            task = TextGeneration(
                task_id=f"bench-{shards}-{index}", model=model_id, max_tokens=max_tokens,
                temperature=0.0, logit_bias={str(t): -100.0 for t in eos},
                messages=[ChatMessage(role="user", content=f"Tell me about harbour {index}.")],
            )
            await leader.send(SubmitTask(task=task))
            done = await _finished(reports, task.task_id)
            stats = done.stats
            rows.append({
                "ttft_s": stats.time_to_first_token_s if stats else None,
                "tokens_per_s": stats.tokens_per_s if stats else None,
                "completion_tokens": done.usage.completion_tokens if done.usage else None,
            })
    finally:
        await asyncio.gather(*(p.stop(timeout=30) for p, _ in ranks), return_exceptions=True)
    return {
        "shards": shards, "ready_s": round(ready_s, 2), "rss_mb": rss_mb, "requests": rows,
        "ttft_s_median": _median(r["ttft_s"] for r in rows),
        "tokens_per_s_median": _median(r["tokens_per_s"] for r in rows),
    }


def _median(values: Any) -> float | None:
    found = [v for v in values if v is not None]
    return round(statistics.median(found), 4) if found else None


def _eos_ids(path: Path) -> list[int]:
    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    return list(eos) if isinstance(eos, list) else [eos] if eos is not None else []


def ring_cost(hidden: int, steps: int, env: dict[str, str]) -> dict[str, Any]:
    """Per decode step, what the ring alone costs two processes (see the module's doc)."""
    ports = [str(free_port("127.0.0.1")) for _ in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.sharded", "--ring-rank", str(rank), "--hidden",
             str(hidden), "--steps", str(steps), "--ports", *ports],
            env=env, stdout=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=WAIT_S)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"ring bench failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0])


def _ring_rank(rank: int, ports: list[str], hidden: int, steps: int) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from fleet.runner.ring import join_ring

    group = GroupSpec(rank=rank, start_layer=0, end_layer=1,
                      ring=[f"127.0.0.1:{port}" for port in ports])
    ring = join_ring(group, lambda reason: print(reason, file=sys.stderr))
    h = mx.ones((1, 1, hidden), dtype=mx.float32)
    times = []
    for _ in range(steps + 10):
        began = time.perf_counter()
        length = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=ring,
                                        stream=generation_stream)
        mx.eval(length)
        x = h
        if rank == 1:
            x = mx.distributed.recv_like(h, 0, group=ring, stream=generation_stream)
        else:
            x = mx.distributed.send(h, 1, group=ring, stream=generation_stream)
        out = mx.distributed.all_gather(x, group=ring, stream=generation_stream)[-1:]
        mx.eval(out)
        times.append(time.perf_counter() - began)
    kept = sorted(times[10:])
    print(json.dumps({
        "hidden": hidden, "steps": steps,
        "per_step_ms_median": round(1000 * statistics.median(kept), 4),
        "per_step_ms_p90": round(1000 * kept[int(0.9 * (len(kept) - 1))], 4),
    }))


def run(model_id: str, path: Path, quick: bool, env: dict[str, str], workdir: Path) -> dict:
    requests, max_tokens = (2, 16) if quick else (3, 48)
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": model_id, "load_average_start": load_average()}
    for shards in (1, 2):
        result[f"shards_{shards}"] = asyncio.run(
            run_setup(model_id, path, shards, requests, max_tokens, env, workdir)
        )
    result["ring"] = ring_cost(get_card(model_id).hidden_size, 50 if quick else 500, env)
    result["load_average_end"] = load_average()
    return result


def print_sharded(result: dict[str, Any]) -> None:
    one, two, ring = result["shards_1"], result["shards_2"], result["ring"]
    print(f"\nsharded ({result['model']}; load {result['load_average_start']} -> "
          f"{result['load_average_end']})")
    print(f"  {'':12} {'TTFT s':>8} {'decode tok/s':>13} {'ready s':>8}  RSS MB per rank")
    for name, row in (("unsharded", one), ("2 shards", two)):
        print(f"  {name:12} {row['ttft_s_median']!s:>8} {row['tokens_per_s_median']!s:>13} "
              f"{row['ready_s']!s:>8}  {row['rss_mb']}")
    print(f"  ring per decode step (hidden {ring['hidden']}): median "
          f"{ring['per_step_ms_median']} ms, p90 {ring['per_step_ms_p90']} ms")


def main() -> None:
    """The ring half of the bench, one rank per process (started by `ring_cost`)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ring-rank", type=int)
    parser.add_argument("--ports", nargs=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    if args.ring_rank is not None:
        _ring_rank(args.ring_rank, args.ports, args.hidden, args.steps)


if __name__ == "__main__":
    main()
