"""What the server's front door does the same way in one process and in a cluster's ingress: the
API key check, the live page, how long a refused client should wait. No torch: the ingress, which
holds no model, imports it."""
from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Request

RETRY_AFTER_S = 1
PAGE = Path(__file__).with_name("page.html")
WRONG_KEY = "a missing or wrong API key: send Authorization: Bearer KEY"


def key_matches(request: Request, api_key: str | None) -> bool:
    """No key set, or the request's bearer token equals it (compared in constant time)."""
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())
