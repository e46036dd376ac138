"""`fleet bench [--quick]`: build the models, run the text and plumbing benchmarks, report.

Full mode: `tiny-llm-bench` (a ~9M-parameter random qwen2, ~10 ms a decode step) and
`smollm2-135m`, both prompt modes, concurrency 1, bursts of 4, 8 and 16 and 8 closed-loop
clients (4 requests each), two interleaved repetitions, 64 new tokens a request; then the
plumbing numbers. Quick mode (CI): `tiny-llm`, one repetition, 16 new tokens, a burst of 4 and
8 clients of 2 requests, small plumbing counts: it proves the code runs and prints numbers;
nothing is asserted about speed. Fleet runs with `--slots` per text runner (0, the default: the
product's own batch width).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import bench
from bench.machine import load_average, machine_info, wait_for_quiet
from bench.report import print_report, stream_failures, targets
from bench.text import TextPlan, run_model
from fleet.config import settings_of
from fleet.models.catalog import get_card
from fleet.models.store import build_once, ensure_model

log = logging.getLogger("bench")

RESULTS_DIR = Path(bench.__file__).parent / "results"
REPO = Path(bench.__file__).resolve().parents[1]
BENCH_TINY = "tiny-llm-bench"  # tiny-llm at the "bench" size: ~10 ms a step on 2 cores
FULL_MODELS = (BENCH_TINY, "smollm2-135m")


def _build_bench_tiny(dest: Path) -> Path:
    from fleet.models.make_tiny import make_tiny_llm

    return make_tiny_llm(dest, seed=0, size="bench")


def model_dir(model_id: str, models_dir: Path) -> tuple[Path, bool]:
    """The model's directory (built on first use) and whether Fleet needs a custom card."""
    if model_id == BENCH_TINY:
        return build_once(BENCH_TINY, models_dir, _build_bench_tiny), True
    return ensure_model(get_card(model_id), models_dir), False


def subprocess_env(blas_threads: int) -> dict[str, str]:
    """The same environment for every process that runs a model, on every path."""
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    env["MLX_DISABLE_COMPILE"] = "1"  # no g++ kernel builds on first use, on any path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def text_plan(args: argparse.Namespace) -> TextPlan:
    """Fleet runs with `--slots` (0: the product default); runs before 2026-12-05 used 16."""
    slots = getattr(args, "slots", 0) or 0
    client_requests = getattr(args, "client_requests", None)
    given = getattr(args, "bursts", None)
    bursts = tuple(int(n) for n in given.split(",") if n) if given else None
    if args.quick:
        return TextPlan(reps=args.reps or 1, c1_requests=2, bursts=bursts or (4,),
                        max_tokens=args.max_tokens or 16, slots=slots,
                        with_peer=not args.no_peer, burst_timeout_s=120.0, clients=(8,),
                        client_requests=client_requests or 2)
    return TextPlan(reps=args.reps or 2, c1_requests=3, bursts=bursts or (4, 8, 16),
                    max_tokens=args.max_tokens or 64, slots=slots, with_peer=not args.no_peer,
                    clients=(8,), client_requests=client_requests or 4)


def run_bench(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    for noisy in ("httpx", "httpcore", "fleet"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # The bench's own NATS clients: connection chatter while stacks start and stop.
    logging.getLogger("fleet.bus.connect").setLevel(logging.CRITICAL)
    settings = settings_of(args)
    env = subprocess_env(args.blas_threads)
    os.environ["MLX_DISABLE_COMPILE"] = "1"
    quiet = wait_for_quiet(args.wait_load, args.wait_max) if args.wait_load > 0 else None
    models = [m for m in (args.models or "").split(",") if m] or (
        ["tiny-llm"] if args.quick else list(FULL_MODELS)
    )
    plan = text_plan(args)
    result: dict[str, Any] = {
        "bench": "fleet",
        "mode": "quick" if args.quick else "full",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(env),
        "load_wait": quiet,
        "plan": {**plan.__dict__, "models": models},
        "text": {},
        "plumbing": None,
    }
    if args.no_peer:
        result["notes"] = ["mlx_lm.server left out (--no-peer)"]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        workdir = Path(tmp)
        try:
            _run_phases(args, result, models, plan, settings.models_dir, workdir, env)
        except BaseException:
            show_logs(workdir)
            raise
        failures = stream_failures(result["text"]) + [
            f"routing {model} {name}: {error}"
            for model, info in result.get("routing", {}).items()
            for name, scenario in info["scenarios"].items() for error in scenario["errors"]
        ] + [
            f"plumbing rate {path}: {row['errors']} stream(s) failed ({row['first_errors'][:1]})"
            for path, row in (result.get("plumbing_rate") or {}).items()
            if isinstance(row, dict) and row.get("errors")
        ] + [
            f"plumbing rate {phase}: {row['error']}"
            for phase, row in (result.get("plumbing_rate") or {}).items()
            if isinstance(row, dict) and isinstance(row.get("error"), str)
        ]
        if failures:
            show_logs(workdir)
    result["machine"]["load_average_end"] = load_average()
    result["elapsed_s"] = round(time.perf_counter() - began, 1)
    result["targets"] = targets(result) if result["text"] else []
    print_report(result)
    if result.get("routing"):
        from bench.routing_report import print_routing

        print_routing(result["routing"])
    for sharded in result.get("sharded", {}).values():
        from bench.sharded import print_sharded

        print_sharded(sharded)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    for failure in failures:
        log.error("failed: %s", failure)
    return 1 if failures else 0


def _run_phases(args: argparse.Namespace, result: dict[str, Any], models: list[str],
                plan: TextPlan, models_dir: Path, workdir: Path, env: dict[str, str]) -> None:
    import uvloop

    if args.only in (None, "text"):
        for model_id in models:
            path, custom = model_dir(model_id, models_dir)
            log.info("text: %s (%s)", model_id, path)
            result["text"][model_id] = uvloop.run(
                run_model(model_id, path, plan, workdir / model_id, env, custom)
            )
    if args.only == "routing" or (args.only is None and args.quick):
        from bench.routing import full_plan, quick_plan, run_routing

        routing_plan = quick_plan() if args.quick else full_plan()
        if args.conversations:
            routing_plan = replace(routing_plan, workload=replace(
                routing_plan.workload, conversations=args.conversations))
        if args.think_s:
            routing_plan = replace(routing_plan, workload=replace(
                routing_plan.workload, think_s=args.think_s))
        if args.no_peer:
            routing_plan = replace(routing_plan, scenarios=tuple(
                s for s in routing_plan.scenarios if s != "peer"))
        result["routing"] = {}
        for model_id in models:
            path, custom = model_dir(model_id, models_dir)
            result["routing"][model_id] = uvloop.run(run_routing(
                model_id, path, custom, routing_plan, workdir / f"routing-{model_id}", env,
            ))
    if args.only == "sharded":
        from bench.sharded import run as run_sharded

        result["sharded"] = {}
        for model_id in models if args.models else (["tiny-llm"] if args.quick
                                                    else ["smollm2-135m"]):
            path, _ = model_dir(model_id, models_dir)
            result["sharded"][model_id] = run_sharded(
                model_id, path, args.quick, env, workdir / f"sharded-{model_id}"
            )
    if args.only == "scale":
        from bench.scale import run_scale

        steps = tuple(int(n) for n in args.scale_steps.split(",")) if args.scale_steps else None
        baseline = Path(args.baseline_src) if args.baseline_src else None
        result["scale"] = run_scale(args.quick, baseline, workdir / "scale", steps)
    if args.only == "seam":
        from bench.seam import CASES, SeamPlan, run_seam, seam_table

        # Kill -> next token at the client: workers and runners killed or paused mid-answer.
        seam_plan = SeamPlan(rounds=args.faults or (2 if args.quick else 20))
        if args.quick:
            seam_plan = replace(seam_plan, max_tokens=40, kill_at=10, pause_s=3.0,
                                load_tasks=2)
        seams = []
        for model_id in models if args.models else ["tiny-llm", "smollm2-135m"]:
            path, _ = model_dir(model_id, models_dir)
            cases = tuple(args.seam_cases.split(",")) if args.seam_cases else CASES
            if args.seam_cases and "false_takeovers" not in cases:  # chosen cases only
                seam_plan = replace(seam_plan, load_tasks=0)
            cases = tuple(c for c in cases if c != "false_takeovers")
            seams.append(uvloop.run(run_seam(model_id, path, seam_plan, workdir, env, cases)))
        result["seam"] = seams
        print("\n".join(seam_table(seams)))
    if args.only in (None, "weights"):
        from bench.weights import run as run_weights

        # Its own nats-server and event loop: publish and fetch MB/s of a model directory.
        result["weights"] = run_weights(
            args.quick, getattr(args, "weights_mb", 540), worker=not args.quick
        )["results"]
    if args.only in (None, "ask"):
        from bench.ask import print_summary, run_ask

        # Request-reply on fleet.ask.<model> against publish-and-watch, on the fault engine.
        result["ask"] = uvloop.run(run_ask(20 if args.quick else 200, 8, workdir / "ask"))
        print_summary(result["ask"])
    if args.only == "queue":
        from bench.queue import CELLS, queue_table, run_queue
        from bench.queue_fair import weight_pairs

        cells = tuple(args.queue_cells.split(",")) if args.queue_cells else CELLS
        if unknown := set(cells) - set(CELLS):
            raise SystemExit(f"--queue-cells: unknown {sorted(unknown)}; known {CELLS}")
        weights = weight_pairs(args.queue_weights) if args.queue_weights else None
        result["queue"] = uvloop.run(run_queue(workdir, env, args.quick, cells,
                                               args.queue_rounds, weights))
        print("\n".join(queue_table(result["queue"])))
    if args.only == "gateway-share":
        from bench.gateway_share import QUICK as SHARE_QUICK
        from bench.gateway_share import SharePlan, run_share, share_table

        share_plan = SHARE_QUICK if args.quick else SharePlan()
        result["gateway_share"] = uvloop.run(run_share(workdir / "gateway-share", share_plan))
        print("\n".join(share_table(result["gateway_share"])))
    if args.only == "embeddings":
        from bench.embeddings import embeddings_table, run_embeddings

        chosen = [m for m in (args.models or "").split(",") if m] or (
            ["tiny-embed"] if args.quick else ["tiny-embed", "smollm2-135m-embed"])
        result["embeddings"] = uvloop.run(run_embeddings(
            models_dir, workdir / "embeddings", env, args.quick, chosen, args.blas_threads))
        print("\n".join(embeddings_table(result["embeddings"])))
    if args.only == "vision":
        from bench.vision import run_vision, vision_table

        result["vision"] = uvloop.run(run_vision(models_dir, workdir / "vision", env,
                                                 args.quick))
        print("\n".join(vision_table(result["vision"])))
    if args.only in (None, "plumbing", "plumbing-rate"):
        from bench.plumbing_rate import QUICK, RatePlan, rate_table, run_rate

        plan_ = QUICK if args.quick else RatePlan()
        if args.plumbing_s:
            plan_ = replace(plan_, duration_s=args.plumbing_s)
        result["plumbing_rate"] = uvloop.run(run_rate(workdir / "rate", env, plan_))
        print("\n".join(rate_table(result["plumbing_rate"])))
    if args.only in (None, "plumbing"):
        from bench.plumbing import run_plumbing

        result["plumbing"] = uvloop.run(run_plumbing(
            models_dir, workdir / "plumbing", env, quick=args.quick,
            with_fresh_worker=not args.quick,
        ))
        if args.quick:
            result.setdefault("notes", []).append(
                "quick mode leaves out the fresh-worker check (a tiny-flux2 runner takes "
                "~10-30 s to start here); the full run has it"
            )


def show_logs(workdir: Path, lines: int = 40) -> None:
    """The tail of every process log of the run (they vanish with its temporary folder), so
    that a failure in CI explains itself."""
    for path in sorted(workdir.rglob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"---- {path.relative_to(workdir)}: last {len(tail)} lines", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
