"""How deep a JSON text nests, found without parsing it: the parsers and validators that read a
body (or JSON inside one of its strings) recurse once a level, so depth is checked before them."""
from __future__ import annotations

import numpy as np

# OpenAI's bodies nest under 10 levels (a JSON schema inside one is held to MAX_SCHEMA_DEPTH).
MAX_JSON_DEPTH = 64


def raw_nesting_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, found without parsing it (so without
    recursion) in one vectorised scan: brackets count outside strings only. Exact for valid JSON;
    for malformed JSON some number, and the parser refuses that text anyway. UTF-8 never puts
    these ASCII bytes inside a multi-byte character."""
    data = np.frombuffer(raw, dtype=np.uint8)
    position = np.arange(len(data))
    # A quote is escaped when an odd run of backslashes stands right before it.
    last_plain = np.maximum.accumulate(np.where(data != ord("\\"), position, -1))
    before = np.concatenate(([-1], last_plain[:-1]))  # the last non-backslash before each byte
    backslashes_before = position - 1 - before
    quote = (data == ord('"')) & (backslashes_before % 2 == 0)
    inside_string = np.cumsum(quote) % 2 == 1  # (the quotes themselves are no brackets either way)
    opens = ((data == ord("[")) | (data == ord("{"))) & ~inside_string
    closes = ((data == ord("]")) | (data == ord("}"))) & ~inside_string
    return int(np.cumsum(opens.astype(np.int64) - closes).max(initial=0))
