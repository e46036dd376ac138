"""The shipped `ops/nats/auth.conf` on a test server: its four roles with test passwords."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from fleet.bus import denials
from fleet.bus.auth_gen import env_password
from fleet.bus.embedded import EmbeddedNats, ops_dir
from fleet.bus.replies import inbox_prefix
from fleet.bus.roles import ROLES

PASSWORDS = {role: f"test-{role}-secret" for role in ROLES}


@contextmanager
def shipped_auth_server(folder: Path, extra_config: str = "") -> Iterator[str]:
    """A server on the shipped roles config (passwords from its environment, as in
    production), with `extra_config` appended; its URL. The permission errors a test's
    clients met are forgotten after it: they are per process, and another test's gateway must
    not report them."""
    config = ops_dir() / "nats" / "auth.conf"
    if extra_config:
        folder.mkdir(parents=True, exist_ok=True)
        extended = folder / "auth-extended.conf"
        extended.write_text(config.read_text() + "\n" + extra_config + "\n")
        config = extended
    with pytest.MonkeyPatch.context() as env:
        for role, password in PASSWORDS.items():
            env.setenv(env_password(role), password)
        server = EmbeddedNats(folder / "nats", port=0, config=config,
                              log_file=folder / "nats.log")
        server.start()
    try:
        yield server.url
    finally:
        server.stop()
        denials.forget_permission_errors()


async def as_role(url: str, role: str, violations: list[str] | None = None,
                  **options: Any) -> Client:
    """Raw nats-py as `role`, with the inbox prefix its grants allow (as a NATS CLI user
    passes `--inbox-prefix`); the permission violations the server reports are appended to
    `violations` when given."""
    if violations is not None:
        async def on_error(exc: Exception) -> None:
            if "permissions violation" in str(exc).lower():
                violations.append(str(exc))

        options.setdefault("error_cb", on_error)
    return await nats.connect(url, user=role, password=PASSWORDS[role], connect_timeout=5,
                              allow_reconnect=False, inbox_prefix=inbox_prefix(role), **options)
