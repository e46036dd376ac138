"""`fleet images put|get|ls`: the image store (FLEET_IMAGES) from the command line.

Images are stored under the sha256 hex of their bytes, the same names tasks carry, so
`fleet images put cat.png` prints the hash to put in a task's input images. An image that fits
one NATS message is uploaded through a worker (`fleet.images.put`, the way a `client` may);
a larger one, or one when no worker answers, is written in chunks, which only the roles that
may write FLEET_IMAGES can (docs/permissions.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from fleet.bus.connect import connect_with
from fleet.bus.objects import ObjectBucket
from fleet.bus.uploads import fits_one_message, upload_image
from fleet.config import load_settings
from fleet.errors import BucketMissing, NatsUnavailable, NotPermitted, ObjectCorrupt
from fleet.wire.subjects import IMAGES_BUCKET


def register(subparsers: argparse._SubParsersAction) -> None:
    images = subparsers.add_parser("images", help="put, get and list images in the image store")
    verbs = images.add_subparsers(dest="images_command", required=True, metavar="VERB")

    put = verbs.add_parser("put", help="upload files by hash; prints one sha256 per file")
    put.add_argument("files", nargs="+", type=Path, metavar="FILE")
    put.set_defaults(func=lambda args: _run(args, _put))

    get = verbs.add_parser("get", help="download an image by its sha256")
    get.add_argument("sha256", metavar="SHA")
    get.add_argument("-o", "--output", type=Path, help="file to write (default: ./SHA)")
    get.set_defaults(func=lambda args: _run(args, _get))

    ls = verbs.add_parser("ls", help="list stored images: sha256, bytes, time stored")
    ls.set_defaults(func=lambda args: _run(args, _ls))


def _run(
    args: argparse.Namespace, verb: Callable[[ObjectBucket, argparse.Namespace], Awaitable[int]]
) -> int:
    settings = load_settings(
        {"nats_url": getattr(args, "nats_url", None), "data_dir": getattr(args, "data_dir", None)}
    )

    async def main() -> int:
        nc = await connect_with(settings, "fleet-images")
        try:
            return await verb(ObjectBucket(nc, IMAGES_BUCKET), args)
        except BucketMissing as exc:
            hint = "`fleet up` or a worker provisions it on first start"
            raise BucketMissing(f"{exc.message}: {hint}") from None
        finally:
            await nc.close()

    return asyncio.run(main())


async def _put(bucket: ObjectBucket, args: argparse.Namespace) -> int:
    for path in args.files:
        if not path.is_file():
            print(f"fleet: {path}: no such file", file=sys.stderr)
            return 1
    for path in args.files:
        print(await _stored(bucket, path), flush=True)
    return 0


async def _stored(bucket: ObjectBucket, path: Path) -> str:
    if fits_one_message(bucket.nc, path.stat().st_size):
        try:
            return (await upload_image(bucket.nc, path)).sha256
        except (NatsUnavailable, NotPermitted) as exc:
            print(f"fleet: {exc.message}; writing {path} to {bucket.bucket} itself",
                  file=sys.stderr)
    return await bucket.put_by_hash(path)


async def _get(bucket: ObjectBucket, args: argparse.Namespace) -> int:
    output: Path = args.output or Path(args.sha256)
    info = await bucket.get_to_file(args.sha256, output)
    if info.sha256.hex() != args.sha256:
        output.unlink(missing_ok=True)
        raise ObjectCorrupt(f"image {args.sha256} holds bytes whose sha256 is {info.sha256.hex()}")
    print(f"{output}: {info.size} bytes", file=sys.stderr)
    return 0


async def _ls(bucket: ObjectBucket, args: argparse.Namespace) -> int:
    for info in await bucket.list():
        print(f"{info.name}  {info.size:>12}  {info.mtime}")
    return 0
