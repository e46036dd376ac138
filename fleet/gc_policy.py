"""The cyclic garbage collector of a long-running Fleet process (issue 23).

At task rates CPython's default collector cost ~90-120 us of `fleet up`'s CPU a task (of
~600): a young collection every 700 container allocations, each older collection walking
everything startup built (modules, settings, pydantic's compiled validators, the app's
routes), and a full one every ~1,000 tasks holding the loop for 70-100 ms (bench/README.md
"The cyclic collector at rate"). So a serving process collects its young generation ~14x less
often, and once it serves it freezes what startup made: those objects live to the process's
end and leave every later collection. What tasks make is collected as before (the older
generations keep CPython's ratios); startup's own garbage is collected once before the freeze.

Only a process's entry point (fleet.proc.run_main, `fleet gateway`) opts in: the same
functions called inside another program (a test running `fleet up`'s code in-process) leave
that program's collector alone.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # allocations between young collections; CPython's default is 700

_serving = False  # set by serving_thresholds: this process is a Fleet service


def serving_thresholds() -> None:
    """At a service process's start: collect the young generation less often (the older
    generations' thresholds stay as they are)."""
    global _serving
    _serving = True
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def freeze_startup() -> None:
    """Once a service process serves: collect what startup left behind, then move every
    surviving object out of later collections (gc.freeze). Nothing in a process that did not
    opt in with serving_thresholds."""
    if not _serving:
        return
    gc.collect()
    gc.freeze()
