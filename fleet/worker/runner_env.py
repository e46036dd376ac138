"""The environment of a runner subprocess: how many BLAS threads it may use.

R runners on one machine each running OpenBLAS with a thread per core oversubscribe it R
times over (on this 2-core box two runners with 2 threads each decode slower than with 1).
So a runner gets the node's cores divided by the runners it hosts, at least one, unless the
operator set OPENBLAS_NUM_THREADS for the worker, which then holds for every runner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# mflux draws a tqdm progress bar per generation: carriage-return noise in the runner's log.
BASE_ENV = {"TQDM_DISABLE": "1"}


def blas_threads(cores: int, runners: int, configured: str | None) -> str:
    """OPENBLAS_NUM_THREADS for one of `runners` runners on `cores` cores."""
    if configured:
        return configured
    return str(max(1, cores // max(1, runners)))


def runner_env(runners_here: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    threads = blas_threads(os.cpu_count() or 1, runners_here, environ.get("OPENBLAS_NUM_THREADS"))
    return {**BASE_ENV, "OPENBLAS_NUM_THREADS": threads}
