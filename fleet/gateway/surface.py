"""What the gateway offers the packages mounted on its app (the dashboard at /ui): the one
module of fleet.gateway they import, so that the dependency is one-way and small. The gateway
never imports them; whoever composes the app mounts them (fleet/commands/gateway.py)."""

from fleet.gateway.auth import tenant_of
from fleet.gateway.backend import Backend
from fleet.gateway.bodies import image_format
from fleet.gateway.keys import KeyRing
from fleet.gateway.owners import TENANTS_BUCKET, record_of, task_key
from fleet.gateway.resume import resume
from fleet.gateway.route_table import Endpoint, Row, routes
from fleet.gateway.service import gateway_of
from fleet.gateway.sse import EventStream

__all__ = [
    "TENANTS_BUCKET",
    "Backend",
    "Endpoint",
    "EventStream",
    "KeyRing",
    "Row",
    "gateway_of",
    "image_format",
    "record_of",
    "resume",
    "routes",
    "task_key",
    "tenant_of",
]
