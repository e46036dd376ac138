"""The peer: `mlx_lm.server` on the same model directory, started and stopped by the benchmark.

It gets OpenBLAS the only way a process we do not write can: LD_PRELOAD of the same library
`fleet.models.blas` loads. `uses_openblas(pid)` checks that it is mapped; the bench also
records the peer's one-stream decode rate next to the limit's, which shows whether it took
effect (reference BLAS decodes ~3x slower). HF_HOME points at an empty folder with `hub/`
(its /v1/models needs one) so nothing is looked up elsewhere; requests leave `model` out.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.machine import OPENBLAS_PATH, uses_openblas
from bench.procs import free_port, stop_group

READY_TIMEOUT_S = 300.0


class PeerServer:
    def __init__(self, model_dir: Path, env: dict[str, str], workdir: Path) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.port = free_port()
        hf_home = workdir / "hf"
        (hf_home / "hub").mkdir(parents=True, exist_ok=True)
        self.env = {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
        if OPENBLAS_PATH:
            self.env["LD_PRELOAD"] = str(OPENBLAS_PATH)
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self.stop_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        began = time.perf_counter()
        with (self.workdir / "mlx_lm_server.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir),
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"mlx_lm.server exited; see {self.workdir}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"http://127.0.0.1:{self.port}/health")).is_success:
                        self.startup_s = time.perf_counter() - began
                        return
                await asyncio.sleep(0.1)  # polling a process we do not control, bounded
        raise TimeoutError("mlx_lm.server did not answer /health in time")

    @property
    def openblas(self) -> bool:
        return self.process is not None and uses_openblas(self.process.pid)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.stop_s = stop_group(self.process, 3.0)
