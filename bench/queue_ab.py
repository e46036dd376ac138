"""Queue A/B: measures (2) and (1) of `fleet bench --only queue` for two checkouts, arms
interleaved (issue 25).

    python -m bench.queue_ab BASE_CHECKOUT NEW_CHECKOUT [--order base,new,new,base]
                             [--weights 1:1,1:2] [--rounds N] [--mixed] [--out FILE]

On a shared machine one run of each commit, one after the other, moved more than a change
did (B's TTFT alone swung 79-617 ms between arms of one session). Here each arm is a fresh
`fleet up` of the fault engine (16 slots) started from its checkout (a `git worktree add` of
the base commit, say), measured at full size by the bench's own code (bench.queue_fair
`measure_fair` per weight pair; with `--mixed`, bench.queue `measure_mixed`), and the arms
alternate, so that a change of load falls on both: compare medians over the arms. An arm
that fails (a 503 under heavy load) is recorded as failed and the others go on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.fleet_stack import FleetStack
from bench.plumbing_rate import MODEL, seed_fault_card
from bench.queue import SLOTS, QueuePlan, measure_mixed
from bench.queue_fair import (
    HIGH_RATIO,
    FairPlan,
    cells_of,
    measure_fair,
    weight_pairs,
    write_keys,
)
from fleet.gateway.keys import add_key


async def arm(checkout: Path, plan: FairPlan, mixed: bool) -> dict[str, Any]:
    """One `fleet up` from `checkout`, measured and stopped."""
    data_dir = Path(tempfile.mkdtemp(prefix="queue-ab-")) / "fleet-data"
    data_dir.mkdir(parents=True)
    seed_fault_card(data_dir)
    keys_file = data_dir / "keys.jsonl"
    key = add_key(keys_file, "bench")
    fair_keys = write_keys(keys_file, plan)
    env = dict(os.environ, PYTHONPATH=str(checkout), MLX_DISABLE_COMPILE="1",
               OPENBLAS_NUM_THREADS="1", FLEET_API_KEYS_FILE=str(keys_file))
    stack = FleetStack(data_dir, [MODEL], SLOTS, env, api_key=key, cwd=checkout)
    out: dict[str, Any] = {"load_start": round(os.getloadavg()[0], 2)}
    await stack.start()
    try:
        out["fair"] = [await measure_fair(stack.base_url, fair_keys, run, SLOTS, plan,
                                          stack.nc) for run in range(len(cells_of(plan)))]
        if mixed:
            out["mixed"] = await measure_mixed(stack.base_url, key, QueuePlan(), stack.nc)
    finally:
        await stack.stop()
        shutil.rmtree(data_dir.parent, ignore_errors=True)  # its NATS store: a few MB an arm
    out["load_end"] = round(os.getloadavg()[0], 2)
    return out


def medians(arms: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Medians over one checkout's arms that finished, every round of each (pure): per
    weight pair, B's share, tok/s, B's TTFT ratio (with its least and most) and B's queue
    stage beside A less alone."""
    done = [a for a in arms if a["name"] == name and "fair" in a]
    summary: dict[str, Any] = {"arms": len(done)}
    pairs: dict[str, list[dict[str, Any]]] = {}
    for r in (r for a in done for r in a["fair"]):
        pairs.setdefault(f"{r['weight_a']:g}:{r['weight_b']:g}", []).append(r)
    for pair, runs in pairs.items():
        queue = [r["stages_b_beside_a_p50_ms"]["queue"] - r["stages_b_alone_p50_ms"]["queue"]
                 for r in runs if r["stages_b_beside_a_p50_ms"]["queue"] is not None
                 and r["stages_b_alone_p50_ms"]["queue"] is not None]
        ratios = [r["ttft_ratio"] for r in runs if r["ttft_ratio"] is not None]
        summary[pair] = {
            "runs": len(runs),
            "share_b": round(statistics.median(r["share_b"] for r in runs), 3),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            "ttft_ratio": round(statistics.median(ratios), 2) if ratios else None,
            "ttft_ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "ttft_met": sum(x <= HIGH_RATIO for x in ratios),
            "queue_stage_extra_ms": round(statistics.median(queue), 1) if queue else None,
        }
    return summary


async def run(checkouts: dict[str, Path], order: list[str], plan: FairPlan,
              mixed: bool) -> dict[str, Any]:
    arms: list[dict[str, Any]] = []
    for name in order:
        try:
            result = await arm(checkouts[name], plan, mixed)
        except Exception as exc:  # recorded; the other arms still compare
            result = {"failed": f"{type(exc).__name__}: {exc}"}
        arms.append({"name": name, "checkout": str(checkouts[name]), **result})
        print(json.dumps(arms[-1]), flush=True)
    return {"arms": arms, "medians": {name: medians(arms, name) for name in checkouts}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="checkout of the base (a git worktree)")
    parser.add_argument("new", type=Path, help="checkout of the change")
    parser.add_argument("--order", default="base,new,new,base", help="the arms, in turn")
    parser.add_argument("--weights", default="1:1,1:2", help="A:B weight pairs of (2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of (2) per weight pair in each arm")
    parser.add_argument("--mixed", action="store_true", help="measure (1) in each arm too")
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    args = parser.parse_args()
    checkouts = {"base": args.base.resolve(), "new": args.new.resolve()}
    plan = FairPlan(weights=weight_pairs(args.weights), rounds=args.rounds)
    result = asyncio.run(run(checkouts, args.order.split(","), plan, args.mixed))
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps(result["medians"], indent=1))


if __name__ == "__main__":
    main()
