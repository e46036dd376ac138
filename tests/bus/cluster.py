"""A 3-node JetStream cluster on loopback for tests: free ports, temporary stores."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from fleet.bus.embedded import EmbeddedNats
from tests.ports import free_port


def cluster_config(name: str, cluster_port: int, route_ports: list[int]) -> str:
    routes = "\n".join(f"    nats-route://127.0.0.1:{port}" for port in route_ports)
    return (
        f"server_name: {name}\n"
        f"cluster {{\n  name: fleet-test\n  listen: 127.0.0.1:{cluster_port}\n"
        f"  routes: [\n{routes}\n  ]\n}}\n"
    )


@contextlib.contextmanager
def nats_cluster(root: Path, size: int = 3) -> Iterator[list[EmbeddedNats]]:
    """`size` clustered nats-servers, each with JetStream; stopped on exit."""
    cluster_ports = [free_port() for _ in range(size)]
    servers = []
    for index in range(size):
        config = root / f"n{index}.conf"
        config.write_text(cluster_config(f"n{index}", cluster_ports[index], cluster_ports))
        servers.append(EmbeddedNats(
            root / f"n{index}", port=free_port(), config=config, log_file=root / f"n{index}.log"
        ))
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()
