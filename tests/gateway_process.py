"""`fleet gateway` as a process of its own, for the tests that need one (a SIGKILL mid-job,
its memory, its own OTel exporter, a client that must reach a real HTTP server)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from tests.integration.harness import REPO

if TYPE_CHECKING:
    import openai

LISTENING = re.compile(r"gateway listening on http://([^/\s]+)/v1")


class GatewayProcess:
    """`fleet gateway --port 0` with `env` over this process's environment, in a session of
    its own (a kill takes its children too); its address is read from its own log line, not
    guessed, and its stderr is kept in `data_dir/gateway.log`."""

    def __init__(
        self, nats_url: str, data_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / "gateway.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "gateway", "--port", "0"],
            env={**os.environ, **(env or {}), "FLEET_NATS_URL": nats_url,
                 "FLEET_DATA_DIR": str(data_dir)},
            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )
        self.address = ""  # host:port, once it listens
        self._listening = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        """Keep its stderr flowing into the log file, noting the line that says it listens."""
        assert self.process.stderr
        with self.log_path.open("a") as log:
            for line in self.process.stderr:
                log.write(line)
                log.flush()
                if not self.address and (match := LISTENING.search(line)):
                    self.address = match.group(1)
                    self._listening.set()
        self._listening.set()  # it exited: let the waiter find out

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def wait_listening(self, timeout: float = 60.0) -> str:
        """Its URL (`http://host:port`) once it listens."""
        if not self._listening.wait(timeout) or not self.address:
            raise TimeoutError(f"the gateway did not start: {self.log()}")
        return self.url

    async def listening(self, timeout: float = 60.0) -> str:
        """Its URL (`http://host:port`) once it listens, without blocking the event loop."""
        return await asyncio.to_thread(self.wait_listening, timeout)

    def sdk(self) -> openai.OpenAI:
        import openai  # not at the top: collection imports this module in every xdist worker

        return openai.OpenAI(base_url=f"{self.wait_listening()}/v1", api_key="unused",
                             timeout=60, max_retries=0)

    def rss_mb(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
