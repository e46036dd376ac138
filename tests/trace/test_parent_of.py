"""`telemetry.parent_of` (how a runner reads the parent SubmitTask names, without a Context)
reads every traceparent as the propagators' `context_of` does."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from fleet.telemetry import context_of, parent_of

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def by_context(traceparent: str | None, tracestate: str | None) -> object:
    parent = trace.get_current_span(context_of(traceparent, tracestate)).get_span_context()
    if not parent.is_valid:
        return None
    return format(parent.trace_id, "032x"), format(parent.span_id, "016x"), \
        parent.trace_flags.sampled


@pytest.mark.parametrize(("traceparent", "tracestate", "expected"), [
    (f"00-{TRACE}-{SPAN}-01", None, (TRACE, SPAN, True)),
    (f"00-{TRACE}-{SPAN}-00", None, (TRACE, SPAN, False)),  # not sampled
    (f"00-{TRACE}-{SPAN}-03", "k=v", (TRACE, SPAN, True)),  # another flag beside it
    (f"00-{'0' * 32}-{SPAN}-01", None, None),  # no valid trace id
    (f"00-{TRACE}-{'0' * 16}-01", None, None),  # no valid span id
    (f"ff-{TRACE}-{SPAN}-01", None, None),  # a version W3C forbids
    (f"01-{TRACE}-{SPAN}-01-extra", None, (TRACE, SPAN, True)),  # a later version: read
    (f"00-{TRACE.upper()}-{SPAN}-01", None, None),
    (f"00-{TRACE}-{SPAN}-01-extra", None, None),  # version 00 has no more fields
    ("", None, None),
    (None, None, None),
    ("nonsense", None, None),
])
def test_a_runner_reads_a_traceparent_as_the_propagators_do(
    traceparent: str | None, tracestate: str | None, expected: object
) -> None:
    assert parent_of(traceparent, tracestate) == by_context(traceparent, tracestate) == expected
