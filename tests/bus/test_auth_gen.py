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

from fleet.bus.auth_gen import CONF, generate, read_env, render_accounts
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


async def test_tls_with_the_generated_certificates(tmp_path: Path, tls_folder: Path) -> None:
    for path in tls_folder.iterdir():
        assert mode(path) == 0o600, path
    with EmbeddedNats(tmp_path / "nats", port=0, config=tls_folder / CONF) as server:
        env = read_env(tls_folder / "worker.env")
        assert env["FLEET_NATS_URL"].startswith("tls://")
        mutual = ssl.create_default_context(cafile=env["FLEET_NATS_TLS_CA"])
        mutual.load_cert_chain(env["FLEET_NATS_TLS_CERT"], env["FLEET_NATS_TLS_KEY"])
        url = f"tls://127.0.0.1:{server.port}"
        nc = await connect_as(url, env, tls=mutual)
        await nc.flush()
        await nc.close()
        # Without a client certificate, or without TLS at all, the server refuses.
        server_only = ssl.create_default_context(cafile=env["FLEET_NATS_TLS_CA"])
        with pytest.raises(Exception):  # noqa: B017 - the handshake error varies by OpenSSL
            await connect_as(url, env, tls=server_only)
        with pytest.raises(Exception):  # noqa: B017
            await connect_as(f"nats://127.0.0.1:{server.port}", env)
