"""The request surface in process, over a tiny random model: bodies of any depth or character get
a 4xx naming the problem (never a 5xx), a grammar that fails is an error the client sees, unknown
routes say so, /v1/completions takes OpenAI's four prompt forms and echoes the prompt with its
exact log-probabilities, and /tokenize and /detokenize answer as llama-server does."""
import json

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specee.engine import Engine
from specee.server.app import ServerConfig, create_app
from specee.server.json_depth import MAX_JSON_DEPTH, raw_nesting_depth
from specee.server.completions import Defaults
from specee.server.schemas import MAX_SCHEMA_DEPTH, nesting_depth

ROUTES = ("/v1/chat/completions", "/v1/completions")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "the cat", "max_tokens": 2}
KEY = "test-key"
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3),
                    max_leaves=10)


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    # The prefix cache on (a tiny model runs PyTorch's kernels, where it is off by default).
    return Engine(tiny_model(seed=11, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2,
                             max_position_embeddings=1024), tiny_tokenizer, prefix_cache_mb=16)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ServerConfig("tiny", Defaults({"max_tokens": 4})))) as client:
        yield client


def post(client, route: str, body) -> dict:
    """POST a body (raw bytes, or a value sent as JSON); a 4xx must be the OpenAI error shape."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(route, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (route, content[:300], response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
    return response


def nested(depth: int, inner=0):
    value = inner
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


# --- 1. No 5xx from any body -----------------------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=JSON, ensure_ascii=st.booleans())
def test_the_scan_of_raw_bytes_finds_the_depth_of_the_parsed_value(value, ensure_ascii):
    assert raw_nesting_depth(json.dumps(value, ensure_ascii=ensure_ascii).encode()) == nesting_depth(value)


@pytest.mark.parametrize("route", ROUTES)
def test_bodies_nested_too_deep_get_a_400_naming_the_limit(client, route):
    base = CHAT if route == ROUTES[0] else COMPLETION
    opening = json.dumps(base)[:-1]  # the body without its closing brace, to add a field written out
    deep_prompt = ", \"prompt\": " + "[" * 2000 + "0" + "]" * 2000
    deep_schema = ', "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + \
        '{"type": "array", "items": ' * 1000 + '{"type": "string"}' + "}" * 1000 + "}}"
    for body in (b"[" * 100_000, (opening + deep_prompt + "}").encode(), (opening + deep_schema + "}").encode()):
        response = post(client, route, body)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    within_body = {"name": "deep", "schema": nested(MAX_SCHEMA_DEPTH + 1, {"type": "string"})}
    response = post(client, route, base | {"response_format": {"type": "json_schema", "json_schema": within_body}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format.json_schema.schema"
    assert f"nests deeper than {MAX_SCHEMA_DEPTH} levels" in response.json()["error"]["message"]


def test_a_tools_parameters_schema_nested_too_deep_is_a_400(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(MAX_SCHEMA_DEPTH + 1)}}
    response = post(client, ROUTES[0], CHAT | {"tools": [tool]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize("arguments", ["[" * 5000 + "]" * 5000, '{"a": ' * 100 + "1" + "}" * 100, "[" * 100000],
                         ids=["arrays", "objects", "unclosed"])
def test_earlier_call_arguments_nested_too_deep_are_a_400(client, arguments):
    """JSON inside a string escapes the body's depth limit; the prompt parses it (it was a 500:
    RecursionError). Past MAX_JSON_DEPTH it is refused, naming the field."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "3"}], "max_tokens": 2}
    response = post(client, ROUTES[0], body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in response.json()["error"]["message"]
    shallow = call | {"function": {"name": "f", "arguments": "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH}}
    assert post(client, ROUTES[0], body | {"messages": [body["messages"][0], {"role": "assistant", "tool_calls": [
        shallow]}, body["messages"][2]]}).status_code == 200


@pytest.mark.parametrize("key", ["²", "٣", "３", "1e3", " 3", "-3", "9" * 5000])
def test_logit_bias_keys_are_ascii_digit_token_ids(client, key):
    response = post(client, ROUTES[1], COMPLETION | {"logit_bias": {key: 5}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"
    assert post(client, ROUTES[1], COMPLETION | {"logit_bias": {"3": 5}}).status_code == 200


DIGITS = st.characters(categories=["Nd", "No", "Nl"])  # "²", "٣", "Ⅷ": digits or numbers, not ASCII ones
UNICODE_KEYS = st.dictionaries(st.text(DIGITS, min_size=1, max_size=3), st.floats(-100, 100), min_size=1, max_size=3)
FIELDS = ["model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "logit_bias", "logprobs",
          "top_logprobs", "response_format", "tools", "tool_choice", "specee", "echo", "prompt", "messages", "user"]
SHELLS = {"list": ("[", "]"), "object": ('{"k": ', "}")}


@st.composite
def deep_json(draw) -> str:
    """JSON text nested up to 5,000 levels (lists, objects or both), written out: too deep to dump."""
    depth, kinds, leaf = draw(st.integers(0, 5000)), draw(st.sampled_from(["list", "object", "both"])), draw(JSON)
    shells = [SHELLS["list" if kinds == "list" or kinds == "both" and level % 2 else "object"] for level in range(depth)]
    return "".join(o for o, _ in shells) + json.dumps(leaf) + "".join(c for _, c in reversed(shells))


@st.composite
def bodies(draw, route: str) -> bytes:
    """A valid request with one field replaced by anything (deep, unicode keys, any JSON), or any
    JSON text at all."""
    base = CHAT if route == ROUTES[0] else COMPLETION
    kind = draw(st.sampled_from(["field", "deep field", "unicode bias", "whole", "deep whole"]))
    field = draw(st.sampled_from(FIELDS) | st.text(max_size=4))
    if kind == "field":
        return json.dumps(base | {field: draw(JSON)}).encode()
    if kind == "unicode bias":
        return json.dumps(base | {"logit_bias": draw(UNICODE_KEYS)}).encode()
    if kind == "deep field":
        return (json.dumps(base)[:-1] + f", {json.dumps(field)}: " + draw(deep_json()) + "}").encode()
    return (json.dumps(draw(JSON)) if kind == "whole" else draw(deep_json())).encode()


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), route=st.sampled_from(ROUTES))
def test_no_body_of_any_depth_or_character_gets_a_5xx(client, data, route):
    post(client, route, data.draw(bodies(route)))


# JSON schemas as a client might get them wrong: schema keywords with values of any type, nested.
KEYWORDS = ["type", "properties", "required", "items", "prefixItems", "additionalProperties", "$defs", "definitions",
            "$ref", "anyOf", "oneOf", "allOf", "enum", "const", "minimum", "maximum", "minLength", "maxLength",
            "minItems", "maxItems", "pattern", "format", "patternProperties", "not", "if", "then"]
SCHEMA_VALUES = JSON | st.sampled_from(["object", "array", "string", "integer", "#/$defs/a", "#", 10**30, -1])
SCHEMAS = st.recursive(st.dictionaries(st.sampled_from(KEYWORDS), SCHEMA_VALUES, max_size=4),
                       lambda inner: st.dictionaries(st.sampled_from(KEYWORDS), inner | st.lists(inner, max_size=2) |
                                                     st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
                                                     max_size=4), max_leaves=8)


def schema_bodies(schema: dict, strict: bool) -> list[dict]:
    """A schema where a chat request takes one: response_format, and a tool's parameters (forced and `auto`)."""
    format_ = {"type": "json_schema", "json_schema": {"name": "x", "strict": strict, "schema": schema}}
    tools = [{"type": "function", "function": {"name": "f", "strict": strict, "parameters": schema}}]
    return [CHAT | {"response_format": format_}, CHAT | {"tools": tools, "tool_choice": "required"},
            CHAT | {"tools": tools, "tool_choice": "auto"}]


@pytest.mark.parametrize("schema", [{"type": "object", "properties": 5}, {"properties": None}, {"properties": True},
                                    {"type": "object", "properties": {"a": {"type": "object", "properties": 7}}},
                                    {"type": "object", "$defs": [1, 2]}, {"type": "integer", "minimum": 10**30},
                                    {"$ref": [{"aa" + "é" * 60: 1}]}],
                         ids=["properties-int", "properties-null", "properties-true", "nested", "defs-list", "huge-int",
                              "llguidance-panic"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_schema_the_grammar_cannot_read_is_a_400_naming_where_it_came_from(client, schema, strict):
    """These were 500s: strict rules applied to properties that are no object, a tool's $defs that
    are no object, a tool schema llguidance refuses to read, and a panic inside llguidance (its
    message cuts the "é" at byte 100: a BaseException that `except Exception` lets through)."""
    for body, param in zip(schema_bodies(schema, strict), ["response_format", "tools", "tools"]):
        response = post(client, ROUTES[0], body)
        if response.status_code != 200:  # (some are read: llguidance ignores a list of $defs in response_format)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, strict=st.booleans())
def test_no_json_schema_gets_a_5xx(client, schema, strict):
    for body in schema_bodies(schema, strict):
        post(client, ROUTES[0], body)


LEXER_LIMIT = r"(.{0,200}){0,200}x"  # llguidance builds it, then its lexer outgrows its limits a few tokens in


def test_a_grammar_that_fails_mid_answer_is_an_error_the_client_sees(client):
    body = COMPLETION | {"max_tokens": 200, "specee": {"regex": LEXER_LIMIT}}
    whole = post(client, ROUTES[1], body)
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "grammar_failed"
    assert "too many expressions" in whole.json()["error"]["message"]
    events = [line[6:] for line in post(client, ROUTES[1], body | {"stream": True}).text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "grammar_failed"
    assert all("choices" in json.loads(event) for event in events[:-2])


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event_and_done(client, monkeypatch):
    """A bug in shaping a chunk, once the 200 and the first chunks went out: the client gets an
    error event and [DONE] (it was a cut connection), and the server keeps serving."""
    from specee.server.completions import Shaper

    shaped = Shaper.chunk
    calls = []

    def failing_on_the_second(self, event, index=0):
        calls.append(index)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return shaped(self, event, index)

    monkeypatch.setattr(Shaper, "chunk", failing_on_the_second)
    response = post(client, ROUTES[0], CHAT | {"max_tokens": 6, "stream": True, "specee": {"spec_method": "none"}})
    events = [line[6:] for line in response.text.split("\n\n") if line]
    assert response.status_code == 200 and events[-1] == "[DONE]" and len(events) == 3
    assert "choices" in json.loads(events[0])
    assert json.loads(events[1])["error"] == {"message": "the answer failed: RuntimeError", "type": "server_error",
                                              "param": None, "code": "internal_error"}
    monkeypatch.undo()
    assert post(client, ROUTES[0], CHAT | {"stream": True}).text.endswith("data: [DONE]\n\n")


# --- 2. Unknown routes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses", "/v1/audio/speech"])
def test_an_unserved_route_is_a_404_saying_so(client, path):
    for response in (client.post(path, json={"input": "x"}), client.get(path)):
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"specee does not serve {path}"
        assert response.json()["error"]["type"] == "invalid_request_error"


# --- 3. The completions surface ---------------------------------------------------------------------
def test_the_four_prompt_forms_give_the_same_answers_in_openai_order(client, engine):
    texts = ["the cat sat", "one two three"]
    ids = [engine.tokenizer.encode(text) for text in texts]
    sampled = {"max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 2}
    alone = [post(client, ROUTES[1], sampled | {"prompt": text}).json() for text in texts]
    expected = [choice["text"] for answer in alone for choice in answer["choices"]]
    for prompt in (texts, ids):
        answer = post(client, ROUTES[1], sampled | {"prompt": prompt}).json()
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]  # prompt i's n choices at i*n...
        assert [c["text"] for c in answer["choices"]] == expected
        assert answer["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    for i, text in enumerate(texts):
        single = post(client, ROUTES[1], sampled | {"prompt": ids[i]}).json()
        assert [c["text"] for c in single["choices"]] == [c["text"] for c in alone[i]["choices"]]


def test_ignore_eos_decodes_to_the_token_limit_as_vllm_and_llama_server_do(client, engine):
    """Fixed-length benchmarks send `ignore_eos`: end-of-sequence tokens (here made certain by a
    bias) no longer end the answer; without it they do. With a grammar it is a 400."""
    eos = str(min(engine.tokenizer.eos_token_ids))
    stopped = post(client, ROUTES[1], {"prompt": "the cat", "max_tokens": 6, "logit_bias": {eos: 100}}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] <= 1
    for route, prompt in ((ROUTES[1], {"prompt": "the cat"}), (ROUTES[0], {"messages": CHAT["messages"]})):
        full = post(client, route, prompt | {"max_tokens": 6, "logit_bias": {eos: 100}, "ignore_eos": True}).json()
        assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 6, full
    for bad in ({"ignore_eos": 1}, {"ignore_eos": True, "response_format": {"type": "json_object"}}):
        response = post(client, ROUTES[0], CHAT | bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == "ignore_eos", response.text


@pytest.mark.parametrize("prompt", [[], [[]], [""], [5, 300], [[5], [-1]], [5, 1.5], [True], ["a"] * 17])
def test_bad_prompts_are_a_400_naming_the_prompt(client, prompt):
    response = post(client, ROUTES[1], {"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def test_tokenize_and_detokenize_answer_as_llama_server_and_vllm(client, engine):
    text = "the cat sat on the mat, naïve 😀"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    for key in ("content", "prompt"):
        assert post(client, "/tokenize", {key: text}).json() == {"tokens": ids}
    assert post(client, "/tokenize", {"prompt": text, "add_special_tokens": False}).json() == {"tokens": ids}
    assert post(client, "/detokenize", {"tokens": ids}).json() == {"content": text, "prompt": text}
    # vLLM's /tokenizer_info, which lm-eval's remote tokenizer reads (the special tokens as text)
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == engine.tokenizer.chat_template
    assert info["model_max_length"] == engine.context_length
    assert post(client, "/tokenize", {"prompt": info["eos_token"]}).json()["tokens"] == engine.tokenizer.eos_token_ids
    for path, body, param in (("/tokenize", {}, None), ("/tokenize", {"content": "a", "prompt": "b"}, None),
                              ("/tokenize", {"content": 3}, "content"), ("/detokenize", {"tokens": [300]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens")):
        response = post(client, path, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_tokenize_and_detokenize_need_the_key(engine):
    config = ServerConfig("tiny", Defaults({"max_tokens": 4}), api_key=KEY)
    with TestClient(create_app(engine, config)) as keyed:
        for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [5]})):
            assert keyed.post(path, json=body).status_code == 401
            assert keyed.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert keyed.get("/tokenizer_info").status_code == 401
        assert keyed.get("/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# --- 4. Prompt log-probabilities ----------------------------------------------------------------------
def full_prefill_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: the log-softmax of a fresh prefill of the whole prompt, run here."""
    model = engine.model
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(len(ids)), engine.new_cache(len(ids), 1))
    return torch.log_softmax(logits.float(), dim=-1)


PROMPT = "the cat sat on the mat and looked at the dog. Hello there, name three colours: red, green, blue."


def test_echoed_prompt_logprobs_equal_a_fresh_prefill_also_when_the_prefix_cache_holds_the_prompt(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    expected = full_prefill_logprobs(engine, ids)
    echo = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    fresh = post(client, ROUTES[1], echo).json()
    post(client, ROUTES[1], {"prompt": PROMPT, "max_tokens": 2})  # now the prefix cache holds the prompt
    assert post(client, ROUTES[1], {"prompt": PROMPT, "max_tokens": 2}).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] > 0
    again = post(client, ROUTES[1], echo).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # echo prefills the whole prompt
    for answer in (fresh, again):
        [choice] = answer["choices"]
        logprobs = choice["logprobs"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert logprobs["tokens"] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == expected[torch.arange(len(ids) - 1), ids[1:]].tolist()
        for row, top in enumerate(logprobs["top_logprobs"][1:]):
            best = expected[row].topk(2)
            assert top == {engine.tokenizer.decode([i], skip_special_tokens=False): value
                           for i, value in zip(best.indices.tolist(), best.values.tolist())}
        assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids))]
        assert answer["usage"]["completion_tokens"] == 0


def test_a_loglikelihood_request_sums_the_continuations_logprobs(client, engine):
    context, continuation = engine.tokenizer.encode("the cat sat on the"), engine.tokenizer.encode(" mat")
    ids = context + continuation
    answer = post(client, ROUTES[1], {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    served = sum(answer["choices"][0]["logprobs"]["token_logprobs"][len(context):])
    expected = full_prefill_logprobs(engine, ids)[torch.arange(len(context) - 1, len(ids) - 1), continuation].sum()
    assert served == pytest.approx(expected.item(), rel=1e-6)


def test_a_prompt_that_fills_the_context_is_scored_with_max_tokens_0(client, engine):
    ids = [(7 * i) % 200 + 50 for i in range(engine.context_length)]  # the whole context
    answer = post(client, ROUTES[1], {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    expected = full_prefill_logprobs(engine, ids)[torch.arange(len(ids) - 1), ids[1:]]
    assert answer["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-5)
    generating = post(client, ROUTES[1], {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0})
    assert generating.status_code == 400 and generating.json()["error"]["code"] == "context_length_exceeded"
    over = post(client, ROUTES[1], {"prompt": ids + [5], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


def test_echo_prepends_the_prompt_and_leaves_the_answer_as_it_was(client):
    plain = post(client, ROUTES[1], {"prompt": PROMPT, "max_tokens": 6, "logprobs": 1}).json()["choices"][0]
    echoed = post(client, ROUTES[1], {"prompt": PROMPT, "max_tokens": 6, "echo": True}).json()["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"] and echoed["logprobs"] is None
    both = post(client, ROUTES[1], {"prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 1}).json()
    shaped = both["choices"][0]["logprobs"]
    generated = len(plain["logprobs"]["tokens"])
    assert shaped["tokens"][-generated:] == plain["logprobs"]["tokens"]
    # The tiny model runs PyTorch's kernels, whose last bits follow a pass's row count, and `auto`
    # drafts by measured time: equal to rounding (the compiled kernels' rows are exact:
    # test_batch_invariance.py).
    assert shaped["token_logprobs"][-generated:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert shaped["text_offset"][-generated] == len(PROMPT)
    events = [json.loads(line[6:]) for line in post(client, ROUTES[1], {
        "prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 1, "stream": True}).text.split("\n\n")
        if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == both["choices"][0]["text"]
    streamed = [value for e in events for value in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(shaped["token_logprobs"][1:], abs=1e-5)
    assert post(client, ROUTES[1], {"prompt": PROMPT, "max_tokens": 0}).json()["error"]["param"] == "max_tokens"
