"""The VTC rules as tables, and a run of them: A floods at 10x B's load, each gets its
weight's share of the tokens served."""

from __future__ import annotations

import pytest

from fleet.bus.fairness import charge, holds, lift, next_tenant, shares


@pytest.mark.parametrize(("counters", "tenant", "tokens", "weight", "after"), [
    ({}, "a", 100, 1.0, {"a": 100.0}),
    ({"a": 10.0}, "a", 100, 2.0, {"a": 60.0}),
    ({"a": 10.0}, "b", 30, 0.5, {"a": 10.0, "b": 60.0}),
])
def test_charge(counters: dict[str, float], tenant: str, tokens: int, weight: float,
                after: dict[str, float]) -> None:
    assert charge(counters, tenant, tokens, weight) == after


@pytest.mark.parametrize(("counters", "backlogged", "after_b"), [
    pytest.param({"a": 500.0, "b": 0.0}, ["a"], 500.0, id="idle-tenant-banks-no-credit"),
    pytest.param({"a": 500.0, "b": 900.0}, ["a"], 900.0, id="never-lowered"),
    pytest.param({"b": 7.0}, [], 7.0, id="nobody-waiting"),
    pytest.param({"a": 50.0, "c": 20.0}, ["a", "c"], 20.0, id="the-least-of-the-waiting"),
])
def test_lift(counters: dict[str, float], backlogged: list[str], after_b: float) -> None:
    assert lift(counters, "b", backlogged)["b"] == after_b


@pytest.mark.parametrize(("counters", "backlogged", "chosen"), [
    ({"a": 5.0, "b": 3.0}, ["a", "b"], "b"),
    ({"a": 5.0, "b": 3.0}, ["a"], "a"),
    ({"a": 3.0, "b": 3.0}, ["b", "a"], "a"),
    ({}, [], None),
    ({}, ["new"], "new"),
])
def test_next_tenant(counters: dict[str, float], backlogged: list[str],
                     chosen: str | None) -> None:
    assert next_tenant(counters, backlogged) == chosen


@pytest.mark.parametrize(("counters", "backlogged", "held"), [
    ({"a": 300.0, "b": 100.0}, ["a", "b"], True),
    ({"a": 150.0, "b": 100.0}, ["a", "b"], False),  # within the quantum
    ({"a": 300.0, "b": 100.0}, ["a"], False),  # B is not waiting: A takes the slack
    ({"a": 100.0, "b": 300.0}, ["a", "b"], False),
])
def test_holds(counters: dict[str, float], backlogged: list[str], held: bool) -> None:
    assert holds(counters, "a", backlogged, quantum=100.0) is held


@pytest.mark.parametrize(("weights", "b_share"), [
    ({"a": 1.0, "b": 1.0}, 0.5), ({"a": 1.0, "b": 3.0}, 0.75), ({"a": 3.0, "b": 1.0}, 0.25),
])
def test_a_flooding_tenant_gets_its_weight_and_no_more(weights: dict[str, float],
                                                       b_share: float) -> None:
    queues = {"a": [40] * 1000, "b": [40] * 100}  # A sends 10x B's tasks, 40 tokens each
    counters: dict[str, float] = {}
    served = {"a": 0, "b": 0}
    while len(queues["b"]) > 0:  # while both are backlogged
        tenant = next_tenant(counters, [t for t, q in queues.items() if q])
        assert tenant is not None
        tokens = queues[tenant].pop(0)
        served[tenant] += tokens
        counters = charge(counters, tenant, tokens, weights[tenant])
    assert shares(served)["b"] == pytest.approx(b_share, abs=0.01)
