"""How long an idle runner waits for more tasks before its first engine step.

A step is not interruptible, and a task that arrives just after an idle engine started one
waits for the whole of it. Issue 23's burst of eight requests with one cached system prompt
(smollm2-135m, 2 cores) reached an idle runner as one task and, 6-17 ms later, the other seven
(the worker's first delivery, then the pull that brought the rest; a throwaway probe of the
runner's pipe, 2026-12-05). An engine that had served one stream at a time read the first
prompt whole (0.3 s, prefill_ramp.py), and the other seven then came in two groups after it:
first tokens 1 x 0.3, 4 x 1.3, 3 x 2.3 s against mlx_lm.server's 6-7 x 1.1-1.2 s (HTTP,
quiet, three reps).

So a runner whose engine asks for it (the text engine) waits, after a task reaches it idle,
for a short window before the first step, and every task arriving meanwhile starts with it
(a burst: burst_split.py). The window is a share of the engine's typical step (so a lone
request pays a bounded fraction of one step, whatever the hardware: ~1-2 ms where a step is
~5-10 ms), never more than WINDOW_CAP_S. With no step measured yet there is none.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

WINDOW_CAP_S = 0.02
# How fast the typical step follows the measured ones: about the last twenty steps.
STEP_WEIGHT = 0.1


@runtime_checkable
class Gathering(Protocol):
    """An engine whose first step from idle is worth delaying for company."""

    company_share: float  # the window, as a share of a typical step


def window_s(typical_step_s: float | None, share: float, cap_s: float = WINDOW_CAP_S) -> float:
    """Seconds to wait for more tasks once a task reached the idle engine."""
    if typical_step_s is None or share <= 0.0:
        return 0.0
    return min(cap_s, share * typical_step_s)


class StepClock:
    """A moving average of the engine's step durations."""

    def __init__(self) -> None:
        self.typical_s: float | None = None

    def add(self, seconds: float) -> None:
        if self.typical_s is None:
            self.typical_s = seconds
        else:
            self.typical_s += STEP_WEIGHT * (seconds - self.typical_s)
