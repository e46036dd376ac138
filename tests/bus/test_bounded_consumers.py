"""Consumers are bounded (issue 31, item 3): what a reader creates on FLEET_OUT or the image
store goes within the stream's inactive threshold, no client makes a durable, and a stream
provisioned before the limits gets them by an update of those keys alone.

Against a real nats-server: the shipped roles (ops/nats/auth.conf) for the probes, an open
server for provisioning.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.connect import ConnectOptions, connect
from fleet.bus.provision import LIMIT_KEYS, definitions, limits_to_update, provision
from tests.secured import PASSWORDS, as_role, shipped_auth_server

SECOND = 1_000_000_000
THRESHOLD_NS = 60 * SECOND
READ_STREAMS = ("FLEET_OUT", "OBJ_FLEET_IMAGES")  # the streams a client may read


def _definition(name: str) -> dict:
    return next(d for d in definitions() if d["name"] == name)


# ---- the definitions (pure) --------------------------------------------------------------

@pytest.mark.parametrize("name", [*READ_STREAMS, "FLEET_TRACES", "OBJ_FLEET_WEIGHTS"])
def test_every_stream_readers_use_has_a_consumer_limit_and_threshold(name: str) -> None:
    config = _definition(name)
    assert config["max_consumers"] > 0
    assert config["consumer_limits"] == {"inactive_threshold": THRESHOLD_NS}


@pytest.mark.parametrize(("wanted", "actual", "update"), [
    ({"max_consumers": 8, "max_age": 1}, {"max_consumers": -1, "max_age": 1}, {"max_consumers": 8}),
    ({"max_consumers": 8}, {"max_consumers": 8}, {}),
    ({"consumer_limits": {"inactive_threshold": 5}}, {"consumer_limits": {}},
     {"consumer_limits": {"inactive_threshold": 5}}),
    ({"max_age": 5}, {"max_age": 1}, {}),  # not a limit: a conflict, never an update
    ({}, {"max_consumers": 3}, {}),  # a file without limits asks for nothing
])
def test_limits_to_update(wanted: dict, actual: dict, update: dict) -> None:
    assert limits_to_update(wanted, actual) == update
    assert set(update) <= LIMIT_KEYS


# ---- provisioning an old stream ---------------------------------------------------------

@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-bounded")
    yield client
    await client.close()


def _without_limits(name: str) -> dict:
    return {k: v for k, v in _definition(name).items() if k not in LIMIT_KEYS}


async def _api(nc: Client, subject: str, body: dict | None = None) -> dict:
    payload = json.dumps(body).encode() if body is not None else b""
    return json.loads((await nc.request(f"$JS.API.{subject}", payload, timeout=5)).data)


async def test_an_old_stream_gets_the_limits_and_keeps_its_messages(nc: Client) -> None:
    created = await _api(nc, "STREAM.CREATE.FLEET_OUT", _without_limits("FLEET_OUT"))
    assert created["config"]["max_consumers"] == -1  # what main provisioned before
    await nc.jetstream().publish("fleet.out.kept", b"still here")

    outcomes = {o.name: o.action for o in await provision(nc)}

    assert outcomes["FLEET_OUT"] == "updated"
    config = (await _api(nc, "STREAM.INFO.FLEET_OUT"))["config"]
    assert config["max_consumers"] == _definition("FLEET_OUT")["max_consumers"]
    assert config["consumer_limits"] == {"inactive_threshold": THRESHOLD_NS}
    assert (await nc.jetstream().get_last_msg("FLEET_OUT", "fleet.out.kept")).data == b"still here"
    assert {o.action for o in await provision(nc)} == {"unchanged"}


async def test_a_durable_made_before_the_limits_is_named_for_the_operator(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack's leftover: a durable without a threshold, which the new limit does not
    reach. Provisioning names it (never deletes it)."""
    await _api(nc, "STREAM.CREATE.FLEET_OUT", _without_limits("FLEET_OUT"))
    evil = {"durable_name": "evil", "ack_policy": "none", "deliver_subject": "_INBOX.evil"}
    await _api(nc, "CONSUMER.CREATE.FLEET_OUT.evil", {"stream_name": "FLEET_OUT", "config": evil})

    with caplog.at_level(logging.WARNING, logger="fleet.bus.provision"):
        outcomes = {o.name: o.action for o in await provision(nc)}

    assert outcomes["FLEET_OUT"] == "updated"
    assert "never expire: evil" in caplog.text
    assert "error" not in await _api(nc, "CONSUMER.INFO.FLEET_OUT.evil")


async def test_a_limit_the_server_refuses_is_reported_and_the_stream_used_as_it_is(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer with a threshold above the new limit: the server refuses the update;
    provisioning says what to do and goes on."""
    await _api(nc, "STREAM.CREATE.FLEET_OUT", _without_limits("FLEET_OUT"))
    long = {"ack_policy": "none", "deliver_subject": "_INBOX.long",
            "inactive_threshold": 3600 * SECOND}
    await _api(nc, "CONSUMER.CREATE.FLEET_OUT", {"stream_name": "FLEET_OUT", "config": long})

    with caplog.at_level(logging.WARNING, logger="fleet.bus.provision"):
        outcomes = {o.name: o.action for o in await provision(nc)}

    assert outcomes["FLEET_OUT"] == "outdated"
    assert "FLEET_OUT lacks the limits" in caplog.text and "violates" in caplog.text
    assert (await _api(nc, "STREAM.INFO.FLEET_OUT"))["config"]["max_consumers"] == -1


# ---- the probes under the shipped roles --------------------------------------------------

@pytest.fixture(scope="module")
def secured_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shipped_auth_server(tmp_path_factory.mktemp("bounded")) as url:
        asyncio.run(_provision_as_operator(url))
        yield url


async def _provision_as_operator(url: str) -> None:
    admin = await as_role(url, "operator")
    try:
        await provision(admin)
    finally:
        await admin.close()


async def _refused(nc: Client, violations: list[str], subject: str, body: dict) -> None:
    """The request gets no answer and the server reports a permission violation."""
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request(subject, json.dumps(body).encode(), timeout=1.0)
    await nc.flush()
    assert any(subject.lower() in v.lower() for v in violations), violations


@pytest.mark.parametrize("stream", READ_STREAMS)
async def test_a_client_cannot_make_a_durable(secured_url: str, stream: str) -> None:
    """Issue 31's probe (`CONSUMER.CREATE.FLEET_OUT.evil.fleet.out.>` passed the old grant),
    the legacy DURABLE.CREATE, and a durable name on the unsuffixed form."""
    violations: list[str] = []
    nc = await as_role(secured_url, "client", violations)
    try:
        config = {"durable_name": "evil", "ack_policy": "none",
                  "deliver_subject": "_INBOX.client.evil"}
        body = {"stream_name": stream, "config": config}
        filtered = "fleet.out.>" if stream == "FLEET_OUT" else "$O.FLEET_IMAGES.M.>"
        await _refused(nc, violations, f"$JS.API.CONSUMER.CREATE.{stream}.evil.{filtered}", body)
        await _refused(nc, violations, f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.evil", body)
        answer = await _api(nc, f"CONSUMER.CREATE.{stream}", body)
        assert answer["error"]["err_code"] == 10020  # "expected to be ephemeral"
    finally:
        await nc.close()


@pytest.mark.parametrize("stream", READ_STREAMS)
async def test_what_a_client_creates_goes_within_the_threshold(
    secured_url: str, stream: str
) -> None:
    nc = await as_role(secured_url, "client")
    try:
        longer = {"ack_policy": "none", "inactive_threshold": 3600 * SECOND,
                  "deliver_subject": "_INBOX.client.long"}
        answer = await _api(nc, f"CONSUMER.CREATE.{stream}",
                            {"stream_name": stream, "config": longer})
        assert answer["error"]["err_code"] == 10153  # exceeds the stream's limit
        unset = {"ack_policy": "none", "deliver_subject": "_INBOX.client.unset"}
        made = await _api(nc, f"CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": unset})
        assert made["config"]["inactive_threshold"] == THRESHOLD_NS
    finally:
        await nc.close()


async def test_an_honest_replay_still_works_under_the_client_role(secured_url: str) -> None:
    admin = await as_role(secured_url, "operator")
    nc = await as_role(secured_url, "client")
    try:
        await admin.jetstream().publish("fleet.out.honest", b"event")
        sub = await nc.jetstream().subscribe("fleet.out.honest", stream="FLEET_OUT",
                                             ordered_consumer=True)
        assert (await sub.next_msg(timeout=5)).data == b"event"
        await sub.unsubscribe()
    finally:
        await nc.close()
        await admin.close()


async def test_the_consumer_count_of_fleet_out_is_bounded(secured_url: str) -> None:
    nc = await as_role(secured_url, "client")
    try:
        info = await _api(nc, "STREAM.INFO.FLEET_OUT")
        assert info["config"]["max_consumers"] == _definition("FLEET_OUT")["max_consumers"]
    finally:
        await nc.close()


async def test_a_role_that_may_not_update_a_stream_uses_it_as_it_is_and_says_so(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker started against a FLEET_OUT provisioned before the limits: its provisioning
    may not update the stream; it says who may and goes on at once (no wait for a reply the
    server never sends)."""
    with shipped_auth_server(tmp_path_factory.mktemp("outdated")) as url:
        admin = await as_role(url, "operator")
        worker = await connect(url, "test-worker", options=ConnectOptions(
            user="worker", password=PASSWORDS["worker"]), inbox_owner="worker")
        try:
            await _api(admin, "STREAM.CREATE.FLEET_OUT", _without_limits("FLEET_OUT"))
            for config in definitions():
                if config["name"] != "FLEET_OUT":
                    await _api(admin, f"STREAM.CREATE.{config['name']}", config)
            with caplog.at_level(logging.WARNING, logger="fleet.bus.provision"):
                async with asyncio.timeout(10):  # a refused request would wait 5 s a try
                    outcomes = {o.name: o.action for o in await provision(worker)}
            assert outcomes["FLEET_OUT"] == "outdated"
            assert "fleet nats --provision" in caplog.text
        finally:
            await worker.close()
            await admin.close()


@pytest.mark.parametrize("role", ["client", "gateway"])
def test_readers_are_denied_durables_explicitly(role: str) -> None:
    """Besides no allow for them: a deny, so a broader allow added later cannot grant one."""
    from fleet.bus.auth_gen import shipped_config
    from fleet.bus.roles import GRANTS, NO_DURABLES

    assert GRANTS[role].deny_publish == NO_DURABLES
    assert "$JS.API.CONSUMER.DURABLE.CREATE.>" in shipped_config()
    named = [s for s in GRANTS[role].publish if s.startswith("$JS.API.CONSUMER.CREATE.")]
    assert named and all(len(s.split(".")) == 5 for s in named), named  # unsuffixed only
