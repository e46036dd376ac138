"""The shipped `ops/nats/auth.conf` on a test server: its four roles with test passwords."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleet.bus import denials
from fleet.bus.auth_gen import env_password
from fleet.bus.embedded import EmbeddedNats, ops_dir
from fleet.bus.roles import ROLES

PASSWORDS = {role: f"test-{role}-secret" for role in ROLES}


@contextmanager
def shipped_auth_server(folder: Path) -> Iterator[str]:
    """A server on the shipped roles config (passwords from its environment, as in
    production); its URL. The permission errors a test's clients met are forgotten after it:
    they are per process, and another test's gateway must not report them."""
    with pytest.MonkeyPatch.context() as env:
        for role, password in PASSWORDS.items():
            env.setenv(env_password(role), password)
        server = EmbeddedNats(folder / "nats", port=0, config=ops_dir() / "nats" / "auth.conf",
                              log_file=folder / "nats.log")
        server.start()
    try:
        yield server.url
    finally:
        server.stop()
        denials.forget_permission_errors()
