"""Request bodies of the OpenAI-compatible API, validated strictly: a wrong type, an out-of-range
value or an unknown field is a 400 naming the parameter, never a silent default."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..decoding.config import request_schema
from ..drafters.registry import find_method
from ..exits.registry import find_exit

MAX_STOP_STRINGS = 4  # OpenAI's limit


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# The `specee` extension field: speculative and early-exit options for this request, declared in
# decoding/config.py. A request that names a spec_method replaces the server's defaults; one that
# does not adjusts them. Paths to tables, draft models or exit predictors are server flags only, so
# a client cannot make the server read its files.
SpecOptions = request_schema(Strict, {"spec_method": find_method, "exit": find_exit})


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    specee: SpecOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or not all(strings):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return strings

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str = Field(min_length=1)


class BadRequest(Exception):
    """A 4xx answer in the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        # Union members add their type name to the location; keep only the request's own keys.
        path = [str(p) for p in first["loc"] if not (isinstance(p, str) and p in ("str", "list[str]"))]
        param = ".".join(path) or None
        message = first["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{param}: {message}" if param else message, param=param,
                         code="invalid_value") from None
