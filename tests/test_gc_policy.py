"""The collector policy of Fleet's service processes (fleet.gc_policy). Each case runs in a
fresh interpreter: a freeze in the test process itself would exempt the suite's objects."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


def test_a_service_process_collects_its_young_generation_less_often() -> None:
    out = _run(
        "import gc\n"
        "from fleet.proc import run_main\n"
        "async def main(exit_):\n"
        "    print(*gc.get_threshold(), flush=True)\n"
        "run_main(main)\n"
    )
    from fleet.gc_policy import YOUNG_THRESHOLD

    default_middle, default_old = 10, 10  # CPython's, kept for the older generations
    assert out.split() == [str(YOUNG_THRESHOLD), str(default_middle), str(default_old)]


@pytest.mark.parametrize(("opted_in", "frozen"), [(True, True), (False, False)])
def test_startup_is_frozen_only_in_a_process_that_opted_in(opted_in: bool, frozen: bool) -> None:
    out = _run(
        "import gc\n"
        "gc.disable()  # no collection but the policy's own decides what is collected\n"
        "from fleet import gc_policy\n"
        + ("gc_policy.serving_thresholds()\n" if opted_in else "")
        + "before = gc.get_freeze_count()\n"
        "garbage = []\n"
        "garbage.append(garbage)  # a cycle startup left behind: collected, not frozen\n"
        "import weakref\n"
        "class Box: pass\n"
        "box = Box(); box.me = box; gone = weakref.ref(box); del box, garbage\n"
        "gc_policy.freeze_startup()\n"
        "print(before, gc.get_freeze_count(), gone() is None)\n"
    )
    before, after, collected = out.split()
    assert before == "0"
    assert (int(after) > 0) is frozen
    assert collected == ("True" if opted_in else "False")
