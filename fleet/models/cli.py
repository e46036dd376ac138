"""`fleet models …`: list the cards, make the tiny models, add a custom card, convert SmolLM2.

With a NATS URL configured (FLEET_NATS_URL / --nats-url), `add` also publishes the model to
the fleet (its files into FLEET_WEIGHTS, its card into FLEET_MODELS), `list` also shows the
fleet's catalogue and which nodes hold each model, and `remove` deletes a model from the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.config import Settings, settings_of
from fleet.errors import BucketMissing, FleetError, NatsUnavailable
from fleet.models.catalog import add_custom_card, all_cards, custom_cards_dir
from fleet.models.store import can_provide, dir_size, ensure_model, local_model_dir
from fleet.wire.cluster import ModelCard

if TYPE_CHECKING:  # the bus is imported only by the verbs that talk to the fleet
    from fleet.bus.weights import FleetModels

TINY_MODELS = ("tiny-llm", "tiny-embed", "tiny-flux2", "tiny-vlm")
CONVERTIBLE = ("smollm2-135m",)


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="model cards and local weights")
    verbs = models.add_subparsers(dest="models_command", required=True, metavar="VERB")

    verbs.add_parser("list", help="cards, their tasks, and what is on disk").set_defaults(
        func=cmd_list
    )

    make_tiny = verbs.add_parser("make-tiny", help="build the tiny test models into the data dir")
    make_tiny.add_argument("--only", choices=TINY_MODELS, help="build just this one")
    make_tiny.set_defaults(func=cmd_make_tiny)

    add = verbs.add_parser("add", help="add a custom card for a local model directory")
    add.add_argument("--id", required=True, dest="model_id", help="the new model id (a slug)")
    add.add_argument(
        "--path", required=True, help="mlx-lm directory, HF cache entry, or cached repo id"
    )
    add.add_argument(
        "--embeddings", nargs="?", const="mean", choices=("mean", "last"), metavar="POOLING",
        help="serve it as an embedding model (/v1/embeddings): vectors pooled from its last "
        "hidden states, mean (the default) or last token",
    )
    add.add_argument(
        "--no-publish", action="store_true",
        help="only write the card on this machine, even with a NATS URL set",
    )
    add.set_defaults(func=cmd_add)

    remove = verbs.add_parser(
        "remove", help="delete a model from the fleet: its card and the files no other uses"
    )
    remove.add_argument("model_id")
    remove.set_defaults(func=cmd_remove)

    convert = verbs.add_parser("convert", help="convert a bundled GGUF model now")
    convert.add_argument("model_id", choices=CONVERTIBLE)
    convert.set_defaults(func=cmd_convert)


def _settings(args: argparse.Namespace) -> Settings:
    return settings_of(args)  # the connection's credentials too, before or after the verb


def _on_fleet(
    settings: Settings, verb: Callable[[FleetModels], Awaitable[int]],
    connect_timeout: float = 5.0,
) -> int:
    from fleet.bus.connect import connect_with
    from fleet.bus.provision import provision
    from fleet.bus.weights import FleetModels

    async def main() -> int:
        nc = await connect_with(settings, "fleet-models", connect_timeout=connect_timeout)
        try:
            try:
                return await verb(FleetModels(nc))
            except BucketMissing:
                # A NATS no Fleet process has used yet: make its streams and buckets (as
                # every Fleet process does at start), or say who can.
                try:
                    await provision(nc)
                except FleetError as exc:
                    raise FleetError(
                        f"this NATS has no Fleet buckets yet and they could not be made here "
                        f"({exc.message}): start `fleet up` or `fleet worker` against it "
                        "first, or run `fleet nats --provision` as the operator") from None
                return await verb(FleetModels(nc))
        finally:
            await nc.close()

    return asyncio.run(main())


def cmd_list(args: argparse.Namespace) -> int:
    settings = _settings(args)
    rows = []
    for card in all_cards(settings.data_dir).values():
        local = local_model_dir(card, settings.models_dir)
        if local is not None:
            where, size = "yes", human_size(dir_size(local))
        else:
            where = "buildable" if can_provide(card, settings.models_dir) else "no"
            size = f"~{human_size(card.size_bytes)}" if card.size_bytes else "-"
        rows.append([card.id, ",".join(card.tasks), card.family, where, size, card.source])
    print(table(["ID", "TASKS", "FAMILY", "ON DISK", "SIZE", "SOURCE"], rows))
    print(f"\nmodels dir: {settings.models_dir}")
    if settings.nats_url:
        return _on_fleet(settings, _list_fleet)
    # No URL given: the fleet of a `fleet up` running here, if there is one.
    try:
        return _on_fleet(replace(settings, nats_url=settings.url), _list_fleet, 1.0)
    except NatsUnavailable:
        print(f"\nno fleet at {settings.url}: give --nats-url URL (or FLEET_NATS_URL) to list "
              "a fleet's models too")
        return 0


async def _list_fleet(fleet: FleetModels) -> int:
    from fleet.placement import read_nodes

    cards = await fleet.all()
    holders: dict[str, list[str]] = {}
    for node in await read_nodes(fleet.js):
        for model in node.models_on_disk:
            holders.setdefault(model, []).append(node.node_id)
    rows = []
    for card in cards.values():
        manifest = card.manifest
        files = (
            f"{len(manifest.files)} files, {human_size(manifest.total_bytes)}"
            if manifest else "not published"
        )
        nodes = ",".join(holders.get(card.id, [])) or "-"
        rows.append([card.id, ",".join(card.tasks), files, nodes])
    print("\nfleet (FLEET_MODELS):")
    print(table(["ID", "TASKS", "FILES", "ON NODES"], rows))
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    settings = _settings(args)
    cards = all_cards(settings.data_dir)
    for model_id in [args.only] if args.only else TINY_MODELS:
        _provide(cards[model_id], settings.models_dir)
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    settings = _settings(args)
    card = add_custom_card(settings.data_dir, args.model_id, args.path, args.embeddings)
    rows = [
        ["id", card.id],
        ["family", card.family],
        ["tasks", ",".join(card.tasks)],
        ["source", card.source],
        ["layers", str(card.n_layers)],
        ["hidden size", str(card.hidden_size)],
        ["context", str(card.context_length)],
        ["quantization", card.quantization],
        ["capabilities", ",".join(card.capabilities) or "-"],
        ["size", human_size(card.size_bytes)],
    ]
    print(table(["FIELD", "VALUE"], rows))
    if settings.nats_url and not args.no_publish:
        return _on_fleet(settings, lambda fleet: _publish(fleet, card))
    return 0


async def _publish(fleet: FleetModels, card: ModelCard) -> int:
    started = time.perf_counter()
    published = await fleet.publish(card, Path(card.source))
    elapsed = time.perf_counter() - started
    total = published.manifest.total_bytes if published.manifest else 0
    print(f"published {card.id} to the fleet: {human_size(total)} in {elapsed:.1f} s "
          f"({total / 1e6 / max(elapsed, 1e-9):.0f} MB/s)")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    settings = _settings(args)
    (custom_cards_dir(settings.data_dir) / f"{args.model_id}.json").unlink(missing_ok=True)
    if not settings.nats_url:
        print(f"{args.model_id}: local card removed (no NATS URL: the fleet was not asked)")
        return 0

    async def remove(fleet: FleetModels) -> int:
        gone = await fleet.remove(args.model_id)
        print(f"removed {args.model_id} from the fleet; {len(gone)} file(s) no other model uses "
              "deleted")
        return 0

    return _on_fleet(settings, remove)


def cmd_convert(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _provide(all_cards(settings.data_dir)[args.model_id], settings.models_dir)
    return 0


def _provide(card: ModelCard, models_dir: Path) -> None:
    already = local_model_dir(card, models_dir)
    started = time.perf_counter()
    path = ensure_model(card, models_dir)
    if already is not None:
        print(f"{card.id}: already at {path}")
    else:
        elapsed = time.perf_counter() - started
        print(f"{card.id}: built in {elapsed:.1f} s at {path} ({human_size(dir_size(path))})")


def human_size(size_bytes: int) -> str:
    size = float(size_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)
