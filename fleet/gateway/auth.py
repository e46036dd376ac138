"""The API key check on every request: the `ApiKeys` middleware puts the tenant of the key
sent (fleet.gateway.keys) into the request's state, and routes read it with `tenant_of`.
An open gateway (no API keys) has no tenants and checks nothing."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.errors import Unauthorized
from fleet.gateway import docs, landing
from fleet.gateway.bodies import refuse_with
from fleet.gateway.keys import KeyRing

# Open to anyone: /healthz then answers only up or not; a key shows its details.
PROBE_PATHS = frozenset({"/healthz", "/health", "/openapi.json"})


def tenant_of(request: Request) -> str | None:
    """The tenant of the request's key; None on an open gateway (no keys configured)."""
    return request.scope.get("state", {}).get("tenant")


def authenticated(request: Request) -> bool:
    """A valid key was sent, or no keys are configured (then everyone is trusted)."""
    return bool(request.scope.get("state", {}).get("authenticated"))


class ApiKeys:
    """Bearer (or x-api-key) keys on every route but the probes when keys are configured; each key's
    tenant goes into the request's state for the routes to scope what they answer."""

    def __init__(self, app: ASGIApp, ring: KeyRing, protect_metrics: bool = False) -> None:
        self.app = app
        self.ring = ring
        self.open_paths = PROBE_PATHS if protect_metrics else PROBE_PATHS | {"/metrics"}

    def _tenant(self, scope: Scope) -> str | None:
        """A bearer key, or Anthropic's `x-api-key` header (what its clients send)."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            return self.ring.tenant_of(token)
        return self.ring.tenant_of(headers.get(b"x-api-key", b""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if self.ring.open:
            state.update(tenant=None, authenticated=True)
            return await self.app(scope, receive, send)
        tenant = self._tenant(scope)
        state.update(tenant=tenant, authenticated=tenant is not None,
                     policy=self.ring.policy(tenant))  # priority ceiling, fair weight
        path = scope["path"]
        if tenant is None and path not in self.open_paths and not docs.is_open(path) and (
                path != landing.PAGE):
            refusal = Unauthorized("a valid API key is required: Authorization: Bearer KEY "
                                      "(or x-api-key: KEY)")
            return await refuse_with(refusal)(scope, receive, send)
        await self.app(scope, receive, send)
