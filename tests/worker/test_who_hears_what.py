"""Who hears what (issue 22), the pure decisions: a prefix advert's key and the watches a
worker keeps, the sweeper lease's state, the janitor's triage of queued subjects, what a
gateway reads back after a reconnect, and the harness's reading of `/connz`."""

from __future__ import annotations

import orjson
import pytest

from bench.scale_connz import Received, received_by, subscriptions_of
from fleet.gateway.task_feed import digest, missing
from fleet.worker.janitor import triage
from fleet.worker.prefix_adverts import (
    Written,
    advert_due,
    advert_key,
    merged,
    model_filter,
    watches_to_change,
)
from fleet.worker.sweeper import LeaseState, after_attempt


@pytest.mark.parametrize(("model", "runner", "heard_by", "not_heard_by"), [
    ("tiny-llm", "run-1", "tiny-llm", "smollm2-135m"),
    ("a", "r", "a", "ab"),  # a model whose id starts another's hears none of the other's
    ("ab", "r", "ab", "a"),
])
def test_an_advert_is_heard_only_by_a_watch_of_its_model(
    model: str, runner: str, heard_by: str, not_heard_by: str
) -> None:
    key = advert_key(model, runner)
    assert matches(model_filter(heard_by), key)
    assert not matches(model_filter(not_heard_by), key)


def matches(pattern: str, key: str) -> bool:
    """NATS subject matching of a KV key filter (`>` a tail of one or more tokens)."""
    head, tail = pattern.split("."), key.split(".")
    if head[-1] == ">":
        return len(tail) >= len(head) and tail[:len(head) - 1] == head[:-1]
    return head == tail


@pytest.mark.parametrize(("serving", "watched", "start", "stop"), [
    (set(), set(), set(), set()),
    ({"a"}, set(), {"a"}, set()),  # a model placed here: its adverts watched
    ({"a"}, {"a", "b"}, set(), {"b"}),  # b left this node: its adverts no longer heard
    ({"a", "c"}, {"a", "b"}, {"c"}, {"b"}),
])
def test_a_worker_watches_the_adverts_of_the_models_it_serves_and_no_others(
    serving: set[str], watched: set[str], start: set[str], stop: set[str]
) -> None:
    assert watches_to_change(serving, watched) == (start, stop)


@pytest.mark.parametrize(("before", "written", "held"), [
    (LeaseState(), 7, True),  # created: held
    (LeaseState(), None, False),  # another worker's key is there
    (LeaseState(7), 9, True),  # renewed
    (LeaseState(7), None, False),  # ours expired and was taken: its duties stop
])
def test_the_lease_is_held_only_while_its_writes_go_through(
    before: LeaseState, written: int | None, held: bool
) -> None:
    assert after_attempt(before, written).held is held


def test_triage_sends_known_models_to_demand_and_answers_unknown_subjects() -> None:
    counts = {"fleet.tasks.tiny-llm": 3, "fleet.tasks.nope": 1, "fleet.tasks.idle": 0}
    known, unknown = triage(counts, lambda model: model in {"tiny-llm", "idle"})
    assert known == ["tiny-llm"]  # a subject with nothing stored is nobody's business
    assert unknown == ["fleet.tasks.nope"]


@pytest.mark.parametrize(("stored", "delivered", "refilled"), [
    ([b"a", b"b", b"c"], [b"a"], [b"b", b"c"]),  # missed while disconnected
    ([b"a", b"b"], [b"b", b"a"], []),  # all there, in whatever order they came
    ([], [b"a"], []),
])
def test_a_gateway_reads_back_only_what_its_subscription_missed(
    stored: list[bytes], delivered: list[bytes], refilled: list[bytes]
) -> None:
    assert missing(stored, {digest(d) for d in delivered}) == refilled


def test_received_counts_what_the_server_sent_to_each_named_connection() -> None:
    connz = {"connections": [
        {"name": "fleet-worker", "out_msgs": 10, "out_bytes": 1000, "in_msgs": 99,
         "subscriptions_list": ["_INBOX.worker.>"]},
        {"name": "fleet-gateway", "out_msgs": 3, "out_bytes": 30},
        {"name": "fleet-gateway", "out_msgs": 4, "out_bytes": 40},
    ]}
    assert received_by(connz, "fleet-worker") == Received(10, 1000)
    assert received_by(connz, "fleet-gateway") == Received(7, 70)
    assert received_by(connz, "fleet-gateway") - Received(2, 20) == Received(5, 50)
    assert subscriptions_of(connz, "fleet-worker") == ["_INBOX.worker.>"]


LOAD = (1, 0, True)
LAST = Written(blocks=1, load=LOAD, whole_at=100.0, load_at=100.0)


@pytest.mark.parametrize(("last", "blocks", "load", "now", "due"), [
    (None, 1, LOAD, 100.0, "whole"),  # never advertised
    (LAST, 1, LOAD, 100.25, None),  # nothing changed
    (LAST, 1, (2, 0, True), 100.25, "load"),  # a task started: a few hundred bytes
    (LAST, 2, LOAD, 100.5, None),  # new blocks within the second: they wait
    (LAST, 2, (2, 0, True), 100.5, "load"),  # ...and the load goes alone meanwhile
    (LAST, 2, LOAD, 101.0, "whole"),  # a second later, the blocks go
    (LAST, 1, LOAD, 100_000.0, None),  # idle: nothing, ever (the advert lasts, no refresh)
])
def test_blocks_go_at_most_once_a_second_and_load_alone_when_only_it_changed(
    last: Written | None, blocks: int, load: tuple[int, int, bool], now: float, due: str | None
) -> None:
    assert advert_due(last, blocks, load, now) == due


@pytest.mark.parametrize(("now", "due"), [
    (119.0, None),
    (120.0, "whole"),  # the refresh that keeps the key alive in a bucket without TTLs
])
def test_where_adverts_expire_by_age_an_idle_one_is_refreshed(now: float, due: str | None) -> None:
    assert advert_due(LAST, 1, LOAD, now, refresh_s=20.0) == due


def test_a_reader_merges_a_newer_load_update_into_the_whole_summary() -> None:
    whole = orjson.dumps({"runner_id": "r", "blocks": ["00"], "in_flight": 2, "at": 1.0})
    newer = orjson.dumps({"runner_id": "r", "blocks": [], "in_flight": 0, "load_only": True,
                          "at": 2.0})
    older = orjson.dumps({"runner_id": "r", "blocks": [], "in_flight": 5, "load_only": True,
                          "at": 0.5})
    assert orjson.loads(merged(whole, newer) or b"") == {
        "runner_id": "r", "blocks": ["00"], "in_flight": 0, "at": 2.0}
    assert merged(whole, older) == whole  # a whole summary written since wins
    assert merged(None, newer) is None  # no blocks known: not a candidate yet
    assert merged(whole, None) == whole
