"""Tool calls: tools rendered by a template that knows them (Hermes calls) or by our generic system
message, `required` and named choices enforced by the grammar, and calls read out of the answer
whole or as it streams (the real model through the server: tests/test_server.py)."""
import json

import pytest

from helpers import CHATML, tiny_model
from specee.engine import Engine
from specee.server.errors import BadRequest
from specee.server.schemas import ChatRequest, parse
from specee.server.tools import CallReader, ToolPlan, knows_tools

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["unit", "days"]}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                                     "required": ["a"]}}
# A Hermes-style template (Qwen 2.5's shape, shortened): tools into the system turn, calls and
# tool results as their own blocks.
HERMES = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call them as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_content_streams_at_once_and_calls_are_read_whole():
    reader = CallReader(native=False, names={"add"})
    assert reader.feed(" ") == "" and reader.feed("Hi") == " Hi" and reader.feed(" there") == " there"
    assert reader.finish() == ("", [])
    reader = CallReader(native=False, names={"add"})
    assert reader.feed('{"tool_calls": [{"name": "add", ') == "" and reader.feed('"arguments": {"a": 2}}]}') == ""
    content, calls = reader.finish()
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 2})]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    native = CallReader(native=True, names={"add", "get_weather"})
    assert native.feed("<tool_") == ""  # could still open a call: held back
    native.feed('call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert [c["function"]["name"] for c in native.finish()[1]] == ["add", "get_weather"]


@pytest.mark.parametrize("native,text", [(False, '{"tool_calls": [{"name": "delete_all", "arguments": {}}]}'),
                                         (False, '{"tool_calls": [{"name": "add", "arguments": {"a'),
                                         (True, "<tool_call>\n{not json}\n</tool_call>"),
                                         (True, "<tool")])
def test_what_is_not_a_valid_call_of_a_given_tool_is_content(native, text):
    reader = CallReader(native=native, names={"add"})
    sent = reader.feed(text)
    assert sent + reader.finish()[0] == text and reader.finish()[1] == []


@pytest.mark.parametrize("native", [False, True])
def test_a_call_nested_past_pythons_parser_is_no_call_and_no_error(native):
    """A model may write arguments 5,000 levels deep (json.loads raises RecursionError past ~1,000):
    read whole or streamed, such a call is dropped like any invalid one, and valid calls stay."""
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    if native:
        text = f"<tool_call>\n{deep}\n</tool_call>\n<tool_call>\n{ADD_1}\n</tool_call>"
    else:
        text = generic(deep, ADD_1)
    whole = CallReader(native=native, names={"add"})
    whole.feed(text)
    assert named_arguments(whole.finish()[1]) == [("add", {"a": 1})]
    streamed = CallReader(native=native, names={"add"})
    deltas, _ = read_in_pieces(streamed, text, size=997)
    content, calls = streamed.finish()
    assert content == "" and named_arguments(calls) == [("add", {"a": 1})]
    assert [d["function"].get("name") for d in deltas if "id" in d][-1] == "add"


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    return Engine(tiny_model(seed=11, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2,
                                 max_position_embeddings=2048), tiny_tokenizer)


def call_of(engine, plan: ToolPlan, spec_method=None) -> tuple[list[dict], str]:
    messages = plan.conversation([{"role": "user", "content": "the weather for three days"}])
    tokenizer = engine.tokenizer
    ids = tokenizer.encode_prompt(messages, tools=plan.template_tools())
    result = engine.generate(ids, max_tokens=120, grammar=plan.grammar(), spec_method=spec_method)
    reader = plan.reader()
    reader.feed(result.text)
    return reader.finish()[1], tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_required_or_named_call_is_forced_in_the_generic_format(engine, choice):
    plan = ToolPlan(knows_tools(engine.tokenizer.chat_template), [WEATHER, ADD], choice, parallel=False)
    assert not plan.native  # the tiny ChatML template does not render tools
    calls, prompt = call_of(engine, plan)
    assert '"name": "get_weather"' in prompt and "tool_calls" in prompt  # our system message lists the tools
    assert len(calls) == 1
    if choice == "get_weather":
        arguments = json.loads(calls[0]["function"]["arguments"])
        assert calls[0]["function"]["name"] == "get_weather"
        assert arguments["unit"] in ("celsius", "fahrenheit") and 1 <= arguments["days"] <= 7
        assert set(arguments) == {"unit", "days"}  # no arguments the function does not declare


def test_speculation_makes_the_same_call(engine):
    plan = ToolPlan(False, [WEATHER, ADD], "get_weather")
    assert call_of(engine, plan, "prompt-lookup")[0][0]["function"] == call_of(engine, plan)[0][0]["function"]


def test_a_template_that_knows_tools_renders_them_and_gets_hermes_calls(tiny_tokenizer, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", HERMES)
    plan = ToolPlan(knows_tools(HERMES), [WEATHER, ADD], "get_weather")
    assert plan.native
    calls, prompt = call_of(engine, plan)
    assert prompt.startswith("<|im_start|>system\nTools:\n") and '"name": "add"' in prompt
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    # An earlier call and its result, in the template's own blocks.
    history = plan.conversation([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}])
    text = engine.tokenizer.apply_chat_template(history, tools=plan.template_tools())
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n2\n</tool_response>" in text


def test_the_generic_format_writes_earlier_calls_and_results_as_text():
    plan = ToolPlan(False, [ADD], "auto")
    history = plan.conversation([
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}])
    assert history[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert json.loads(history[1]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}
    assert history[2] == {"role": "user", "content": "Result of tool call call_1: 2"}
    assert CHATML  # the tiny template renders any role


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [{"type": "function",
                                                                                   "function": ADD}]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(body, param):
    with pytest.raises(BadRequest) as error:
        parse(ChatRequest, {"messages": [{"role": "user", "content": "hi"}]} | body)
    assert error.value.param == param and error.value.status == 400


def test_tool_messages_and_calls_without_content_are_accepted():
    request = parse(ChatRequest, {"messages": [
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}], "tools": [{"type": "function", "function": ADD}],
        "tool_choice": "auto", "parallel_tool_calls": False})
    assert [m.role for m in request.messages] == ["user", "assistant", "tool"] and request.tool_choice_name == "auto"


@pytest.mark.slow
def test_a_server_with_a_tools_aware_template_answers_the_openai_client_with_calls(tmp_path):
    """A tiny model whose template renders tools, served on 127.0.0.1: a named call and a required
    one come back parsed, whole and streamed, and a tool's result is accepted."""
    import openai

    from helpers import tiny_model_directory
    from serve_helpers import running_server

    directory = tiny_model_directory(tmp_path / "model", seed=3)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": HERMES}))
    model_config = json.loads((directory / "config.json").read_text())  # room for the tools in the prompt
    (directory / "config.json").write_text(json.dumps(model_config | {"max_position_embeddings": 2048}))
    server = running_server("--model", str(directory), "--quantization", "none", "--max-tokens", "200")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
        question = [{"role": "user", "content": "the weather"}]
        named = client.chat.completions.create(model=model, messages=question, tools=tools, tool_choice={
            "type": "function", "function": {"name": "get_weather"}})
        assert named.choices[0].message.tool_calls, named.choices[0]
        [call] = named.choices[0].message.tool_calls
        assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
        chunks = [c for c in client.chat.completions.create(model=model, messages=question, tools=tools,
                                                            tool_choice="required", parallel_tool_calls=False,
                                                            stream=True) if c.choices]
        [streamed] = assemble([tc.model_dump(exclude_none=True) for c in chunks for tc in c.choices[0].delta.tool_calls
                               or ()])
        assert streamed["function"]["name"] in ("get_weather", "add")
        assert isinstance(json.loads(streamed["function"]["arguments"]), dict)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        answer = client.chat.completions.create(model=model, max_tokens=8, tools=tools, tool_choice="none",
                                                messages=question + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        assert answer.choices[0].message.tool_calls is None and answer.usage.completion_tokens >= 1
    finally:
        assert server.stop() == 0, server.output()


# --- Tool calls that end: a cap, repeats dropped and ending the answer, cut answers, streamed calls ---
def assemble(deltas: list[dict]) -> list[dict]:
    """Calls rebuilt from streamed deltas as an OpenAI client does: the first of an index opens the
    call (id, type, name, empty arguments), the others add arguments."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert set(delta) == {"index", "id", "type", "function"} and delta["function"]["arguments"] == ""
            calls[delta["index"]] = {"id": delta["id"], "type": delta["type"], "function": dict(delta["function"])}
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def read_in_pieces(reader: CallReader, text: str, size: int = 3) -> tuple[list[dict], list[tuple[int, dict]]]:
    """Feed `text` a few characters at a time; (all deltas, (characters fed, delta) for each)."""
    deltas, when = [], []
    for end in range(size, len(text) + size, size):
        assert reader.feed(text[end - size:end]) == ""
        for delta in reader.deltas():
            deltas.append(delta)
            when.append((min(end, len(text)), delta))
    return deltas, when


def generic(*calls: str, closed: bool = True) -> str:
    return '{"tool_calls": [' + ", ".join(calls) + ("]}" if closed else "")


ADD_1, ADD_2, ADD_3 = (f'{{"name": "add", "arguments": {{"a": {a}}}}}' for a in (1, 2, 3))


def named_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_repeated_call_is_dropped_and_ends_the_answer():
    reader = CallReader(native=False, names={"add"})
    reader.feed(generic(ADD_1, ADD_2, closed=False))
    assert not reader.ended
    reader.feed(', {"name": "add", "arguments": ')
    assert not reader.ended  # the same name, arguments not written yet: not a repeat yet
    reader.feed('{"a": 1}}')
    assert reader.ended
    assert named_arguments(reader.finish()[1]) == [("add", {"a": 1}), ("add", {"a": 2})]
    swapped = CallReader(native=False, names={"get_weather"})  # the same arguments in another order repeat too
    swapped.feed(generic('{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2}}',
                         '{"name": "get_weather", "arguments": {"days": 2, "unit": "celsius"}}'))
    assert swapped.ended and len(swapped.finish()[1]) == 1


@pytest.mark.parametrize("native", [False, True])
def test_the_most_calls_end_the_answer_and_more_are_dropped(native):
    calls = (ADD_1, ADD_2, ADD_3)
    text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) if native else generic(*calls)
    reader = CallReader(native=native, names={"add"}, max_calls=2)
    reader.feed(text[:text.index(ADD_2) + len(ADD_2)])
    assert reader.ended
    reader.feed(text[text.index(ADD_2) + len(ADD_2):])
    assert named_arguments(reader.finish()[1]) == [("add", {"a": 1}), ("add", {"a": 2})]


@pytest.mark.parametrize("native", [False, True])
def test_a_cut_answer_keeps_its_complete_calls_and_drops_the_partial_one(native):
    partial = '{"name": "add", "arguments": {"a'
    text = f"<tool_call>\n{ADD_1}\n</tool_call>\n<tool_call>\n{partial}" if native else generic(ADD_1, partial,
                                                                                                closed=False)
    reader = CallReader(native=native, names={"add"})
    assert reader.feed(text) == ""
    content, calls = reader.finish(cut=True)
    assert content == "" and named_arguments(calls) == [("add", {"a": 1})]
    only_partial = CallReader(native=native, names={"add"})
    only_partial.feed(text[:text.index(ADD_1) + 20])
    assert only_partial.finish(cut=True) == ("", [])  # no raw JSON as content


@pytest.mark.parametrize("native", [False, True])
def test_streamed_calls_send_the_name_then_the_arguments_as_they_are_written(native):
    long_1 = '{"name": "get_weather", "arguments": {"unit": "celsius", "days": 3}}'
    calls = (long_1, ADD_2, ADD_2, ADD_3)  # the second ADD_2 repeats: never sent, and it ends the answer
    text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) if native else generic(*calls)
    reader = CallReader(native=native, names={"add", "get_weather"})
    deltas, when = read_in_pieces(reader, text)
    assert reader.ended
    streamed = assemble(deltas + reader.deltas())
    assert named_arguments(streamed) == [("get_weather", {"unit": "celsius", "days": 3}), ("add", {"a": 2}),
                                         ("add", {"a": 3})]
    assert [c["id"] for c in streamed] == [c["id"] for c in reader.finish()[1]]
    # The first call's arguments went out in pieces, most of them before the call was complete.
    end_of_first = text.index(long_1) + len(long_1)
    early = [d for fed, d in when if d["index"] == 0 and "id" not in d and fed < end_of_first]
    assert len(early) >= 3 and "".join(d["function"]["arguments"] for d in early) != ""


def matches(grammar, compiler, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(compiler.ll_tokenizer, grammar.source, log_level=0)
    tokens = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("native", [False, True])
def test_the_grammar_allows_at_most_max_calls(engine, native):
    plan = ToolPlan(native, [ADD], "required", max_calls=2)
    for count, allowed in ((1, True), (2, True), (3, False)):
        calls = (ADD_1, ADD_2, ADD_3)[:count]
        text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) if native else generic(*calls)
        assert matches(plan.grammar(), engine.grammars, text) is allowed, (count, text)


def closing_bracket_ban(engine) -> dict[int, float]:
    """A logit bias that keeps the model from closing the list of calls while it has a choice."""
    return {i: -100.0 for i in range(engine.model.config.vocab_size) if "]" in engine.tokenizer.decode([i])}


def test_a_model_repeating_a_call_stops_at_the_repeat(engine):
    """A tool without arguments, and a model kept from closing the list: every call after the
    first repeats it. The grammar's cap alone would let it write max_calls of them."""
    ping = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    plan = ToolPlan(False, [ping], "required", max_calls=5)
    ids = engine.tokenizer.encode_prompt(plan.conversation([{"role": "user", "content": "ping"}]))
    options = dict(max_tokens=300, grammar=plan.grammar(), logit_bias=closing_bracket_ban(engine))
    capped = engine.generate(ids, **options)
    assert capped.text.count('"name": "ping"') == 5 and capped.text.endswith("]}")
    stopped = engine.generate(ids, stop_check=plan.stop_check, **options)
    assert stopped.text.count('"name": "ping"') == 2 and stopped.text.endswith("}") and stopped.finish_reason == "stop"
    reader = plan.reader()
    reader.feed(stopped.text)
    assert named_arguments(reader.finish()[1]) == [("ping", {})]


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from specee.server.app import ServerConfig, create_app
    from specee.server.completions import Defaults

    with TestClient(create_app(engine, ServerConfig("tiny", Defaults({"max_tokens": 300})))) as client:
        yield client


def test_the_server_cuts_to_complete_calls_and_streams_arguments(client, engine):
    """Several calls (the list kept open), cut by max_tokens inside the second: the first comes
    back as a call with finish_reason length; streamed, the calls come in pieces and match."""
    body = {"messages": [{"role": "user", "content": "add"}], "tools": [{"type": "function", "function": ADD}],
            "tool_choice": "required", "logit_bias": {str(i): b for i, b in closing_bracket_ban(engine).items()},
            "specee": {"max_tool_calls": 3}}
    whole = client.post("/v1/chat/completions", json=body | {"logprobs": True}).json()["choices"][0]
    calls = whole["message"]["tool_calls"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None and 1 < len(calls) <= 3
    assert len({c["function"]["arguments"] for c in calls}) == len(calls)  # no call twice
    pieces = [entry["token"] for entry in whole["logprobs"]["content"]]
    text = "".join(pieces)
    second_call = text.index('{"name"', text.index('{"name"') + 1)
    cut_at = next(k for k in range(len(pieces)) if len("".join(pieces[:k])) > second_call + 5)
    cut = client.post("/v1/chat/completions", json=body | {"max_tokens": cut_at}).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert named_arguments(cut["message"]["tool_calls"]) == named_arguments(calls[:1])
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", ())]
    assert named_arguments(assemble(deltas)) == named_arguments(calls)
    assert len(deltas) > 2 * len(calls)  # arguments in more than one piece
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("content" not in c["choices"][0]["delta"] for c in chunks)


def test_max_tool_calls_out_of_range_is_a_400(client):
    body = {"messages": [{"role": "user", "content": "add"}], "tools": [{"type": "function", "function": ADD}],
            "specee": {"max_tool_calls": 0}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "specee.max_tool_calls"
