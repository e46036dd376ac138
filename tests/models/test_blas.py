"""enable_openblas: loads Debian's OpenBLAS before mlx, and refuses once mlx is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleet.models.blas import OPENBLAS_CANDIDATES


def _run(script: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not any(p.exists() for _, p in OPENBLAS_CANDIDATES),
    reason="no Debian OpenBLAS on this machine",
)
def test_openblas_is_loaded_into_the_process_before_mlx():
    out = _run(
        "from fleet.models.blas import enable_openblas\n"
        "print(enable_openblas())\n"
        "import mlx.core\n"
        "print(any('libopenblas' in line for line in open('/proc/self/maps')))\n"
    )

    assert out.splitlines() == ["openblas-pthread", "True"]


def test_too_late_once_mlx_is_imported():
    out = _run(
        "import mlx.core\nfrom fleet.models.blas import enable_openblas\nprint(enable_openblas())"
    )

    assert out == "None"
