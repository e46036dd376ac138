"""`fleet nats --auth [--tls]`: private files, a config nats-server accepts, each role's
credentials let it in (and only it), TLS with the generated certificates, `fleet nats` serving
secured by itself, and `fleet nats --provision` as the operator."""

from __future__ import annotations

import re
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from fleet.bus.auth_gen import CONF, generate, read_env, render_accounts, sign_certificate
from fleet.bus.embedded import EmbeddedNats, server_binary
from fleet.bus.roles import ROLES

FLEET = [sys.executable, "-m", "fleet.cli"]


def fleet(data_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEET, "--data-dir", str(data_dir), *args], capture_output=True,
                          text=True, timeout=timeout)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def generated(tmp_path: Path) -> Path:
    done = fleet(tmp_path, "nats", "--auth")
    assert done.returncode == 0, done.stderr
    assert "worker.env" in done.stdout and "fleet worker" in done.stdout
    return tmp_path / "auth"


@pytest.fixture
def secured_server(tmp_path: Path, generated: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path / "nats", port=0, config=generated / CONF) as server:
        yield server


async def connect_as(url: str, env: dict[str, str], **options: object) -> nats.NATS:
    return await nats.connect(url, user=env["FLEET_NATS_USER"],
                              password=env["FLEET_NATS_PASSWORD"], allow_reconnect=False,
                              max_reconnect_attempts=0, connect_timeout=5, **options)


def test_every_generated_file_is_private(generated: Path) -> None:
    assert mode(generated) == 0o700
    names = {path.name for path in generated.iterdir()}
    assert names == {CONF, *(f"{role}.env" for role in ROLES)}
    for path in generated.iterdir():
        assert mode(path) == 0o600, path


def test_the_config_grants_each_role_its_table_with_its_own_secret(generated: Path) -> None:
    envs = {role: read_env(generated / f"{role}.env") for role in ROLES}
    passwords = {role: envs[role]["FLEET_NATS_PASSWORD"] for role in ROLES}
    assert len(set(passwords.values())) == len(ROLES)
    assert all(len(p) >= 40 for p in passwords.values())  # 32 random bytes, URL-safe
    conf = (generated / CONF).read_text()
    assert render_accounts({r: f'"{p}"' for r, p in passwords.items()}) in conf
    checked = subprocess.run([str(server_binary()), "-c", str(generated / CONF), "-t"],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_generating_again_rotates_every_secret(tmp_path: Path, generated: Path) -> None:
    before = {role: read_env(generated / f"{role}.env") for role in ROLES}
    assert fleet(tmp_path, "nats", "--auth").returncode == 0
    after = {role: read_env(generated / f"{role}.env") for role in ROLES}
    for role in ROLES:
        assert before[role]["FLEET_NATS_PASSWORD"] != after[role]["FLEET_NATS_PASSWORD"]


async def test_each_role_connects_with_its_file_and_only_with_it(
    secured_server: EmbeddedNats, generated: Path
) -> None:
    for role in ROLES:
        env = read_env(generated / f"{role}.env")
        nc = await connect_as(secured_server.url, env)
        await nc.flush()
        await nc.close()
        wrong = {**env, "FLEET_NATS_PASSWORD": env["FLEET_NATS_PASSWORD"][:-1] + "x"}
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await connect_as(secured_server.url, wrong)
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(secured_server.url, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=5)


def test_fleet_nats_serves_secured_by_itself_and_provisions_as_the_operator(
    tmp_path: Path, generated: Path
) -> None:
    server = subprocess.Popen([*FLEET, "--data-dir", str(tmp_path), "nats", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        banner = server.stdout.readline()
        assert "users and secrets from" in banner, banner
        url = re.search(r"(nats://\S+?),", banner)
        assert url, banner
        env = {"FLEET_NATS_URL": url.group(1), "PATH": "/usr/bin:/bin"}
        operator = read_env(generated / "operator.env")
        provisioned = subprocess.run(
            [*FLEET, "--data-dir", str(tmp_path), "nats", "--provision"], capture_output=True,
            text=True, timeout=60, env={**env, **operator, "FLEET_NATS_URL": url.group(1)},
        )
        assert provisioned.returncode == 0, provisioned.stderr
        assert re.search(r"FLEET_TASKS\s+created", provisioned.stdout), provisioned.stdout
    finally:
        server.terminate()
        server.wait(20)


@pytest.fixture
def tls_folder(tmp_path: Path) -> Path:
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        pytest.skip("openssl is not installed")
    return generate(tmp_path / "tls-data", tls=True)


def _mutual(env: dict[str, str], cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=env["FLEET_NATS_TLS_CA"])
    context.load_cert_chain(cert or env["FLEET_NATS_TLS_CERT"], key or env["FLEET_NATS_TLS_KEY"])
    return context


async def _by_certificate(url: str, tls: ssl.SSLContext, **options: object) -> nats.NATS:
    return await nats.connect(url, tls=tls, allow_reconnect=False, max_reconnect_attempts=0,
                              connect_timeout=5, **options)


async def test_tls_with_the_generated_certificates(tmp_path: Path, tls_folder: Path) -> None:
    for path in tls_folder.iterdir():
        assert mode(path) == 0o600, path
    assert "verify_and_map: true" in (tls_folder / CONF).read_text()
    with EmbeddedNats(tmp_path / "nats", port=0, config=tls_folder / CONF) as server:
        env = read_env(tls_folder / "worker.env")
        assert env["FLEET_NATS_URL"].startswith("tls://")
        assert "FLEET_NATS_USER" not in env and "FLEET_NATS_PASSWORD" not in env
        url = f"tls://127.0.0.1:{server.port}"
        nc = await _by_certificate(url, _mutual(env))
        await nc.flush()
        await nc.close()
        # Without a client certificate, or without TLS at all, the server refuses.
        server_only = ssl.create_default_context(cafile=env["FLEET_NATS_TLS_CA"])
        with pytest.raises(Exception):  # noqa: B017 - the handshake error varies by OpenSSL
            await _by_certificate(url, server_only)
        with pytest.raises(Exception):  # noqa: B017
            await nats.connect(f"nats://127.0.0.1:{server.port}", allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=5)


async def _permitted(nc: nats.NATS, violations: list[str], subject: str) -> bool:
    """Whether the server lets this connection subscribe to `subject` (no violation)."""
    before = len(violations)
    await nc.subscribe(subject)
    await nc.flush(timeout=5)
    await nc.flush(timeout=5)
    return len(violations) == before


async def test_a_certificate_is_its_role(tmp_path: Path, tls_folder: Path) -> None:
    """verify_and_map: the role comes from the certificate. A worker certificate gets the
    worker's grants, a client certificate the client's; a user name in the connect request
    is refused (no pairing a certificate with another role's password), and a certificate
    the CA signed for a name that is no role is not let in."""
    with EmbeddedNats(tmp_path / "nats", port=0, config=tls_folder / CONF) as server:
        url = f"tls://127.0.0.1:{server.port}"
        for role, may_answer_asks in (("worker", True), ("client", False)):
            env = read_env(tls_folder / f"{role}.env")
            violations: list[str] = []

            async def on_error(exc: Exception, seen: list[str] = violations) -> None:
                if "permissions violation" in str(exc).lower():
                    seen.append(str(exc))

            nc = await _by_certificate(url, _mutual(env), error_cb=on_error,
                                       inbox_prefix=f"_INBOX.{role}")
            try:
                assert await _permitted(nc, violations, "fleet.ask.*") is may_answer_asks
                assert await _permitted(nc, violations, "fleet.out.some-task")
            finally:
                await nc.close()
        worker = read_env(tls_folder / "worker.env")
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await _by_certificate(url, _mutual(worker), user="operator", password="anything")
        sign_certificate(tls_folder, "intruder", "/CN=intruder", "extendedKeyUsage=clientAuth\n",
                tls_folder / "ca-cert.pem", tls_folder / "ca-key.pem")
        intruder = _mutual(worker, str(tls_folder / "intruder-cert.pem"),
                           str(tls_folder / "intruder-key.pem"))
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await _by_certificate(url, intruder)
