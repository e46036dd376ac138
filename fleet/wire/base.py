"""The base of every wire type: frozen, strict about unknown fields, versioned."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints

SCHEMA_VERSION = 1

# Subject-safe identifiers: no dots, spaces, wildcards or '>' so they can be a subject token.
_TOKEN = r"^[A-Za-z0-9_-]{1,128}$"
TaskId = Annotated[str, StringConstraints(pattern=_TOKEN)]
NodeId = Annotated[str, StringConstraints(pattern=_TOKEN)]
RunnerId = Annotated[str, StringConstraints(pattern=_TOKEN)]
InstanceId = Annotated[str, StringConstraints(pattern=_TOKEN)]
ModelId = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Wire(BaseModel):
    """Every message: immutable, unknown fields rejected, carries the schema version."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    schema_version: Literal[1] = SCHEMA_VERSION


class Part(BaseModel):
    """A nested value inside a message (no schema version of its own)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
