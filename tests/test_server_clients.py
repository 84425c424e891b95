"""Real client libraries against `specee serve` with a tiny random model: LangChain's ChatOpenAI
with structured output (a JSON schema, and a forced tool call) and litellm's completion, plain and
with tools. Their answers come back parsed and validated by the libraries themselves."""
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class Point(BaseModel):
    x: int = Field(ge=0, le=99)  # bounded: a random model's digits would otherwise run to max_tokens
    y: int = Field(ge=0, le=99)
    label: Literal["a", "b"]


ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from helpers import tiny_model_directory
    from serve_helpers import running_server

    directory = tiny_model_directory(tmp_path_factory.mktemp("model"), seed=3)
    config = json.loads((directory / "config.json").read_text())  # room for tool instructions in the prompt
    (directory / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    server = running_server("--model", str(directory), "--quantization", "none", "--max-tokens", "120")
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def model_id(server):
    import httpx

    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_the_start_line_says_the_prefix_cache_budget(server):
    assert "specee serving on http://127.0.0.1:" in server.output() and "prefix cache" in server.output()


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_a_validated_pydantic_object(server, model_id, method):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=model_id, max_tokens=120, max_retries=0,
                     timeout=60, temperature=0)
    structured = llm.with_structured_output(Point, method=method, strict=True, include_raw=True)
    answer = structured.invoke("Give me a point.")
    assert answer["parsing_error"] is None, answer["raw"]
    assert isinstance(answer["parsed"], Point) and answer["parsed"].label in ("a", "b")


def test_litellm_completion_plain_and_with_tools(server, model_id, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    litellm = pytest.importorskip("litellm")
    options = dict(model=f"openai/{model_id}", api_base=server.url + "/v1", api_key="unused", num_retries=0,
                   timeout=60)
    plain = litellm.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=6, **options)
    assert plain.choices[0].message.content and plain.usage.completion_tokens >= 1
    called = litellm.completion(messages=[{"role": "user", "content": "add 1 and 2"}], tools=[ADD],
                                tool_choice="required", parallel_tool_calls=False, max_tokens=120, **options)
    [call] = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}


def test_bench_serve_reads_the_servers_own_seconds_through_the_openai_client(server, model_id):
    """`specee bench-serve` measures the server's overhead within each request: its time less the
    prefill and decode seconds the server reports in the usage chunk's `specee.stats`."""
    import time

    from specee.eval.serve_bench import Target, open_client, stream_chat, user

    target = Target("specee dense", "specee serve", server.url, model=model_id,
                    extra_body={"specee": {"spec_method": "none"}})
    start = time.perf_counter()
    reply = stream_chat(open_client(server.url), target, user("Say something."), 8)
    wall = time.perf_counter() - start
    assert reply.completion_tokens > 0 and reply.prompt_tokens > 0
    assert 0 < reply.engine_s < wall
