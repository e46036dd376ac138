"""Burst A/B in one run: two checkouts' `fleet up` and mlx_lm.server, side by side (issue 23).

    python -m bench.burst_ab BASE_CHECKOUT NEW_CHECKOUT [--reps 6] [--burst 8]
                             [--mode shared] [--tokens 64] [--model smollm2-135m]
                             [--blas-threads 1]

The text bench's burst cells are one burst per path and repetition, minutes apart, so a
runner change that moves a cell by a few per cent is lost in how the machine moved between
runs (burst8 shared read 0.98x and 1.00x of the peer's aggregate on the same code). Here the
peer and both checkouts (each a `fleet up` of the model at its default slots, started from
its own checkout: a `git worktree add` of the base commit, say) run at once, and each
repetition visits the five paths (the peer; each side over HTTP and over NATS) in a drawn
order: two single requests, then a burst, as the text bench runs a burst cell after its c1
cells (a runner's last busy spell shapes how it reads the next burst). Reported per path:
TTFT p50 over the bursts' streams, the median burst aggregate (tokens over first start to
last token), the single requests' TTFT p50, each against the peer's; and every burst's first
tokens, for a second look. JSON to bench/results/burst-ab-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

from bench.cli import model_dir, subprocess_env
from bench.fleet_stack import FleetStack, NatsPath, seed_data_dir
from bench.http_path import OpenAIStreamPath
from bench.peer import PeerServer
from bench.text import BenchPath, Bursts
from bench.workload import StreamResult, aggregate_tok_s, make_request
from fleet.config import load_settings

ORDER_SEED = 23  # the path order of each repetition: the same draw every run
SINGLES = 2  # single requests before each burst
BURST_TIMEOUT_S = 600.0
RESULTS = Path(__file__).parent / "results"


@dataclass
class PathSamples:
    burst_ttft_s: list[float] = field(default_factory=list)
    aggregates: list[float] = field(default_factory=list)
    single_ttft_s: list[float] = field(default_factory=list)
    bursts: list[list[float]] = field(default_factory=list)  # each burst's first tokens, sorted

    def summary(self) -> dict[str, Any]:
        return {"ttft_p50_s": statistics.median(self.burst_ttft_s),
                "aggregate_tok_s": statistics.median(self.aggregates),
                "single_ttft_p50_s": statistics.median(self.single_ttft_s),
                "bursts": self.bursts}


def against_peer(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each path's row with `vs_peer`: its TTFTs and aggregate over the peer's (pure)."""
    peer = summary["peer"]
    return {name: {**row, "vs_peer": {
        "ttft_p50": row["ttft_p50_s"] / peer["ttft_p50_s"],
        "aggregate": row["aggregate_tok_s"] / peer["aggregate_tok_s"],
        "single_ttft_p50": row["single_ttft_p50_s"] / peer["single_ttft_p50_s"],
    }} for name, row in summary.items()}


def _ttfts(results: list[StreamResult]) -> list[float]:
    return sorted(r.ttft_s for r in results if r.ttft_s is not None)


async def _start_side(name: str, checkout: Path, model: str, path: Path, custom: bool,
                      env: dict[str, str]) -> tuple[FleetStack, list[BenchPath]]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"burst-ab-{name}-")) / "fleet-data"
    seed_data_dir(data_dir, {} if custom else {model: path}, {model: path} if custom else {})
    stack = FleetStack(data_dir, [model], 0, {**env, "PYTHONPATH": str(checkout)}, cwd=checkout)
    nc = await stack.start()
    over_nats = NatsPath(nc, model)
    over_nats.name = f"{name}_nats"  # each side's own, not the class's `fleet_nats`
    return stack, [OpenAIStreamPath(f"{name}_http", stack.base_url, model), over_nats]


async def run(base: Path, new: Path, model: str, reps: int, burst: int, mode: str,
              tokens: int, blas_threads: int) -> dict[str, Any]:
    path, custom = model_dir(model, load_settings().models_dir)
    # Answers of the full length: the end-of-sequence tokens biased away, as the text bench does.
    eos = sorted(load_tokenizer(path).eos_token_ids)
    workdir = Path(tempfile.mkdtemp(prefix="burst-ab-peer-"))
    # One environment for every process that runs the model, as the text bench has it: the
    # BLAS threads differing between the peer and Fleet moved the aggregate by 15 % in a trial.
    env = subprocess_env(blas_threads)
    peer = PeerServer(path, env, workdir)
    stacks: list[FleetStack] = []
    paths: list[BenchPath] = []
    try:
        started = await asyncio.gather(
            peer.start(), _start_side("base", base, model, path, custom, env),
            _start_side("new", new, model, path, custom, env))
        paths.append(OpenAIStreamPath("peer", peer.base_url, None))
        for stack, side_paths in started[1:]:
            stacks.append(stack)
            paths += side_paths
        bursts = Bursts(BURST_TIMEOUT_S)
        for bench_path in paths:  # first calls paid before anything is timed
            await bursts.run(bench_path, [make_request("unique", 4, eos)])
            await bursts.run(bench_path, [make_request("unique", 4, eos) for _ in range(2)])
        samples = {p.name: PathSamples() for p in paths}
        order = random.Random(ORDER_SEED)
        for rep in range(reps):
            for bench_path in order.sample(paths, len(paths)):
                got = samples[bench_path.name]
                for _ in range(SINGLES):
                    got.single_ttft_s += _ttfts(
                        await bursts.run(bench_path, [make_request(mode, tokens, eos)]))
                results = await bursts.run(bench_path,
                                           [make_request(mode, tokens, eos) for _ in range(burst)])
                firsts = _ttfts(results)
                got.burst_ttft_s += firsts
                got.bursts.append([round(t, 3) for t in firsts])
                if (aggregate := aggregate_tok_s(results)) is not None:
                    got.aggregates.append(aggregate)
                print(f"rep {rep} {bench_path.name:10} first tokens {[round(t, 2) for t in firsts]}"
                      f" aggregate {aggregate or 0:.2f} tok/s", flush=True)
        summary = against_peer({name: s.summary() for name, s in samples.items()})
        return {"model": model, "mode": mode, "burst": burst, "tokens": tokens, "reps": reps,
                "base": str(base), "new": str(new), "blas_threads": blas_threads,
                "load_average": os.getloadavg(),
                "paths": summary, "broken_paths": bursts.broken}
    finally:
        for bench_path in paths:
            if isinstance(bench_path, OpenAIStreamPath):
                await bench_path.close()
        await asyncio.gather(*(stack.stop() for stack in stacks), asyncio.to_thread(peer.stop))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="checkout of the base (a git worktree)")
    parser.add_argument("new", type=Path, help="checkout of the change")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--reps", type=int, default=6, help="bursts per path")
    parser.add_argument("--burst", type=int, default=8, help="requests a burst")
    parser.add_argument("--mode", choices=("shared", "unique"), default="shared",
                        help="one cached system prompt for all, or one each")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens a request")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OPENBLAS_NUM_THREADS for every path (the text bench's default)")
    args = parser.parse_args()
    result = asyncio.run(run(args.base.resolve(), args.new.resolve(), args.model, args.reps,
                             args.burst, args.mode, args.tokens, args.blas_threads))
    for name, row in result["paths"].items():
        ratios = ", ".join(f"{k} {v:.3f}x" for k, v in row["vs_peer"].items())
        print(f"{name:10} TTFT p50 {row['ttft_p50_s']:.3f} s, aggregate "
              f"{row['aggregate_tok_s']:.2f} tok/s, single TTFT p50 "
              f"{row['single_ttft_p50_s']:.3f} s; vs the peer: {ratios}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"burst-ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
