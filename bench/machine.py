"""The machine a run was measured on: CPU, cores, memory, BLAS, versions, load."""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import psutil

from fleet.commands.core import versions
from fleet.models.blas import OPENBLAS_CANDIDATES

OPENBLAS_PATH = next((p for _, p in OPENBLAS_CANDIDATES if p.exists()), None)


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else platform.machine()


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def uses_openblas(pid: int) -> bool:
    """Whether a process has the system OpenBLAS mapped (mlx then binds its BLAS calls there)."""
    try:
        return "libopenblas" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def wait_for_quiet(limit: float, max_wait_s: float) -> dict[str, Any]:
    """Wait (bounded) until the 1-minute load average is below `limit`."""
    start = time.monotonic()
    before = load_average()
    while os.getloadavg()[0] >= limit and time.monotonic() - start < max_wait_s:
        time.sleep(10)  # polling the kernel's load average, bounded by max_wait_s
    return {"limit": limit, "waited_s": round(time.monotonic() - start, 1),
            "load_before": before, "load_after": load_average()}


def machine_info(env: dict[str, str]) -> dict[str, Any]:
    memory = psutil.virtual_memory()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory.total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "blas": f"OpenBLAS ({OPENBLAS_PATH})" if OPENBLAS_PATH else "mlx's reference BLAS",
        "openblas_num_threads": env.get("OPENBLAS_NUM_THREADS"),
        "mlx_disable_compile": env.get("MLX_DISABLE_COMPILE"),
        "versions": versions(),
        "load_average_start": load_average(),
    }
