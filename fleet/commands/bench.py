"""`fleet bench`: the benchmarks in bench/ (a folder of the repository, not of the package)."""

from __future__ import annotations

import argparse
import sys


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from bench.cli import run_bench
    except ImportError as exc:
        print(f"fleet bench needs the repository's bench/ folder ({exc}); run it from a "
              "checkout installed with `pip install -e .`", file=sys.stderr)
        return 2
    return run_bench(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark Fleet against in-process mlx-lm and mlx_lm.server",
        description="Prints a table and writes bench/results/<name>-<timestamp>.json.",
    )
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: tiny-llm only, a few requests, seconds")
    p.add_argument("--models", help="comma-separated: tiny-llm-bench, smollm2-135m, tiny-llm "
                   "(default: the first two; --quick: tiny-llm)")
    p.add_argument("--reps", type=int, help="interleaved repetitions (default 2; quick 1)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 64)")
    p.add_argument("--no-peer", action="store_true", help="leave mlx_lm.server out")
    p.add_argument("--slots", type=int,
                   help="text: slots per text runner of Fleet's stack (default 0: the product "
                   "default, the engine's batch width within memory, fleet/batch_width.py)")
    p.add_argument("--bursts", help="text: comma-separated burst sizes (default 4,8,16; "
                   "--quick 4); e.g. 8 for issue 23's cells with c1 and clients8 alone")
    p.add_argument("--client-requests", type=int,
                   help="text: requests each of the 8 closed-loop clients sends, one after "
                   "another (default 4; --quick 2)")
    p.add_argument("--only", choices=("text", "plumbing", "plumbing-rate", "weights", "routing",
                                      "ask", "sharded", "queue", "seam", "embeddings", "scale",
                                      "gateway-share", "vision"),
                   help="run one part only (routing: the multi-turn prefix-routing workload; "
                   "embeddings: /v1/embeddings at 1, 16, 256 clients against the model "
                   "in-process; vision: repeated images, the vision cache off, on and on a "
                   "second node, and the image fetch per MB; "
                   "sharded: a 2-shard pipeline against the unsharded model; plumbing-rate: "
                   "the fault-engine rate part of plumbing alone; queue: batch acceptance "
                   "and idempotent retries; gateway-share: one gateway's CPU per token while 3 "
                   "others carry 10x its tokens; seam: kill -> next token when a worker or runner "
                   "dies or pauses mid-answer)")
    p.add_argument("--scale-steps", help="scale: comma-separated node counts (default "
                   "10,100,1000; --quick 10,40)")
    p.add_argument("--baseline-src", help="scale: a checkout of an earlier design (git worktree "
                   "add DIR COMMIT) measured first, in the same run")
    p.add_argument("--faults", type=int,
                   help="seam: faults per case (default 20; --quick 2)")
    p.add_argument("--seam-cases",
                   help="seam: comma-separated cases (default all: worker_kill, runner_kill, "
                   "worker_pause, worker_kill_cold, false_takeovers, sharded_kill)")
    p.add_argument("--queue-cells",
                   help="queue: comma-separated measures (default all: fair, mixed, retries, "
                   "accept; fair alone runs only measure (2), tenant A at 10x B)")
    p.add_argument("--queue-rounds", type=int,
                   help="queue: rounds of (2) per weight pair, interleaved (default 1)")
    p.add_argument("--queue-weights",
                   help="queue: A:B weight pairs of (2), comma-separated (default 1:1,1:2; "
                   "--quick 1:1)")
    p.add_argument("--plumbing-s", type=float,
                   help="plumbing: seconds of each 64-stream rate run (default 60; --quick 3)")
    p.add_argument("--conversations", type=int,
                   help="routing: conversations of the multi-turn workload (default 16)")
    p.add_argument("--think-s", type=float,
                   help="routing: mean think time between turns, seconds (default 2; a small "
                        "one saturates the machine, to compare capacity)")
    p.add_argument("--weights-mb", type=int, default=540,
                   help="size of the synthetic model the weights part publishes and fetches "
                   "(default 540, SmolLM2-135M's size; --quick: 64)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="OPENBLAS_NUM_THREADS for every model process (default 1)")
    p.add_argument("--wait-load", type=float, default=0.0, metavar="LOAD",
                   help="before measuring, wait (at most --wait-max s) for the 1-minute load "
                   "average to drop below LOAD")
    p.add_argument("--wait-max", type=float, default=900.0)
    p.add_argument("--name", default="bench", help="results file prefix")
    p.set_defaults(func=cmd_bench)
