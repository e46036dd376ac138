"""connect_with(settings): server lists, user/password, NKeys, TLS (mutual), redaction and
permission errors, each against a real nats-server started with the matching config."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nkeys
import pytest

from fleet.bus.auth_gen import make_tls
from fleet.bus.connect import (
    connect,
    connect_with,
    js_publish,
    redact_text,
    redact_url,
    server_list,
)
from fleet.bus.denials import (
    forget_permission_errors,
    parse_permission_error,
    permission_errors,
)
from fleet.bus.embedded import EmbeddedNats
from fleet.bus.kv_calls import kv_put
from fleet.bus.retry import is_transient, pause_after
from fleet.config import Settings, load_settings
from fleet.errors import NatsUnavailable, NotPermitted
from fleet.wire.tasks import ChatMessage
from tests.bus.cluster import free_port

# ---- pure -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "shown"), [
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ("nats://alice:s3cret@127.0.0.1:4222", "nats://alice:***@127.0.0.1:4222"),
    ("tls://bob:p%40ss@nats.example:4443", "tls://bob:***@nats.example:4443"),
    ("nats://tokenonly@host:4222", "nats://***@host:4222"),
    ("127.0.0.1:4222", "127.0.0.1:4222"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_hides_every_password_in_free_text() -> None:
    text = "cannot reach nats://a:pw1@h1:1, nats://b:pw2@h2:2"
    assert redact_text(text) == "cannot reach nats://a:***@h1:1, nats://b:***@h2:2"


def test_a_comma_separated_url_is_a_list_of_servers() -> None:
    settings = load_settings(env={"FLEET_NATS_URL": "nats://a:1, nats://b:2,nats://c:3"})
    assert server_list(settings.url) == ["nats://a:1", "nats://b:2", "nats://c:3"]
    assert server_list(["nats://a:1"]) == ["nats://a:1"]


def test_permission_errors_name_the_operation_and_the_subject() -> None:
    found = parse_permission_error(
        "nats: 'Permissions Violation for Publish to \"fleet.out.t1\"'"
    )
    assert found is not None and (found.operation, found.subject) == ("publish", "fleet.out.t1")
    assert parse_permission_error("nats: stale connection") is None


@pytest.mark.parametrize(("attempt", "pause"), [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (6, 2.0),
                                                (50, 2.0)])
def test_retry_pauses_double_up_to_a_cap(attempt: int, pause: float) -> None:
    assert pause_after(attempt) == pytest.approx(pause)


def test_transient_errors_are_what_a_restart_or_an_election_causes() -> None:
    import nats.errors
    import nats.js.errors

    assert is_transient(nats.errors.TimeoutError())
    assert is_transient(nats.errors.NoRespondersError())
    assert is_transient(nats.js.errors.ServiceUnavailableError(code=503))
    assert is_transient(nats.js.errors.APIError(code=503))
    assert not is_transient(nats.js.errors.BadRequestError(code=400))
    assert not is_transient(ValueError())


# ---- real servers ---------------------------------------------------------------------------

def server_with(tmp_path: Path, config: str, name: str = "s") -> EmbeddedNats:
    path = tmp_path / f"{name}.conf"
    path.write_text(config)
    return EmbeddedNats(tmp_path / name, port=0, config=path, log_file=tmp_path / f"{name}.log")


async def test_the_first_server_of_the_list_down_connects_to_the_next(
    nats_server: EmbeddedNats,
) -> None:
    down = f"nats://127.0.0.1:{free_port()}"
    settings = Settings(nats_url=f"{down},{nats_server.url}")
    nc = await connect_with(settings, "test-list")
    try:
        assert nc.is_connected
        assert nc.connected_url is not None and nc.connected_url.port == nats_server.port
    finally:
        await nc.close()


async def test_no_server_up_is_a_clear_error_with_the_password_redacted() -> None:
    url = f"nats://alice:s3cret@127.0.0.1:{free_port()}"
    with pytest.raises(NatsUnavailable) as failed:
        await connect(url, "test-down", connect_timeout=1.0)
    assert "alice:***@" in failed.value.message and "s3cret" not in failed.value.message


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    config = 'authorization { users: [ { user: alice, password: "s3cret" } ] }\n'
    with server_with(tmp_path, config) as server:
        yield server


async def test_user_and_password_from_settings_or_url(
    password_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    plain = password_server.url
    with caplog.at_level(logging.DEBUG):
        nc = await connect_with(
            Settings(nats_url=plain, nats_user="alice", nats_password="s3cret"), "t"
        )
        await nc.close()
        in_url = plain.replace("nats://", "nats://alice:s3cret@")
        nc = await connect_with(Settings(nats_url=in_url), "t")
        await nc.close()
    with pytest.raises(NatsUnavailable) as refused:
        await connect_with(Settings(nats_url=plain, nats_user="alice", nats_password="no"), "t")
    assert "s3cret" not in refused.value.message
    assert "s3cret" not in caplog.text


async def test_an_nkey_seed_file(tmp_path: Path) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    config = f"authorization {{ users: [ {{ nkey: {public} }} ] }}\n"
    with server_with(tmp_path, config) as server:
        nc = await connect_with(Settings(nats_url=server.url, nats_nkey=str(seed_file)), "t")
        assert nc.is_connected
        await nc.close()
        with pytest.raises(NatsUnavailable):
            await connect_with(Settings(nats_url=server.url), "t", connect_timeout=2.0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_mutual_tls_with_a_private_ca(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    files = make_tls(certs)
    config = (
        f'tls {{\n  cert_file: "{files.server_cert}"\n  key_file: "{files.server_key}"\n'
        f'  ca_file: "{files.ca}"\n  verify: true\n}}\n'
    )
    with server_with(tmp_path, config) as server:
        url = f"tls://127.0.0.1:{server.port}"
        settings = Settings(
            nats_url=url, nats_tls_ca=str(files.ca),
            nats_tls_cert=str(certs / "worker-cert.pem"),
            nats_tls_key=str(certs / "worker-key.pem"),
        )
        nc = await connect_with(settings, "t")
        assert nc.is_connected
        await nc.publish("x", b"over tls")
        await nc.flush()
        await nc.close()
        # No client certificate: the server refuses it, and the error says where.
        with pytest.raises(NatsUnavailable, match=r"127\.0\.0\.1"):
            await connect_with(Settings(nats_url=url, nats_tls_ca=str(files.ca)), "t",
                               connect_timeout=2.0)


async def test_a_permission_violation_is_one_line_naming_the_subject_and_is_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = (
        'authorization { users: [ { user: u, password: p, permissions: '
        '{ publish: { allow: ["ok.>", "_INBOX.>"] }, subscribe: { allow: ["_INBOX.>"] } } } ] }\n'
    )
    with server_with(tmp_path, config) as server:
        nc = await connect_with(Settings(nats_url=server.url, nats_user="u", nats_password="p"),
                                "test-perm")
        with caplog.at_level(logging.ERROR, logger="fleet.bus.connect"):
            await nc.publish("forbidden.subject", b"x")
            await nc.flush()
            await nc.flush()  # the -ERR arrives before the second PONG
        await nc.close()
    denied = [d for d in permission_errors() if d.subject == "forbidden.subject"]
    assert denied and denied[-1].operation == "publish"
    lines = [r.getMessage() for r in caplog.records if "forbidden.subject" in r.getMessage()]
    assert len(lines) == 1 and "permission denied: publish to forbidden.subject" in lines[0]


# ---- a .creds file (operator mode: JWTs signed with NKeys, as `nsc` would make them) -------

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _jwt(subject: nkeys.KeyPair, issuer: nkeys.KeyPair, name: str, nats: dict[str, Any]) -> str:
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {
        "jti": _b64(os.urandom(16)), "iat": int(time.time()), "iss": issuer.public_key.decode(),
        "name": name, "sub": subject.public_key.decode(), "nats": {**nats, "version": 2},
    }
    body = _b64(json.dumps(claims).encode())
    return f"{header}.{body}.{_b64(issuer.sign(f'{header}.{body}'.encode()))}"


async def test_a_creds_file(tmp_path: Path) -> None:
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs a system account
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                 "wildcards": True, "conn": -1, "leaf": -1}
    operator_jwt = _jwt(operator, operator, "op", {"type": "operator"})
    account_jwt = _jwt(account, operator, "FLEET", {"type": "account", "limits": unlimited})
    system_jwt = _jwt(system, operator, "SYS", {"type": "account", "limits": unlimited})
    user_jwt = _jwt(user, account, "worker", {
        "type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
    })
    creds = tmp_path / "worker.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )
    config = (
        f'operator: "{operator_jwt}"\nresolver: MEMORY\n'
        f'system_account: {system.public_key.decode()}\n'
        f'resolver_preload: {{\n  {account.public_key.decode()}: "{account_jwt}"\n'
        f'  {system.public_key.decode()}: "{system_jwt}"\n}}\n'
    )
    with server_with(tmp_path, config) as server:
        nc = await connect_with(Settings(nats_url=server.url, nats_creds=str(creds)), "t")
        assert nc.is_connected
        await nc.close()
        with pytest.raises(NatsUnavailable):
            await connect_with(Settings(nats_url=server.url), "t", connect_timeout=2.0)


async def test_a_publish_or_kv_write_refused_by_permission_fails_at_once_as_not_permitted(
    tmp_path: Path,
) -> None:
    """Without the race against the server's -ERR, each call would time out and be retried
    for the whole broker budget, then fail as BrokerUnavailable (an election's silence)."""
    config = (
        'authorization { users: [\n'
        '  { user: admin, password: a },\n'
        '  { user: u, password: p, permissions: {\n'
        '      publish: { allow: ["ok.>", "_INBOX.>", "$JS.API.>"] },\n'
        '      subscribe: { allow: ["_INBOX.>"] } } } ] }\n'
    )
    with server_with(tmp_path, config) as server:
        admin = await connect_with(
            Settings(nats_url=server.url, nats_user="admin", nats_password="a"), "t-admin")
        await admin.jetstream().add_stream(name="D", subjects=["denied.>", "ok.>"])
        await admin.jetstream().create_key_value(bucket="B")
        await admin.close()
        nc = await connect_with(Settings(nats_url=server.url, nats_user="u", nats_password="p"),
                                "t-denied")
        js = nc.jetstream()
        try:
            message = ChatMessage(role="user", content="hi")
            assert (await js_publish(js, "ok.x", message)).stream == "D"  # allowed: stored
            with pytest.raises(NotPermitted, match=r"denied\.x"):
                await js_publish(js, "denied.x", message)
            with pytest.raises(NotPermitted, match=r"\$kv\.b\.k"):
                await kv_put(await js.key_value("B"), "k", b"v")
        finally:
            await nc.close()
            forget_permission_errors()
