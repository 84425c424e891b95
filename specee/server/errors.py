"""The OpenAI error shape every 4xx and 5xx answer takes, in one process or through a cluster's
ingress. No torch: the ingress imports it."""
from __future__ import annotations


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
