"""Who may do what on the dashboard: a tenant key sees its own tasks, an operator key (named
in the keys file, fleet/gateway/keys.py) sees every task and may change the fleet. An open
gateway (no keys) trusts everyone, as its API does."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.gateway.surface import KeyRing, tenant_of


def is_operator(request: Request) -> bool:
    ring: KeyRing = request.app.state.key_ring
    return ring.is_operator(tenant_of(request))


def viewer_tenant(request: Request) -> str | None:
    """The tenant whose tasks this caller may read; None: every task (an operator)."""
    return None if is_operator(request) else tenant_of(request)


def operators_only() -> Response:
    return JSONResponse({"error": "only an operator key may do this (`fleet gateway keys add "
                                  "--operator`)"}, status_code=403)
