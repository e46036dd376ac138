"""Object store throughput: nats-py's stock ObjectStore against Fleet's reader and writer.

A fresh embedded nats-server with a temporary store; random bytes of 1, 8 and 32 MB, each
object new (objects are never re-put). Both readers read the same object, which Fleet's writer
stored; the stock writer uses its defaults (128 KiB chunks, one ack awaited per chunk).
Cells are the median MB/s (10^6 bytes per second) over the repeats; a stock get that does
not finish within STOCK_GET_TIMEOUT_S counts as 0.

    python -m bench.objects [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import nats

from fleet.bus.embedded import EmbeddedNats
from fleet.bus.objects import ObjectBucket

SIZES_MB = (1, 8, 32)
STOCK_GET_TIMEOUT_S = 60.0
BUCKET = "BENCH_IMAGES"
COLUMNS = ("stock_put", "fleet_put", "stock_get", "fleet_get", "fleet_get_to_file")
RESULTS_DIR = Path(__file__).parent / "results"


async def _mb_per_s(size: int, work: Awaitable[Any], timeout: float | None = None) -> float:
    start = time.perf_counter()
    try:
        await asyncio.wait_for(work, timeout)
    except TimeoutError:
        return 0.0
    return size / 1e6 / (time.perf_counter() - start)


async def _one_round(
    nc: nats.NATS, workdir: Path, size: int, round_no: int
) -> dict[str, float]:
    stock = await nc.jetstream().object_store(BUCKET)
    fleet = ObjectBucket(nc, BUCKET, timeout=10.0)
    data = os.urandom(size)
    name = f"{size}-{round_no}"
    speeds = {
        "stock_put": await _mb_per_s(size, stock.put(f"stock-{name}", data)),
        "fleet_put": await _mb_per_s(size, fleet.put(f"fleet-{name}", data)),
        "fleet_get": await _mb_per_s(size, fleet.get(f"fleet-{name}")),
        "fleet_get_to_file": await _mb_per_s(
            size, fleet.get_to_file(f"fleet-{name}", workdir / name)
        ),
        "stock_get": await _mb_per_s(
            size, stock.get(f"fleet-{name}"), timeout=STOCK_GET_TIMEOUT_S
        ),
    }
    (workdir / name).unlink()
    return speeds


async def _measure(repeats: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-objects-") as tmp:
        workdir = Path(tmp)
        with EmbeddedNats(workdir / "nats", port=0) as server:
            nc = await nats.connect(server.url)
            try:
                await nc.jetstream().create_object_store(BUCKET)
                table: dict[str, dict[str, float]] = {}
                for size_mb in SIZES_MB:
                    size = size_mb * 1024 * 1024
                    rounds = [await _one_round(nc, workdir, size, n) for n in range(repeats)]
                    table[f"{size_mb}MiB"] = {
                        column: round(statistics.median(r[column] for r in rounds), 1)
                        for column in COLUMNS
                    }
                return table
            finally:
                await nc.close()


def _print_table(table: dict[str, dict[str, float]]) -> None:
    print(f"{'size':>6}  " + "  ".join(f"{column:>17}" for column in COLUMNS) + "   (MB/s)")
    for size, row in table.items():
        print(f"{size:>6}  " + "  ".join(f"{row[column]:>17.1f}" for column in COLUMNS))


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, print a table, write bench/results/objects-<timestamp>.json, return the dict."""
    repeats = 1 if quick else 3
    table = asyncio.run(_measure(repeats))
    _print_table(table)
    result = {
        "bench": "objects",
        "unit": "MB/s",
        "repeats": repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": table,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS_DIR / f"objects-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round per size, not three")
    run(parser.parse_args().quick)
