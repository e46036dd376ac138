"""Shared fixtures: a real nats-server per test on a free port with a temporary store."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.bus.embedded import EmbeddedNats

# Kernel compilation on the CPU shells out to g++ (+20 s on a fresh machine); small models
# gain nothing from it. Two cores: one BLAS thread per process.
os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "nats", port=0, log_file=tmp_path / "nats.log")
    with server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url
