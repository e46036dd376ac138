"""Model weights on the bus: cards in KV FLEET_MODELS, files in object store FLEET_WEIGHTS.

A card's `manifest` lists the files of its model directory with their sizes and sha256; each
file is one object named by the sha256 hex of its bytes, so equal files (a tokenizer shared by
two models, two revisions sharing shards) are stored once. Objects are read through
fleet.bus.objects, which checks that the recorded digest is the name and that the bytes hash
to it, before a file is renamed into place.

A fetch writes into `<models_dir>/.fetching-<id>/`, a directory with a fixed name, so a
worker that was killed mid-fetch finds the files it finished (each renamed into place only
whole and verified) and fetches only the rest; the directory is renamed to `<models_dir>/<id>`
when every file is there.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.bus.kv_calls import kv_create, kv_delete, kv_get, kv_put
from fleet.bus.kv_read import live_values
from fleet.bus.objects import PARTIAL_SUFFIX, ObjectBucket, sha256_hex
from fleet.bus.retry import with_retry
from fleet.errors import FleetError, ModelNotFound
from fleet.wire.cluster import ModelCard, WeightFile, WeightsManifest
from fleet.wire.codec import DecodeError, decode_model, encode

log = logging.getLogger(__name__)

MODELS_BUCKET = "FLEET_MODELS"
WEIGHTS_BUCKET = "FLEET_WEIGHTS"
FETCH_PREFIX = ".fetching-"
# Files fetched at once over the one connection. Each file is a push consumer that the server
# lets run up to 32 MiB ahead of the reader (its flow-control window), and the server closes a
# connection with more than 64 MiB unread (max_pending) as a slow consumer: with 4 files at
# once on this CPU-starved 2-core machine it did, every try, and the fetch failed. One at a
# time stays under it; the reader is bound by this process's CPU anyway (measured: 2 or 4
# files at once fetched no faster than one file of the same size).
FETCH_PARALLEL = 1
# A chunk of a big file can wait behind other traffic on a busy loopback.
OBJECT_TIMEOUT_S = 30.0

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


# ---- manifests ---------------------------------------------------------------------------


def model_files(model_dir: Path) -> dict[str, Path]:
    """The files of a model directory by relative path; hidden names (staging, locks) are not
    part of a model. Symlinks are followed (a Hugging Face snapshot links into blobs/)."""
    found = {}
    for path in sorted(Path(model_dir).rglob("*")):
        rel = path.relative_to(model_dir)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        found[rel.as_posix()] = path
    return found


def build_manifest(model_dir: Path) -> WeightsManifest:
    """Hash every file (blocking: call it in a thread)."""
    files = [
        WeightFile(path=rel, size=path.stat().st_size, sha256=sha256_hex(path))
        for rel, path in model_files(model_dir).items()
    ]
    revision = hashlib.sha256(
        "\n".join(f"{f.path} {f.sha256}" for f in files).encode()
    ).hexdigest()
    return WeightsManifest(
        files=files, total_bytes=sum(f.size for f in files), revision=revision,
        architecture=_architecture(model_dir),
    )


def _architecture(model_dir: Path) -> str:
    for name, key in (("config.json", "architectures"), ("model_index.json", "_class_name")):
        path = Path(model_dir) / name
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get(key)
            except (ValueError, AttributeError):
                continue
            return value[0] if isinstance(value, list) and value else str(value or "")
    return ""


# ---- the catalogue -----------------------------------------------------------------------


class FleetModels:
    """The fleet's model cards (KV FLEET_MODELS) and their files (FLEET_WEIGHTS)."""

    def __init__(self, nc: Client, js: JetStreamContext | None = None) -> None:
        self.nc = nc
        self.js = js or nc.jetstream()
        self.weights = ObjectBucket(
            nc, WEIGHTS_BUCKET, timeout=OBJECT_TIMEOUT_S, named_by_hash=True
        )
        self._kv: KeyValue | None = None

    async def kv(self) -> KeyValue:
        if self._kv is None:
            self._kv = await with_retry(
                lambda: self.js.key_value(MODELS_BUCKET), what=f"open bucket {MODELS_BUCKET}"
            )
        return self._kv

    async def get(self, model_id: str) -> ModelCard | None:
        entry = await kv_get(await self.kv(), model_id)
        if entry is None or entry.value is None:
            return None
        try:
            return decode_model(ModelCard, entry.value)
        except DecodeError as exc:
            log.warning("ignoring model card %s in %s: %s", model_id, MODELS_BUCKET, exc)
            return None

    async def all(self) -> dict[str, ModelCard]:
        cards = await live_values(self.js, MODELS_BUCKET, ModelCard)
        return {card.id: card for card in sorted(cards, key=lambda card: card.id)}

    async def put(self, card: ModelCard) -> None:
        await kv_put(await self.kv(), card.id, encode(card))

    async def ensure_cards(self, cards: dict[str, ModelCard]) -> None:
        """Write the cards the fleet has no card for yet (the built-in ones at start)."""
        kv = await self.kv()
        for card in cards.values():
            if await kv_get(kv, card.id) is None:
                await kv_create(kv, card.id, encode(card))

    async def publish(
        self, card: ModelCard, model_dir: Path, progress: Progress | None = None
    ) -> ModelCard:
        """Store every file of `model_dir` (each once, by hash) and the card with its manifest."""
        manifest = await asyncio.to_thread(build_manifest, model_dir)
        paths = model_files(model_dir)
        done = 0
        for file in manifest.files:
            if await self.weights.find(file.sha256) is None:
                # The manifest hashed it already: the upload checks that hash as it streams
                # (ObjectCorrupt if the file changed since), so the file is read once more.
                await self.weights.put_by_hash(paths[file.path], sha256=file.sha256)
            done += file.size
            if progress:
                progress(done, manifest.total_bytes)
        size = card.size_bytes or sum(
            f.size for f in manifest.files if f.path.endswith((".safetensors", ".gguf"))
        )
        published = card.model_copy(update={"manifest": manifest, "size_bytes": size})
        await self.put(published)
        log.info("published %s: %d file(s), %d bytes", card.id, len(manifest.files),
                 manifest.total_bytes)
        return published

    async def remove(self, model_id: str) -> list[str]:
        """Delete the card and every file no other card's manifest names; the hashes deleted."""
        cards = await self.all()
        card = cards.pop(model_id, None)
        if card is None:
            raise ModelNotFound(f"no model {model_id!r} in {MODELS_BUCKET}")
        await kv_delete(await self.kv(), model_id)
        used = {
            f.sha256 for other in cards.values() if other.manifest for f in other.manifest.files
        }
        gone = []
        for file in card.manifest.files if card.manifest else []:
            if file.sha256 in used or file.sha256 in gone:
                continue
            await self._delete_object(file.sha256)
            gone.append(file.sha256)
        return gone

    async def _delete_object(self, name: str) -> None:
        """Purge the object's chunks and description (the store keeps no delete marker we need:
        a later publish of the same bytes stores them again)."""
        info = await self.weights.find(name)
        if info is None:
            return
        stream = self.weights.stream
        await with_retry(
            lambda: self.js.purge_stream(stream, subject=self.weights.chunk_subject(info.nuid)),
            what=f"purge chunks of {name}",
        )
        await with_retry(
            lambda: self.js.purge_stream(stream, subject=self.weights.meta_subject(name)),
            what=f"purge description of {name}",
        )

    async def stored_names(self) -> set[str]:
        return {info.name for info in await self.weights.list()}

    # ---- fetching ------------------------------------------------------------------------

    async def fetch(
        self, card: ModelCard, models_dir: Path, progress: Progress | None = None
    ) -> Path:
        """The model's directory under `models_dir`, fetched from FLEET_WEIGHTS if absent."""
        dest = Path(models_dir).absolute() / card.id
        if dest.is_dir():
            return dest
        if card.manifest is None:
            raise ModelNotFound(f"{card.id}: no files published to the fleet")
        staging = dest.with_name(f"{FETCH_PREFIX}{card.id}")
        staging.mkdir(parents=True, exist_ok=True)
        total = card.manifest.total_bytes
        done = [0]
        missing = []
        for file in card.manifest.files:
            target = staging / file.path
            # A file is only ever renamed into place whole and verified: present means done.
            if target.is_file() and target.stat().st_size == file.size:
                done[0] += file.size
            else:
                missing.append(file)
        if progress:
            progress(done[0], total)
        started = time.perf_counter()
        fetched = done[0]

        def advance(size: int) -> None:
            done[0] += size
            if progress:
                progress(done[0], total)

        gate = asyncio.Semaphore(FETCH_PARALLEL)

        async def one(file: WeightFile) -> None:
            async with gate:
                await self._fetch_file(file, staging / file.path, advance)

        try:
            async with asyncio.TaskGroup() as group:
                for file in missing:
                    group.create_task(one(file))
        except ExceptionGroup as failed:
            # The first failure says what went wrong (a corrupt object, a timeout); the
            # others were cancelled by it. Finished files stay for the next try.
            first = failed.exceptions[0]
            while isinstance(first, ExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        elapsed = time.perf_counter() - started
        got = done[0] - fetched
        log.info("fetched %s: %d of %d file(s), %d bytes in %.2f s (%.0f MB/s)", card.id,
                 len(missing), len(card.manifest.files), got, elapsed,
                 got / 1e6 / elapsed if elapsed > 0 else 0.0)
        try:
            os.rename(staging, dest)
        except OSError:
            if not dest.is_dir():  # another fetcher sharing the data dir won the rename
                raise
            shutil.rmtree(staging, ignore_errors=True)
        return dest

    async def _fetch_file(
        self, file: WeightFile, target: Path, advance: Callable[[int], None]
    ) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
        bucket = self.weights

        async def once() -> None:
            counted = 0

            def sink(chunk: bytes) -> None:
                nonlocal counted
                # Inline: a writer thread measured 0.4-0.8 ms more CPU per MB here (GIL
                # hand-offs on a busy 2-core machine) and fetched no faster.
                out.write(chunk)
                counted += len(chunk)
                advance(len(chunk))

            info = await bucket.info(file.sha256)
            try:
                with partial.open("wb") as out:
                    # ObjectBucket._read checks the name against the recorded digest and the
                    # bytes against both; it raises before the rename on a mismatch.
                    await bucket._read(info, sink)
            except BaseException:
                advance(-counted)
                partial.unlink(missing_ok=True)
                raise
            os.replace(partial, target)

        await bucket._retrying(once, f"fetch {file.path} ({file.sha256[:12]})")


FAILURE_CHARS = 300  # a runner record's error: one line in `fleet instances list`


def fetch_failure(model_id: str, exc: BaseException) -> str:
    """Why a fetch failed, as a runner record says it. Pure."""
    detail = exc.message if isinstance(exc, FleetError) else f"{type(exc).__name__}: {exc}"
    text = f"fetching {model_id} from the fleet failed: {detail}"
    return " ".join(text.split())[:FAILURE_CHARS]


def fetch_in_progress(models_dir: Path) -> list[str]:
    """Ids of models whose fetch was interrupted here (resumed on their next placement)."""
    return sorted(
        p.name[len(FETCH_PREFIX):] for p in Path(models_dir).glob(f"{FETCH_PREFIX}*") if p.is_dir()
    )


__all__ = [
    "FETCH_PREFIX", "MODELS_BUCKET", "WEIGHTS_BUCKET", "FleetModels", "build_manifest",
    "fetch_failure", "fetch_in_progress", "model_files",
]
