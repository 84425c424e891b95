"""The request surface fuzzed: bodies generated from the server's own request schemas
(hypothesis-jsonschema over the pydantic models' JSON schemas, every field and every type a
field allows, unknown values in loosely typed fields), and arbitrary JSON. Bounded in count and
tokens. Whatever arrives: never a 5xx, never a traceback in the log, the reference request's
answer unchanged afterwards, and the server's memory back within 10% of where it was."""
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from serve_helpers import rss_bytes, running_server
from specee.server.schemas import ChatRequest, CompletionRequest

pytestmark = pytest.mark.slow  # a real server with the default model

# Per route and per kind of body: about a minute in all. A longer hunt: SPECEE_FUZZ_EXAMPLES=500, and
# SPECEE_FUZZ_SEED=N for other bodies than the fixed ones the suite sends.
EXAMPLES = int(os.environ.get("SPECEE_FUZZ_EXAMPLES", 60))
FUZZ_SEED = os.environ.get("SPECEE_FUZZ_SEED")
MAX_TOKENS = 4  # each generation stays short
REFERENCE = {"messages": [{"role": "user", "content": "Name three rivers in Europe."}], "max_tokens": 16}
ROUTES = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=FUZZ_SEED is None, database=None,
                suppress_health_check=list(HealthCheck))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
                    max_leaves=12)


@pytest.fixture(scope="module")
def server():
    running = running_server("--request-timeout", "60")
    yield running
    assert running.stop() == 0, running.output()


def reseeded(test):
    return seed(int(FUZZ_SEED))(test) if FUZZ_SEED is not None else test


def short(body):
    """At most MAX_TOKENS tokens, whatever the body asked for."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                body[name] = min(body[name], MAX_TOKENS)
        if not isinstance(body.get("max_tokens"), int) and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    return body


def send(server, route: str, body) -> None:
    payload = json.dumps(short(body)).encode()
    with httpx.stream("POST", server.url + route, content=payload, headers={"Content-Type": "application/json"},
                      timeout=120) as response:
        text = b"".join(response.iter_bytes()).decode(errors="replace")
        assert response.status_code < 500, (route, payload[:2000], text[:2000])
        if response.status_code >= 400:
            assert "error" in json.loads(text), text


def reference(server) -> str:
    response = httpx.post(server.url + "/v1/chat/completions", json=REFERENCE, timeout=120)
    assert response.status_code == 200
    return response.json()["choices"][0]["message"]["content"]


def test_generated_requests_never_break_the_server(server):
    for _ in range(10):  # warm up: what the first requests allocate for good
        before_answer = reference(server)
    before_memory = rss_bytes(server.pid)

    for route, model in ROUTES.items():
        @reseeded
        @FUZZ
        @given(body=from_schema(model.model_json_schema()))
        def from_the_schema(body):
            send(server, route, body)

        @reseeded
        @FUZZ
        @given(body=JSON | st.dictionaries(st.sampled_from(sorted(model.model_fields)), JSON, max_size=6))
        def arbitrary(body):
            send(server, route, body)

        from_the_schema()
        arbitrary()

    assert reference(server) == before_answer
    # Memory back within 10%, besides what the prefix cache keeps (bounded by its budget).
    cached = next(float(line.split()[-1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
                  if line.startswith("specee_prefix_cache_bytes "))
    assert rss_bytes(server.pid) <= before_memory * 1.10 + cached
    assert "Traceback" not in server.output()
