"""Reading a request's JSON body within limits: its size, the time it may take to arrive, how deep
it nests, and text that is really text. Whatever arrives, a refusal is a 4xx naming the limit."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from starlette.requests import ClientDisconnect

from .json_depth import MAX_JSON_DEPTH, raw_nesting_depth
from .errors import BadRequest

MAX_BODY_BYTES = 1 << 20  # a full 8k-token context is ~40 KB of text; anything near 1 MiB is abuse

class ClientGone(Exception):
    """The client hung up before its request was read: nobody to answer, one log line."""


async def read_json(request: Request, timeout: float) -> object:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large", status=413)
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large", status=413)
    except TimeoutError:
        raise BadRequest(f"the body did not arrive within {timeout:g} s", code="body_timeout", status=408) from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not valid UTF-8: {e}", code="invalid_encoding") from None
    if raw_nesting_depth(bytes(raw)) > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="body_too_deep")

    def no_constants(name: str):
        raise BadRequest(f"malformed JSON: {name} is not a JSON value", code="invalid_json")

    try:
        body = json.loads(text, parse_constant=no_constants)
        # An escaped lone surrogate ("\ud800") decodes to a string that is no text at all.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e}", code="invalid_json") from None
    except UnicodeEncodeError:
        raise BadRequest("the body escapes a lone UTF-16 surrogate, which is not text", code="invalid_encoding") from None
    return body
