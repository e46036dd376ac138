"""Per-task logits processors, on small arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

# fleet.runner's modules are imported where used, not at the top: they import mlx-lm, which
# pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from fleet.runner.sampling import CompletionPenalties


PROMPT = [5, 5, 7]


def _step(penalties: CompletionPenalties, context: list[int]) -> list[float]:
    logits = mx.zeros((1, 10))
    out: list[float] = penalties(mx.array(context), logits)[0].tolist()
    return out


def test_the_prompt_is_not_penalised_and_each_use_in_the_completion_is() -> None:
    from fleet.runner.sampling import CompletionPenalties
    penalties = CompletionPenalties(presence=0.5, frequency=1.0)
    assert _step(penalties, PROMPT) == [0.0] * 10  # first step: the context is all prompt
    after_two = _step(penalties, [*PROMPT, 3, 3])
    assert after_two[3] == -2.5  # twice: 2 x frequency + presence once
    assert after_two[5] == 0.0 and after_two[7] == 0.0  # prompt tokens stay free
    after_three = _step(penalties, [*PROMPT, 3, 3, 9])
    assert after_three[9] == -1.5 and after_three[3] == -2.5


def test_a_negative_penalty_favours_used_tokens() -> None:
    from fleet.runner.sampling import CompletionPenalties
    penalties = CompletionPenalties(presence=-1.0, frequency=0.0)
    _step(penalties, PROMPT)
    assert _step(penalties, [*PROMPT, 4])[4] == 1.0
