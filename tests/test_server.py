"""`specee serve` end to end: one real server process on 127.0.0.1 with the default model, driven
by the official `openai` client (and raw HTTP where a client would refuse to send the input)."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specee.cli as cli
from serve_helpers import rss_bytes

pytestmark = pytest.mark.slow  # a real server with the default model

CHAT = "/v1/chat/completions"
PROMPT = "Name three rivers in Europe."
MEMORY_BOUND = 200 * 2**20  # RSS growth allowed over 100 requests (the model alone is ~550 MB)


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def chat(client, model_id, content=PROMPT, **options):
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": content}],
                                          **options)


def metrics(default_server) -> dict:
    """{(name, sorted labels): value} of every sample."""
    text = httpx.get(default_server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_health_models_and_page(default_server, model_id):
    assert httpx.get(default_server.url + "/health").json()["status"] == "ok"
    assert model_id.startswith("SmolLM2-135M-Instruct")
    page = httpx.get(default_server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/v1/chat/completions" in page.text


def test_chat_greedy_equals_specee_generate(client, model_id, capsys):
    response = chat(client, model_id, max_tokens=24)  # both in their default weight format
    assert cli.main(["generate", PROMPT, "--max-tokens", "24", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert response.usage.completion_tokens == expected["completion_tokens"]
    assert response.usage.prompt_tokens == expected["prompt_tokens"]
    assert response.usage.total_tokens == expected["prompt_tokens"] + expected["completion_tokens"]


DENSE = {"specee": {"spec_method": "none"}}


def test_speculative_modes_through_the_extension_field_match_dense(client, model_id):
    dense = chat(client, model_id, max_tokens=32, extra_body=DENSE).choices[0].message.content
    for spec in ({"spec_method": "hybrid", "tree": "auto"}, {"spec_method": "prompt-lookup"}, {}):
        response = chat(client, model_id, max_tokens=32, extra_body={"specee": spec})
        assert response.choices[0].message.content == dense, spec


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(client, model_id):
    whole = chat(client, model_id, max_tokens=20, extra_body=DENSE)
    chunks = list(chat(client, model_id, max_tokens=20, stream=True, stream_options={"include_usage": True},
                       extra_body=DENSE))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    provenance = [t for c in chunks if c.choices for t in c.model_extra["specee"]["tokens"]]
    assert len(provenance) == whole.usage.completion_tokens
    assert {t["source"] for t in provenance} == {"target"}  # dense: every token is the target's own
    assert {t["exit_layer"] for t in provenance} == {None}  # and ran every layer


def test_the_default_is_auto_and_each_streamed_token_names_the_method_of_its_pass(default_server, client,
                                                                                model_id):
    before = metrics(default_server)
    content = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    chunks = list(chat(client, model_id, content=content, max_tokens=32, stream=True,
                       stream_options={"include_usage": True}))
    after = metrics(default_server)
    tokens = [t for c in chunks if c.choices for t in c.model_extra["specee"]["tokens"]]
    stats = chunks[-1].model_extra["specee"]["stats"]
    assert tokens[0]["method"] is None  # from the prompt's pass
    assert {t["method"] for t in tokens[1:]} == stats["method_passes"].keys() <= {"prompt-lookup", "ngram", "suffix", "none"}
    assert all(t["method"] != "none" for t in tokens if t["source"] == "draft")
    # Drafts the last pass accepted past max_tokens are cut: neither streamed nor counted.
    assert 0 < sum(t["source"] == "draft" for t in tokens) == stats["draft_tokens_accepted"]
    for method, passes in stats["method_passes"].items():
        assert delta(after, before, "specee_method_passes_total", mode="auto", method=method) == passes
    assert delta(after, before, "specee_auto_switches_total", mode="auto") == stats["switches"] > 0
    assert len(stats["switch_log"]) == min(stats["switches"], 32)


def test_early_exit_through_the_extension_field_reports_each_tokens_exit_layer(client, model_id):
    """A low threshold makes passes stop early: the streamed tokens say where, the stats agree."""
    spec = {"exit": "specee", "exit_threshold": 0.3}
    chunks = list(chat(client, model_id, max_tokens=24, stream=True, stream_options={"include_usage": True},
                       extra_body={"specee": spec}))
    tokens = [t for c in chunks if c.choices for t in c.model_extra["specee"]["tokens"]]
    layers = [t["exit_layer"] for t in tokens]
    stats = chunks[-1].model_extra["specee"]["stats"]
    assert layers[0] is None  # the first token comes from the prompt's full pass
    exited = [layer for layer in layers if layer is not None]
    assert exited and all(1 <= layer < 30 for layer in exited)
    assert len(exited) == sum(n for layer, n in stats["exit_histogram"].items() if int(layer) < 30)
    assert stats["avg_forward_layers"] < 30


def test_completions_whole_and_streamed_with_length_and_stop(client, model_id):
    whole = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    streamed = list(client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    cut = whole.choices[0].text.split()[1]  # a stop string inside the answer ends it before itself
    stopped = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert whole.choices[0].text.startswith(stopped.choices[0].text) and cut not in stopped.choices[0].text


def test_seeded_sampling_repeats_and_seeds_differ(client, model_id):
    def sample(seed):
        return chat(client, model_id, max_tokens=16, temperature=1.0, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    # Three seeds giving one 16-token text at temperature 1 would mean the seed is ignored.
    assert len({sample(1), sample(2), sample(3)}) > 1


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_BODIES = [
    (b"{not json", 400, None, "invalid_json"),
    (b'[{"role": "user"}]', 400, None, "invalid_body"),
    (b'"a string"', 400, None, "invalid_body"),
    (json.dumps({"max_tokens": 2}).encode(), 400, "messages", None),
    (json.dumps({"messages": []}).encode(), 400, "messages", None),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "messages.0.role", None),
    (json.dumps({"messages": [{"role": "user", "content": ["hi"]}]}).encode(), 400, "messages.0.content", None),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(), 400, "messages.0", None),
    (json.dumps({**GOOD, "model": "gpt-4o"}).encode(), 404, "model", "model_not_found"),
    (json.dumps({**GOOD, "temperature": -0.1}).encode(), 400, "temperature", None),
    (json.dumps({**GOOD, "temperature": 2.5}).encode(), 400, "temperature", None),
    (json.dumps({**GOOD, "top_p": 0}).encode(), 400, "top_p", None),
    (json.dumps({**GOOD, "top_p": 1.5}).encode(), 400, "top_p", None),
    (json.dumps({**GOOD, "top_k": -1}).encode(), 400, "top_k", None),
    (json.dumps({**GOOD, "max_tokens": 0}).encode(), 400, "max_tokens", None),
    (json.dumps({**GOOD, "max_tokens": "5"}).encode(), 400, "max_tokens", None),
    (json.dumps({**GOOD, "max_completion_tokens": -3}).encode(), 400, "max_completion_tokens", None),
    (json.dumps({**GOOD, "seed": -1}).encode(), 400, "seed", None),
    (json.dumps({**GOOD, "n": 17}).encode(), 400, "n", None),
    (json.dumps({**GOOD, "n": 0}).encode(), 400, "n", None),
    (json.dumps({**GOOD, "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop", None),
    (json.dumps({**GOOD, "stream": "yes"}).encode(), 400, "stream", None),
    (json.dumps({**GOOD, "logit_bias": {"99999999": 5}}).encode(), 400, "logit_bias", "invalid_value"),
    (json.dumps({**GOOD, "logit_bias": {"the": 5}}).encode(), 400, "logit_bias", "invalid_value"),
    (json.dumps({**GOOD, "presence_penalty": 2.5}).encode(), 400, "presence_penalty", None),
    (json.dumps({**GOOD, "frequency_penalty": 1, "specee": {"exit": "specee"}}).encode(), 400, "frequency_penalty",
     None),
    (json.dumps({**GOOD, "top_logprobs": 2}).encode(), 400, "top_logprobs", "invalid_value"),
    (json.dumps({**GOOD, "logprobs": True, "top_logprobs": 21}).encode(), 400, "top_logprobs", None),
    (json.dumps({**GOOD, "logprobs": True, "specee": {"exit": "specee"}}).encode(), 400, "logprobs", None),
    (json.dumps({**GOOD, "response_format": {"type": "xml"}}).encode(), 400, "response_format.type", None),
    (json.dumps({**GOOD, "response_format": {"type": "json_schema"}}).encode(), 400, "response_format", None),
    (json.dumps({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": "{x"}}}
                ).encode(), 400, "response_format.json_schema.schema", None),
    (json.dumps({**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "objectx"}}}}).encode(), 400, "response_format", "invalid_value"),
    (json.dumps({**GOOD, "specee": {"regex": "(unclosed"}}).encode(), 400, "specee.regex", "invalid_value"),
    (json.dumps({**GOOD, "specee": {"grammar": "start: undefined_rule"}}).encode(), 400, "specee.grammar", None),
    (json.dumps({**GOOD, "specee": {"regex": "a+"}, "response_format": {"type": "json_object"}}).encode(), 400,
     "specee.regex", None),
    (json.dumps({**GOOD, "specee": {"regex": "a+", "exit": "rule"}}).encode(), 400, "specee.regex", None),
    (json.dumps({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}],
                 "tool_choice": {"type": "function", "function": {"name": "g"}}}).encode(), 400, "tool_choice", None),
    (json.dumps({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                 "response_format": {"type": "json_object"}}).encode(), 400, "response_format", None),
    (json.dumps({**GOOD, "store": True}).encode(), 400, "store", "unsupported_value"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(),
     400, "messages.0.content", None),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(), 400, "messages.0.content", None),
    (json.dumps({**GOOD, "max_tokens": 9000}).encode(), 400, "max_tokens", "context_length_exceeded"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400, "messages",
     "context_length_exceeded"),
    (json.dumps({**GOOD, "specee": {"spec_method": "telepathy"}}).encode(), 400, "specee.spec_method", None),
    (json.dumps({**GOOD, "specee": {"spec_method": "prompt-lookup", "tree_min_prob": 0.5}}).encode(), 400,
     "specee", None),
    (json.dumps({**GOOD, "specee": {"spec_method": "draft", "draft_model": "/etc/passwd"}}).encode(), 400,
     "specee.draft_model", None),
    (json.dumps({**GOOD, "specee": {"spec_method": "draft", "draft_model": "self:99"}}).encode(), 400, "specee", None),
    (json.dumps({**GOOD, "specee": {"ngram_model": "/tmp/table.pt"}}).encode(), 400, "specee.ngram_model", None),
    (json.dumps({**GOOD, "specee": {"exit": "warp"}}).encode(), 400, "specee.exit", None),
    (json.dumps({**GOOD, "specee": {"exit": "specee", "exit_predictors": "/tmp/x.pt"}}).encode(), 400,
     "specee.exit_predictors", None),
    (json.dumps({**GOOD, "specee": {"exit": "rule", "exit_rule": "0.3,0.9"}}).encode(), 400, "specee", None),
    (json.dumps({**GOOD, "temperature": 0.7, "specee": {"exit": "specee", "spec_method": "hybrid"}}).encode(), 400,
     "temperature", None),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, "invalid_encoding"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None, "invalid_encoding"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}', 413, None, "body_too_large"),
]


@pytest.mark.parametrize("body,status,param,code", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_gets_a_4xx_in_the_openai_error_shape(default_server, body, status, param, code):
    response = httpx.post(default_server.url + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


# What OpenAI clients and agent frameworks send with every request, asking for nothing.
NEUTRAL_FIELDS = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False, "top_logprobs": 0,
                  "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
                  "store": False, "metadata": {}, "service_tier": "auto", "user": "agent-7", "n": 1}


def test_content_parts_and_neutral_fields_are_answered_as_plain_text(default_server, client, model_id):
    plain = httpx.post(default_server.url + CHAT, json={"messages": [{"role": "system", "content": "Be brief."},
                                                                     {"role": "user", "content": "Name a river.\nIn Europe."}],
                                                        "max_tokens": 12}, timeout=60)
    parts = client.chat.completions.create(model=model_id, max_tokens=12, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a river."}, {"type": "text", "text": "In Europe."}]},
    ], **{name: value for name, value in NEUTRAL_FIELDS.items() if name not in ("metadata", "service_tier")},
        extra_body={"metadata": {}, "service_tier": "auto"})
    assert plain.status_code == 200
    assert parts.choices[0].message.content == plain.json()["choices"][0]["message"]["content"] != ""
    completion = httpx.post(default_server.url + "/v1/completions", json={
        "prompt": "The river", "max_tokens": 4, "echo": False, "best_of": 1, "logprobs": 0, "suffix": None,
        "presence_penalty": 0, "frequency_penalty": 0}, timeout=60)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4


def test_penalties_and_logit_bias_apply_and_speculation_keeps_them(client, model_id):
    prompt = "List the days of the week, then list them again."
    plain = chat(client, model_id, content=prompt, max_tokens=48).choices[0].message.content
    penalized = chat(client, model_id, content=prompt, max_tokens=48, presence_penalty=1.5, frequency_penalty=1.0)
    text = penalized.choices[0].message.content
    assert text != plain
    hybrid = chat(client, model_id, content=prompt, max_tokens=48, presence_penalty=1.5, frequency_penalty=1.0,
                  extra_body={"specee": {"spec_method": "hybrid", "tree": "auto"}})
    assert hybrid.choices[0].message.content == text  # greedy: token-identical with the same penalties
    forced = chat(client, model_id, max_tokens=5, logit_bias={"74": 100})  # SmolLM2's "Z"
    assert forced.choices[0].message.content == "ZZZZZ"


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "pets": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_structured_output_follows_the_schema_whole_streamed_and_speculative(client, model_id):
    content = "Describe a fictional person as JSON: name, age and pets."
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    dense = chat(client, model_id, content=content, max_tokens=80, response_format=schema_format)
    person = json.loads(dense.choices[0].message.content)
    assert set(person) == {"name", "age", "pets"} and isinstance(person["age"], int) and len(person["pets"]) <= 3
    assert dense.choices[0].finish_reason == "stop"
    for method in ("hybrid", "eagle", "kangaroo"):  # greedy: token-identical to dense under the same schema
        speculative = chat(client, model_id, content=content, max_tokens=80, response_format=schema_format,
                           extra_body={"specee": {"spec_method": method}})
        assert speculative.choices[0].message.content == dense.choices[0].message.content, method
        assert speculative.model_extra["specee"]["stats"]["draft_tokens_accepted"] > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(
        client, model_id, content=content, max_tokens=80, response_format=schema_format, stream=True,
        extra_body={"specee": {"spec_method": "prompt-lookup"}}) if chunk.choices)
    assert streamed == dense.choices[0].message.content
    plain = chat(client, model_id, content="Say hello.", max_tokens=40, response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)
    answer = chat(client, model_id, content="Is water wet?", max_tokens=20,
                  extra_body={"specee": {"regex": "(Yes|No), [a-z ]+\\."}}).choices[0].message.content
    assert answer.split(",")[0] in ("Yes", "No") and answer.endswith(".")
    completion = client.completions.create(model=model_id, prompt="The colour of the sky:", max_tokens=10,
                                           extra_body={"specee": {"grammar": 'start: " " COLOUR "."\nCOLOUR: "blue" | "grey"'}})
    assert completion.choices[0].text in (" blue.", " grey.")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                          "parameters": {"type": "object", "properties": {
                                              "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


def test_tool_calls_forced_parsed_streamed_and_answered(client, model_id):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = chat(client, model_id, content=question[0]["content"], max_tokens=60, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    required = chat(client, model_id, content=question[0]["content"], max_tokens=60, tools=TOOLS,
                    tool_choice="required", parallel_tool_calls=False,
                    extra_body={"specee": {"spec_method": "hybrid"}})  # a forced call is drafted for free
    assert [c.function.name for c in required.choices[0].message.tool_calls] in (["get_weather"], ["add"])
    chunks = [c for c in chat(client, model_id, content=question[0]["content"], max_tokens=60, tools=TOOLS,
                              tool_choice="required", parallel_tool_calls=False, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.content for d in deltas)  # a call is not content
    pieces = [tc for d in deltas for tc in d.tool_calls or ()]  # the name first, then the arguments as written
    assert {p.index for p in pieces} == {0} and pieces[0].function.arguments == "" and len(pieces) > 2
    streamed = {"name": pieces[0].function.name, "arguments": "".join(p.function.arguments for p in pieces)}
    assert streamed == required.choices[0].message.tool_calls[0].function.model_dump()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call's result goes back as a tool message; a plain answer (no tools offered) comes out as content.
    answer = client.chat.completions.create(model=model_id, max_tokens=30, messages=question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}])
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    auto = chat(client, model_id, content="Write one sentence about the sea.", max_tokens=30, tools=TOOLS)
    assert auto.choices[0].message.content and not auto.choices[0].message.content.startswith("{")
    streamed_auto = "".join(c.choices[0].delta.content or "" for c in chat(
        client, model_id, content="Write one sentence about the sea.", max_tokens=30, tools=TOOLS, stream=True)
        if c.choices)
    assert streamed_auto == auto.choices[0].message.content


def test_n_choices_share_the_prefill_each_as_a_single_request_with_its_seed(client, model_id, default_server):
    # Dense, so that the rows below are one per later token of each choice.
    options = dict(content="Write a short poem about rain.", max_tokens=16, temperature=0.9, seed=21, extra_body=DENSE)
    before = metrics(default_server)
    three = chat(client, model_id, n=3, **options)
    after = metrics(default_server)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1
    for i, text in enumerate(texts):  # choice i samples with seed + i
        assert chat(client, model_id, **(options | {"seed": 21 + i})).choices[0].message.content == text
    single = chat(client, model_id, **options)
    assert three.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert three.usage.completion_tokens == sum(
        chat(client, model_id, **(options | {"seed": 21 + i})).usage.completion_tokens for i in range(3))
    # The prompt ran once: the passes' rows are its tokens and one row per later token of each choice.
    rows = delta(after, before, "specee_shared_pass_rows_total")
    prefilled = three.usage.prompt_tokens - three.usage.prompt_tokens_details.cached_tokens
    assert rows == prefilled + three.usage.completion_tokens - 3
    streamed = {i: "" for i in range(3)}
    for chunk in chat(client, model_id, n=3, stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert list(streamed.values()) == texts
    completions = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=8, n=2,
                                            temperature=1.0, seed=3)
    assert [c.index for c in completions.choices] == [0, 1] and completions.usage.completion_tokens == 16


def test_a_shared_system_prompt_is_prefilled_once_with_the_same_answers(client, model_id, default_server):
    system = {"role": "system", "content": "You are a terse assistant for a bicycle shop. " * 12}
    asked = [[system, {"role": "user", "content": question}] for question in
             ("Do you repair tyres?", "When do you open?", "Do you sell helmets?")]
    before = metrics(default_server)
    first = client.chat.completions.create(model=model_id, messages=asked[0], max_tokens=12)
    later = [client.chat.completions.create(model=model_id, messages=m, max_tokens=12,
                                            extra_body={"specee": {"spec_method": "hybrid"}}) for m in asked[1:]]
    after = metrics(default_server)
    for answer, messages in zip(later, asked[1:]):
        assert answer.usage.prompt_tokens_details.cached_tokens >= 128  # the system prompt's blocks
        cold = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12,
                                              extra_body={"specee": {"prefix_cache": False}})
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert cold.choices[0].message.content == answer.choices[0].message.content
    assert delta(after, before, "specee_prefix_cache_hits_total") >= 2
    assert delta(after, before, "specee_prefix_cache_hit_tokens_total") >= 256
    assert after[("specee_prefix_cache_blocks", ())] > 0 and first.usage.prompt_tokens > 140


def test_concurrent_clients_share_a_system_prompt_and_the_metrics_count_what_usage_says(client, model_id,
                                                                                         default_server):
    system = {"role": "system", "content": "You answer questions about a public library, briefly. " * 12}
    first = client.chat.completions.create(model=model_id, max_tokens=4,
                                           messages=[system, {"role": "user", "content": "Hello."}])
    questions = ["Can I renew a book online?", "Do you lend e-books?", "Is there a quiet room?", "Are you open Sunday?"]
    before = metrics(default_server)
    with ThreadPoolExecutor(len(questions)) as pool:  # batched together by the scheduler
        answers = list(pool.map(lambda q: client.chat.completions.create(
            model=model_id, max_tokens=10, messages=[system, {"role": "user", "content": q}]), questions))
    after = metrics(default_server)
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert min(cached) >= first.usage.prompt_tokens // 32 * 32 - 32 > 0  # the system prompt's blocks, each time
    assert delta(after, before, "specee_prefix_cache_hit_tokens_total") == sum(cached)
    assert delta(after, before, "specee_prefix_cache_lookups_total") == len(questions)
    for q, answer in zip(questions, answers):
        cold = client.chat.completions.create(model=model_id, max_tokens=10, extra_body={"specee": {"prefix_cache": False}},
                                              messages=[system, {"role": "user", "content": q}])
        assert cold.choices[0].message.content == answer.choices[0].message.content


def test_logprobs_are_the_dense_passes_exactly_whole_streamed_and_speculative(client, model_id):
    """The kernels give a row the same bits in any pass, so a speculative pass's accepted rows
    report exactly the log-probabilities dense decoding's one-row passes do."""
    content = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    dense = chat(client, model_id, content=content, max_tokens=16, logprobs=True, top_logprobs=3, extra_body=DENSE)
    hybrid = chat(client, model_id, content=content, max_tokens=16, logprobs=True, top_logprobs=3,
                  extra_body={"specee": {"spec_method": "hybrid", "tree": "auto"}})
    entries = dense.choices[0].logprobs.content
    # One entry per generated token, the end-of-sequence token included (as usage counts it).
    assert len(entries) == dense.usage.completion_tokens and "".join(e.token for e in entries) in (
        dense.choices[0].message.content, dense.choices[0].message.content + "<|im_end|>")
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in entries)
    assert hybrid.model_extra["specee"]["stats"]["draft_tokens_accepted"] > 0
    assert hybrid.choices[0].logprobs.model_dump() == dense.choices[0].logprobs.model_dump()
    streamed = [entry for chunk in chat(client, model_id, content=content, max_tokens=16, logprobs=True,
                                        top_logprobs=3, stream=True) if chunk.choices
                for entry in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    completion = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=4, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]


def test_a_top_p_that_rounds_to_zero_keeps_the_likeliest_token(client, model_id):
    """1e-46 is above 0 as a double but 0 in fp32, where the filter runs: the first token stays."""
    greedy = chat(client, model_id, max_tokens=8).choices[0].message.content
    tiny = chat(client, model_id, max_tokens=8, temperature=1.0, top_p=1e-46, seed=3).choices[0].message.content
    assert tiny == greedy


def test_bad_completion_prompt_and_unknown_route(default_server):
    for body, param in (({"max_tokens": 2}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [""]}, "prompt"),
                        ({"prompt": [10**6]}, "prompt")):
        response = httpx.post(default_server.url + "/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    missing = httpx.get(default_server.url + "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "specee does not serve /v1/nothing-here"


def test_metrics_parse_and_count_the_requests_made(default_server, client, model_id):
    before = metrics(default_server)
    answers = [chat(client, model_id, max_tokens=6), chat(client, model_id, content="Say hello.", max_tokens=5)]
    hybrid = httpx.post(default_server.url + CHAT, json={**GOOD, "max_tokens": 24, "specee": {"spec_method": "hybrid"},
                                                 "messages": [{"role": "user", "content": "Repeat: a b c a b c"}]})
    assert hybrid.status_code == 200
    assert httpx.post(default_server.url + CHAT, json={"messages": []}).status_code == 400
    after = metrics(default_server)
    chat_route = {"route": CHAT}
    assert delta(after, before, "specee_requests_total", **chat_route, status="200") == 3
    assert delta(after, before, "specee_requests_total", **chat_route, status="400") == 1
    assert delta(after, before, "specee_generations_total", outcome="finished") == 3
    usages = [a.usage for a in answers] + [openai.types.CompletionUsage(**hybrid.json()["usage"])]
    assert delta(after, before, "specee_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(after, before, "specee_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta(after, before, "specee_request_latency_seconds_count") == 3
    stats = hybrid.json()["specee"]["stats"]
    assert delta(after, before, "specee_target_passes_total", mode="hybrid") == stats["target_passes"]
    assert delta(after, before, "specee_draft_tokens_accepted_total", mode="hybrid") == stats["draft_tokens_accepted"]
    assert delta(after, before, "specee_draft_tokens_proposed_total", mode="hybrid") == stats["draft_tokens_proposed"]
    reached = delta(after, before, "specee_draft_position_reached_total", mode="hybrid", position="0")
    assert 0 < reached <= stats["target_passes"]
    for method, passes in stats["method_passes"].items():
        assert delta(after, before, "specee_method_passes_total", mode="hybrid", method=method) == passes
    assert after[("specee_queue_length", ())] == 0
    from specee.model.kernels import requested_tier

    assert after[("specee_cpu_kernels_info", (("tier", requested_tier()),))] == 1
    assert 1 <= after[("specee_pass_threads", ())] <= os.cpu_count()


def test_fifty_concurrent_clients_get_correct_answers_in_bounded_memory(default_server, client, model_id):
    prompts = ["Say yes.", "Name a colour.", "Count to three.", "Name a fruit.", "Say no."]
    expected = {p: chat(client, model_id, content=p, max_tokens=3).choices[0].message.content for p in prompts}
    rss_before = rss_bytes(default_server.pid)

    def client_loop(i: int) -> list[bool]:
        answers = []
        for round_ in range(2):  # a bounded loop: two requests per client
            prompt = prompts[(i + round_) % len(prompts)]
            answer = chat(client, model_id, content=prompt, max_tokens=3).choices[0].message.content
            answers.append(answer == expected[prompt])
        return answers

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(client_loop, range(50)))
    assert all(all(r) for r in results)
    assert httpx.get(default_server.url + "/health").json() == {"status": "ok", "queued": 0, "running": 0}
    assert rss_bytes(default_server.pid) - rss_before < MEMORY_BOUND
