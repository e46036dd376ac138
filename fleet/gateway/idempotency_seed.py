"""The seed of the request being served under an Idempotency-Key (fleet.gateway.idempotency):
the ids it makes derive from it, so a retry makes the same ones. Its own module, free of
imports, because fleet.gateway.service reads it."""

from __future__ import annotations

from contextvars import ContextVar

SEED: ContextVar[str | None] = ContextVar("idempotency_seed", default=None)
