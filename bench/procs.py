"""Processes the benchmark starts: a free port for each, and a bounded stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> float | None:
    """SIGTERM, then SIGKILL to the whole process group (started with start_new_session) after
    grace_s. Returns the seconds a graceful exit took, or None when it had to be killed."""
    began = time.perf_counter()
    process.terminate()
    try:
        process.wait(grace_s)
        return time.perf_counter() - began
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        return None


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    """User + system CPU seconds of each named process so far; NaN for one that is gone."""
    seconds = {}
    for name, process in processes.items():
        try:
            times = process.cpu_times()
            seconds[name] = times.user + times.system
        except psutil.Error:
            seconds[name] = float("nan")
    return seconds
