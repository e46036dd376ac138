"""One stream's decode, taken apart: the limit, the runner alone, and Fleet, in one run (issue 23).

    python -m bench.runner_alone [--model tiny-llm-bench] [--reps 4] [--tokens 256]
                                 [--reader-work-us 0,1500] [--blas-threads 1]

tiny-llm-bench's single stream decodes at ~0.75-0.8x of the in-process limit through Fleet
(a step of ~5 ms), smollm2-135m's at 1.00x (a step of ~30 ms). This run says where the
difference goes. All paths are up at once, one environment for all; each repetition visits
them in a drawn order, one request of `--tokens` tokens each:

- `limit`: plain mlx-lm in a process of its own (bench.limit), nothing around the model;
- `runner` (one a `--reader-work-us` value W): the real runner subprocess (`python -m
  fleet.runner.main`) with the model, driven over its pipe by this process, which reads each
  report as the worker does and then spends W us of CPU on it (a busy loop over a buffer): W
  = 0 is the runner with the cheapest possible reader; a W near the CPU the worker, gateway,
  nats-server and client spend a token together is the runner with that much work beside it,
  none of it Fleet's;
- `fleet_nats`, `fleet_http`: `fleet up` of the model at its defaults, read over NATS and
  over the OpenAI-compatible HTTP API.

Reported per path: the median decode rate (tokens after the first over their time) and its
ratio to the limit's; for the runner paths the runner process's CPU a token and the cores it
used while decoding (psutil, first token to last). JSON to bench/results/runner-alone-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from mlx_lm.tokenizer_utils import load as load_tokenizer

from bench.cli import model_dir, subprocess_env
from bench.fleet_stack import FleetStack, NatsPath, seed_data_dir, text_task
from bench.http_path import OpenAIStreamPath
from bench.limit import LimitPath
from bench.text import Bursts
from bench.workload import Request, StreamResult, make_request
from fleet.config import load_settings
from fleet.models.catalog import get_card
from fleet.wire.framing import FrameReader, FrameWriter
from fleet.wire.pipe import ConnectToGroup, LoadModel, RunnerSpec, Shutdown, SubmitTask, WarmUp

ORDER_SEED = 23  # the path order of each repetition: the same draw every run
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
RESULTS = Path(__file__).parent / "results"
SCRATCH_BYTES = 1 << 18  # what the reader's busy loop copies over and over: memory, not only ALU


@dataclass
class Decode:
    """One stream as a path saw it: its decode rate, and its runner's CPU where measured."""

    tok_s: float
    cpu_ms_per_token: float | None = None
    cores: float | None = None


@dataclass
class PathRuns:
    runs: list[Decode] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        row: dict[str, Any] = {"decode_tok_s": statistics.median(r.tok_s for r in self.runs),
                               "runs": [round(r.tok_s, 1) for r in self.runs]}
        measured = [r for r in self.runs if r.cpu_ms_per_token is not None]
        if measured:
            row["runner_cpu_ms_per_token"] = statistics.median(
                r.cpu_ms_per_token for r in measured if r.cpu_ms_per_token is not None)
            row["runner_cores"] = statistics.median(
                r.cores for r in measured if r.cores is not None)
        return row


def against_limit(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each path's row with `vs_limit`, its decode rate over the limit's (pure)."""
    limit = summary["limit"]["decode_tok_s"]
    return {name: {**row, "vs_limit": row["decode_tok_s"] / limit}
            for name, row in summary.items()}


def decode_of(tokens: int, first_s: float, last_s: float, cpu_s: float | None = None) -> Decode:
    """Tokens after the first over the time from the first to the last; `cpu_s`, the runner's
    CPU over that time, gives its CPU a token and the cores it kept busy (pure)."""
    span = last_s - first_s
    if tokens < 2 or span <= 0:
        raise ValueError(f"no decode to measure: {tokens} tokens over {span:.6f} s")
    if cpu_s is None:
        return Decode((tokens - 1) / span)
    return Decode((tokens - 1) / span, cpu_s / (tokens - 1) * 1e3, cpu_s / span)


class PipeRunner:
    """The runner subprocess alone: its commands written and its reports read over the pipe,
    as the worker does, by a reader that spends `work_s` of CPU on each report."""

    def __init__(self, spec: RunnerSpec, env: dict[str, str], log_path: Path) -> None:
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fleet.runner.main", spec.model_dump_json()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
            )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._writer = FrameWriter(self.process.stdin)
        self._reader = FrameReader(self.process.stdout)
        self._cpu = psutil.Process(self.process.pid)
        self._scratch = bytearray(SCRATCH_BYTES)
        self._source = bytes(SCRATCH_BYTES)
        self._tasks = 0

    def start(self) -> None:
        """Connected, loaded, warmed up: ready for tasks."""
        for command, state in ((ConnectToGroup(), "connected"), (LoadModel(), "loaded"),
                               (WarmUp(), "ready")):
            self._writer.write(command)
            self._until_state(state)

    def _until_state(self, state: str) -> None:
        while True:
            report = self._read()
            status = report.get("status") or {}
            if status.get("state") == state:
                return
            if status.get("state") == "failed":
                raise RuntimeError(f"the runner failed: {status.get('error')}")

    def _read(self) -> dict[str, Any]:
        body = self._reader.read()
        if body is None:
            raise RuntimeError("the runner closed its pipe")
        report: dict[str, Any] = json.loads(body)
        return report

    def stream(self, request: Request, model: str, work_s: float) -> Decode:
        self._tasks += 1
        task = text_task(f"alone-{self._tasks}", model, request)
        self._writer.write(SubmitTask(task=task))
        tokens, first_s, first_cpu = 0, 0.0, 0.0
        while True:
            report = self._read()
            if work_s:
                self._busy(work_s)
            kind = report.get("type")
            if kind == "token":
                if not tokens:
                    first_s, first_cpu = time.perf_counter(), self._cpu_s()
                tokens += len(report.get("token_ids") or [0])
            elif kind == "task_finished":
                return decode_of(tokens, first_s, time.perf_counter(), self._cpu_s() - first_cpu)

    def _busy(self, seconds: float) -> None:
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            self._scratch[:] = self._source

    def _cpu_s(self) -> float:
        times = self._cpu.cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        try:
            self._writer.write(Shutdown())
            self.process.wait(30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


def _fleet_decode(result: StreamResult) -> Decode:
    if result.error or result.first_s is None or result.last_s is None:
        raise RuntimeError(f"a Fleet stream failed: {result.error}")
    return decode_of(result.tokens, result.first_s, result.last_s)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings()
    path, custom = model_dir(args.model, settings.models_dir)
    eos = sorted(load_tokenizer(path).eos_token_ids)
    env = subprocess_env(args.blas_threads)
    work = Path(tempfile.mkdtemp(prefix="runner-alone-"))
    data = work / "fleet-data"
    seed_data_dir(data, {} if custom else {args.model: path}, {args.model: path} if custom else {})
    card = get_card(args.model, data)
    stack = FleetStack(data, [args.model], 0, env)
    limit = LimitPath(path, env, work / "limit.log")
    spec = RunnerSpec(runner_id="alone", instance_id="alone", node_id="bench", card=card,
                      model_path=str(path), images_dir=str(work / "images"))
    runner = PipeRunner(spec, env, work / "runner.log")
    works = [int(w) for w in args.reader_work_us.split(",")]
    runs: dict[str, PathRuns] = {"limit": PathRuns()}
    runs.update({f"runner_w{w}": PathRuns() for w in works})
    runs.update({"fleet_nats": PathRuns(), "fleet_http": PathRuns()})
    try:
        await asyncio.to_thread(runner.start)
        await limit.start()
        nc = await stack.start()
        http = OpenAIStreamPath("fleet_http", stack.base_url, args.model)
        fleet_paths = {"fleet_nats": NatsPath(nc, args.model), "fleet_http": http}
        bursts = Bursts(REQUEST_TIMEOUT_S)
        for fleet_path in fleet_paths.values():  # each path's first request pays its warm-up
            await bursts.run(fleet_path, [make_request("unique", 8, eos)])
        order = random.Random(ORDER_SEED)
        for rep in range(args.reps):
            names = list(runs)
            order.shuffle(names)
            print(f"rep {rep + 1}/{args.reps}: {' '.join(names)}", flush=True)
            for name in names:
                request = make_request("unique", args.tokens, eos)
                if name == "limit":
                    (result,) = await limit.burst([request])
                    decode = _fleet_decode(result)
                elif name.startswith("runner_w"):
                    work_s = int(name.removeprefix("runner_w")) / 1e6
                    decode = await asyncio.to_thread(runner.stream, request, args.model, work_s)
                else:
                    (result,) = await bursts.run(fleet_paths[name], [request])
                    decode = _fleet_decode(result)
                runs[name].runs.append(decode)
        await http.close()
    finally:
        await asyncio.to_thread(runner.stop)
        await limit.stop()
        await stack.stop()
    rows = against_limit({name: path_runs.summary() for name, path_runs in runs.items()})
    return {"model": args.model, "tokens": args.tokens, "reps": args.reps,
            "blas_threads": args.blas_threads, "paths": rows,
            "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def report_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"{result['model']}, {result['tokens']} tokens a stream, {result['reps']} reps "
             f"(decode tok/s, median; vs the limit):"]
    for name, row in result["paths"].items():
        line = f"  {name:14s} {row['decode_tok_s']:7.1f} tok/s  {row['vs_limit']:.2f}x"
        if "runner_cpu_ms_per_token" in row:
            line += (f"  runner {row['runner_cpu_ms_per_token']:.2f} ms CPU a token on "
                     f"{row['runner_cores']:.2f} cores")
        lines.append(line + f"  runs {row['runs']}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llm-bench")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reader-work-us", default="0,1500",
                        help="comma-separated: CPU the pipe's reader spends on each report")
    parser.add_argument("--blas-threads", type=int, default=1)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print("\n".join(report_lines(result)))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"runner-alone-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
