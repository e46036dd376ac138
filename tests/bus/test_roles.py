"""The role matrix: every cell of docs/permissions.md, tried against a real nats-server running
the shipped ops/nats/auth.conf, with raw nats-py and each role's own user."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from fleet.bus.auth_gen import shipped_config
from fleet.bus.connect import ConnectOptions, connect
from fleet.bus.embedded import ops_dir
from fleet.bus.provision import provision
from fleet.bus.replies import inbox_prefix
from fleet.bus.roles import ACTIONS, GRANTS, ROLES, Action, table_markdown
from fleet.errors import ProvisioningDenied
from tests.bus.role_probes import NEEDS, PROBES, Probe, prepare
from tests.secured import PASSWORDS, shipped_auth_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def secured_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the whole matrix: the probes aim at names of their own."""
    with shipped_auth_server(tmp_path_factory.mktemp("roles")) as url:
        asyncio.run(_prepare(url))
        yield url


async def _prepare(url: str) -> None:
    admin = await as_role(url, "operator")
    try:
        await provision(admin)
        await prepare(admin)
    finally:
        await admin.close()


async def as_role(url: str, role: str, **options: object) -> Client:
    return await nats.connect(url, user=role, password=PASSWORDS[role], allow_reconnect=False,
                              connect_timeout=5, inbox_prefix=inbox_prefix(role), **options)


async def outcome(url: str, role: str, action: Action) -> str:
    """"denied" when the server reports a permission violation, "allowed" when the probe gets
    through (a JetStream API error is the server answering, so it counts as through)."""
    violations: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            violations.put_nowait(str(exc))

    nc = await as_role(url, role, error_cb=on_error)
    admin = await as_role(url, "operator")
    try:
        attempt = asyncio.ensure_future(PROBES[action.key](Probe(nc, admin, role)))
        denied = asyncio.ensure_future(violations.get())
        done, _ = await asyncio.wait({attempt, denied}, timeout=15,
                                     return_when=asyncio.FIRST_COMPLETED)
        for waiting in (attempt, denied):
            waiting.cancel()
        await asyncio.gather(attempt, denied, return_exceptions=True)
        if denied in done:
            print(f"{role} / {action.key}: {denied.result()}")  # shown when a cell fails
            return "denied"
        assert attempt in done, f"{role} / {action.key}: neither an answer nor a violation"
        exc = attempt.exception()
        if exc is not None and not isinstance(exc, APIError | NoRespondersError):
            raise AssertionError(f"{role} / {action.key} failed without a violation") from exc
        await nc.flush(timeout=5)  # a violation of the probe's last step is read by now
        if not violations.empty():
            print(f"{role} / {action.key}: {violations.get_nowait()}")
            return "denied"
        return "allowed"
    finally:
        await nc.close()
        await admin.close()


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("action", ACTIONS, ids=[a.key for a in ACTIONS])
async def test_role_matrix(secured_url: str, role: str, action: Action) -> None:
    if (needs := NEEDS.get(action.key)) and not (ops_dir() / "jetstream" / needs).exists():
        pytest.skip(f"{needs} is not provisioned by this checkout")
    expected = "allowed" if role in action.allowed else "denied"
    assert await outcome(secured_url, role, action) == expected


def test_every_action_has_a_probe() -> None:
    assert set(PROBES) == {a.key for a in ACTIONS}


def test_shipped_auth_conf_is_rendered_from_the_roles() -> None:
    assert (ops_dir() / "nats" / "auth.conf").read_text() == shipped_config()


def test_docs_show_the_table_the_tests_check() -> None:
    assert table_markdown() in (REPO / "docs" / "permissions.md").read_text()


@pytest.mark.parametrize("role", ["client", "gateway", "worker"])
def test_no_role_but_the_operator_may_provision_or_destroy(role: str) -> None:
    """No wildcard grant hides a STREAM.CREATE/DELETE: the allow lists are read literally."""
    grant = GRANTS[role]
    for subject in grant.publish:
        assert subject not in (">", "$JS.API.>", "$JS.API.STREAM.>")
        assert not subject.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.DELETE",
                                       "$JS.API.STREAM.UPDATE", "$JS.API.CONSUMER.DURABLE"))
        assert not subject.startswith("$JS.API.CONSUMER.DELETE.FLEET_TASKS")


async def test_a_wrong_password_is_refused(secured_url: str) -> None:
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(secured_url, user="worker", password="wrong", allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=5)


async def test_provisioning_without_the_operator_role_fails_at_once_and_says_why(
    tmp_path: Path,
) -> None:
    """A worker started before the operator provisioned: a clear error, not 30 s of retries
    that end in "JetStream is not answering". (The helper forgets the recorded denial after:
    a gateway built by a later test in this process would report it on /healthz as its own.)"""
    with shipped_auth_server(tmp_path) as url:
        nc = await connect(url, "test-worker", inbox_owner="worker", options=ConnectOptions(
            user="worker", password=PASSWORDS["worker"]))
        try:
            async with asyncio.timeout(20):  # under the 30 s broker budget a retry would take
                with pytest.raises(ProvisioningDenied, match="operator role"):
                    await provision(nc)
        finally:
            await nc.close()
