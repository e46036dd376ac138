"""What every OpenAI request model shares, and the 400 that names a parameter."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from fleet.errors import InvalidRequest


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class InvalidParameter(InvalidRequest):
    """A 400 that names the offending request parameter, as OpenAI's `param` does."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param
