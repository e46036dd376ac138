"""The gateway's shared parts, made once per app: settings, the NATS backend, metrics, and the
small lookups every route makes (model cards, images named in requests, task ids).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fleet.bus.denials import permission_errors
from fleet.config import Settings
from fleet.errors import FleetError, InvalidRequest, ModelNotFound, ModelUnavailable
from fleet.gateway.auth import tenant_of
from fleet.gateway.backend import Backend
from fleet.gateway.bodies import image_reference
from fleet.gateway.capacity import Capacity
from fleet.gateway.catalogue import Catalogue, ModelState, Unavailable, model_states, refuses_task
from fleet.gateway.fair_share import BUCKET as FAIRNESS_BUCKET
from fleet.gateway.fair_share import FairShare, Ticket
from fleet.gateway.idempotency_seed import SEED
from fleet.gateway.observability import GatewayMetrics
from fleet.gateway.priority import OPEN, priority_of, stamped
from fleet.gateway.relay import Renderer, run_task
from fleet.wire.cluster import ModelCard
from fleet.wire.records import TaskApi, TaskRecord
from fleet.wire.tasks import Task

log = logging.getLogger(__name__)


def new_task_id(prefix: str) -> str:
    # token_urlsafe uses only letters, digits, '-' and '_': safe as a subject token. Under an
    # Idempotency-Key the id derives from the key's seed, so a retry names the same task.
    return f"{prefix}-{SEED.get() or secrets.token_urlsafe(18)}"


def now_utc() -> datetime:
    return datetime.now(UTC)


@dataclass
class Gateway:
    settings: Settings
    backend: Backend
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    capacity: Capacity = field(init=False)
    catalogue: Catalogue = field(init=False)
    fair: FairShare | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.capacity = Capacity(
            self.settings.gateway_max_waiting, self.settings.gateway_streams_per_key
        )
        self.catalogue = Catalogue(self.settings.data_dir, self.backend)

    def cards(self) -> dict[str, ModelCard]:
        return self.catalogue.cards()

    def card_for(self, model: str, task: str) -> ModelCard:
        """The model's card, or 404; a model that cannot do `task` is a 400 before publishing,
        and one that no live node can serve a 503 saying why (not a timeout later)."""
        card = self.catalogue.card(model)
        if card is None:
            raise ModelNotFound(f"the model {model!r} does not exist")
        if why := refuses_task(card, task):
            raise InvalidRequest(why)
        if why := self.catalogue.refuses(card):
            raise ModelUnavailable(why)
        return card

    def availability(self) -> Unavailable | None:
        """Why a model is unavailable, once the nodes are known (else None: unknown)."""
        return self.catalogue.unavailable if self.catalogue.nodes_loaded else None

    def timeout_for(self, requested: float | None) -> float:
        return requested or self.settings.gateway_timeout_s

    async def image_hash(self, url: str, tenant: str | None) -> str:
        """Store a data-URL image in FLEET_IMAGES (once), or check a referenced one exists
        and is the tenant's (sent or made by it); another tenant's reads as missing."""
        reference = image_reference(url)
        if isinstance(reference, bytes):
            sha256 = await self.backend.put_image(reference)
            await self.backend.owners.own_image(sha256, tenant)
            return sha256
        owned = await self.backend.owners.owns_image(reference, tenant)
        if not owned or not await self.backend.has_image(reference):
            raise InvalidRequest(f"image {reference} is not stored in this fleet")
        return reference

    async def fair_turn(self, request: Request, tasks: Sequence[Task]) -> Ticket | None:
        """Wait for the tenant's turn in its task's (model, class) (fleet.gateway.fair_share);
        None on an open gateway (no tenants to be fair among)."""
        tenant = tenant_of(request)
        if tenant is None:
            return None
        policy = request.scope.get("state", {}).get("policy") or OPEN
        return await self.fair_admit(tenant, policy.weight, tasks)

    async def fair_admit(self, tenant: str, weight: float, tasks: Sequence[Task],
                         key: str | None = None) -> Ticket | None:
        """`fair_turn` for a tenant by name: a request's, or a batch job's for its lines
        (`key`: the line's task id, so a job taken over charges each line once)."""
        nc = self.backend.nc
        if self.fair is None or self.fair.nc is not nc:  # first use, or a new connection
            if nc is None:
                return None
            try:
                self.fair = FairShare(nc, await self.backend._bucket(FAIRNESS_BUCKET),
                                      slots=self.model_slots)
            except Exception as exc:  # an older fleet without the bucket: unfair, not down
                log.warning("fair tenants not applied: %s", exc)
                return None
        estimate = sum(getattr(task, "max_tokens", 0) or 0 for task in tasks)
        return await self.fair.admit(tasks[0].model, tasks[0].priority, tenant,
                                     weight, estimate, key)

    def model_slots(self, model: str) -> int:
        """The slots of `model`'s instances as this gateway last saw them (0: none known)."""
        return sum(i.slots for i in self.catalogue.instances.values() if i.model == model)

    async def model_states(self) -> dict[str, ModelState] | None:
        """Placement and readiness per model, or None while NATS cannot tell."""
        try:
            instances = await self.backend.instances()
            runners = await self.backend.runners()
        except FleetError:
            return None
        return model_states(self.cards(), instances, runners)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Up or not, and the details behind it (only for a caller with a key). Not up while
        NATS is unreachable, a stream is missing, or NATS refused this gateway something
        in the last minute (its role lacks a permission)."""
        report: dict[str, Any] = {"nats": {"url": self.backend.url, "connected": False}}
        if not self.backend.connected:
            return False, report
        report["nats"]["connected"] = True
        if denied := permission_errors():
            report["permission_errors"] = [f"{d.operation} {d.subject}" for d in denied]
        try:
            report["streams"] = await self.backend.present()
            depths = await self.backend.queue_depths()
        except FleetError as exc:
            report["error"] = exc.message
            return False, report
        states = await self.model_states() or {}
        report["models"] = {
            model: {"placed": s.placed, "ready": s.ready, "queue_depth": depths.get(model, 0)}
            for model, s in states.items()
        }
        return all(report["streams"].values()) and not denied, report

    async def run(
        self,
        request: Request,
        tasks: Sequence[Task],
        renderer: Renderer,
        *,
        stream: bool,
        resumable: bool,
        timeout_s: float,
        api: TaskApi,
        logprobs: bool = False,
        include_usage: bool = False,
        echo: Sequence[str] = (),
    ) -> Response:
        """Run the request's tasks and answer; every response carries the request's task id
        (TASK_ID_HEADER), and each task gets its TaskRecord first (with its prompt, when a
        completion asked for `echo`: one per task, in order)."""
        # Its class (Fleet-Priority, clamped per tenant) and tenant travel in the task.
        tasks = stamped(tasks, priority_of(request), tenant_of(request))
        asked = TaskRecord(tenant=tenant_of(request), api=api, model=tasks[0].model,
                           created=int(time.time()), logprobs=logprobs,
                           include_usage=include_usage)
        # Within its class, a tenant ahead of the others waiting is held here.
        ticket = await self.fair_turn(request, tasks)
        response = await run_task(
            self.backend,
            self.metrics,
            tasks,
            renderer,
            request.receive,
            stream=stream,
            resumable=resumable,
            timeout_s=timeout_s,
            records=task_records(asked, [task.task_id for task in tasks], echo),
            tenant=tenant_of(request),
            capacity=self.capacity,
            settle=ticket.settle if ticket is not None else None,
            running=ticket.running if ticket is not None else None,
        )
        response.headers.update(task_id_headers([task.task_id for task in tasks]))
        return response


TASK_ID_HEADER = "x-fleet-task-id"


CHOICE_IDS_HEADER = "x-fleet-choice-task-ids"


def request_id(task_ids: Sequence[str]) -> str:
    """A request's id: its task's, or with n > 1 the `<id>` of its choices `<id>-<index>`."""
    return task_ids[0] if len(task_ids) == 1 else task_ids[0].removesuffix("-0")


def task_id_headers(task_ids: Sequence[str]) -> dict[str, str]:
    """The request's task id on every response it gets, streamed or not; with n > 1 the
    request's id (each choice is `<id>-<index>`) and the choices' ids, comma-separated."""
    if len(task_ids) == 1:
        return {TASK_ID_HEADER: task_ids[0]}
    return {TASK_ID_HEADER: request_id(task_ids), CHOICE_IDS_HEADER: ",".join(task_ids)}


def task_records(
    asked: TaskRecord, task_ids: Sequence[str], echo: Sequence[str] = (),
) -> dict[str, TaskRecord]:
    """The record of each task (with its own prompt to echo, if any), and with n > 1 one more
    under the request's id that lists its choices (so it can be cancelled and traced as a
    whole)."""
    records = {
        task_id: asked.model_copy(update={"echo": echo[index]}) if echo else asked
        for index, task_id in enumerate(task_ids)
    }
    if len(task_ids) > 1:
        records[request_id(task_ids)] = asked.model_copy(update={"choices": list(task_ids)})
    return records


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def image_url_for(request: Request) -> Callable[[str], str]:
    """Absolute URLs of stored images, as seen by the client that asked."""
    base = str(request.base_url).rstrip("/")
    return lambda sha256: f"{base}/v1/images/{sha256}"
