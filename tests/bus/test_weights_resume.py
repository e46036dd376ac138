"""A fetch killed by SIGKILL resumes without fetching again the files it had finished: a
real child process fetching from a real nats-server, killed mid-fetch."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from nats.aio.client import Client

from fleet.bus.weights import FETCH_PREFIX, FleetModels
from fleet.models.catalog import describe_model_dir

FILE_MB = 8
FILES = 6

# One file at a time, and the child stops itself (SIGSTOP) once it is into its third file, so
# the kill lands at a known point whatever the machine's speed: two files whole, one partial.
CHILD = """
import asyncio, os, signal, sys
from pathlib import Path
import nats
from fleet.bus import weights

async def main():
    nc = await nats.connect(sys.argv[1])
    weights.FETCH_PARALLEL = 1
    fleet = weights.FleetModels(nc)
    card = await fleet.get("resumable")
    first_two = sum(f.size for f in card.manifest.files[:2])
    def progress(done, total):
        if done > first_two:
            print(done, total, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
    await fleet.fetch(card, Path(sys.argv[2]), progress)

asyncio.run(main())
"""


def _model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    for n in range(FILES):
        (folder / f"model-{n:05d}.safetensors").write_bytes(os.urandom(FILE_MB * 1_000_000))
    return folder


async def test_a_fetch_killed_mid_way_resumes_without_refetching_finished_files(
    provisioned_nc: Client, nats_url: str, tmp_path: Path
) -> None:
    fleet = FleetModels(provisioned_nc)
    source = _model(tmp_path / "source")
    card = await fleet.publish(describe_model_dir("resumable", source), source)
    assert card.manifest is not None
    models = tmp_path / "node" / "models"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, nats_url, str(models), stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    staging = models / f"{FETCH_PREFIX}resumable"
    async with asyncio.timeout(60):
        line = await child.stdout.readline()  # written just before it stopped itself
    assert line, "the fetch ended before it could be killed"
    child.send_signal(signal.SIGKILL)
    await child.wait()
    kept = {p.name: p.stat().st_ino for p in staging.glob("*") if not p.name.startswith(".")}
    assert sorted(kept) == ["config.json", "model-00000.safetensors"]
    assert list(staging.glob(".*.part"))  # the third file, partial, never renamed

    seen: list[int] = []
    path = await fleet.fetch(card, models, lambda done, total: seen.append(done))
    sizes = {f.path: f.size for f in card.manifest.files}
    assert seen[0] == sum(sizes[name] for name in kept)  # counted as done, not fetched
    for name, inode in kept.items():
        assert (path / name).stat().st_ino == inode  # the very file written before the kill
    for name in sizes:
        assert (path / name).read_bytes() == (source / name).read_bytes()
