"""Ports for servers a test starts by hand (cluster routes, HTTP, monitoring).

Not the kernel's pick (`bind(("127.0.0.1", 0))`): that port comes from the ephemeral range,
which the kernel also hands to outgoing connections, so between the pick and the server's bind
another test's client took it (CI: a cluster route "bind: address already in use"). These come
from below that range (Linux: 32768-60999), at random so parallel workers rarely meet, and are
checked free at the pick."""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000  # under net.ipv4.ip_local_port_range's default start


# Ports this process handed out: free at the pick but bound later (a cluster's three routes and
# monitoring ports are all picked before its first server starts), so a second pick must not
# return one. A route's "bind: address already in use" was seen once beside a CPU hog; another
# process picking the same port at random is still possible, if rare (1 in 12,000 a pick).
_handed: set[int] = set()


def free_port() -> int:
    for _ in range(200):
        port = random.randrange(LOW, HIGH)
        if port in _handed:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: pick again
            _handed.add(port)
            return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH} after 200 tries")
