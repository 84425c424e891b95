"""Strict schemas as OpenAI defines them: with `strict: true` (response_format's json_schema, a
tool's function) every object is closed and requires all its properties wherever the schema does
not say otherwise, so the grammar refuses extra keys and missing ones at every level."""
import json

import llguidance
import pytest
from fastapi.testclient import TestClient

from helpers import tiny_model
from specee.engine import Engine
from specee.grammar import Grammar, GrammarCompiler, strict_schema
from specee.server.app import ServerConfig, create_app
from specee.server.completions import Defaults
from specee.server.tools import ToolPlan

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
# Objects at three places: the top, a property's value, an array's items inside a $ref'd definition.
SHAPE = {"type": "object", "properties": {"name": {"type": "string"}, "center": POINT,
                                          "corners": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
         "$defs": {"point": POINT}}


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size)


def matches(compiler, grammar: Grammar, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    matcher = llguidance.LLMatcher(compiler.ll_tokenizer, grammar.source, log_level=0)
    tokens = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and \
        matcher.is_accepting()


def test_strict_closes_every_object_and_requires_its_properties():
    strict = strict_schema(SHAPE)
    for obj in (strict, strict["properties"]["center"], strict["$defs"]["point"]):
        assert obj["additionalProperties"] is False and obj["required"] == list(obj["properties"])
    assert SHAPE["properties"]["center"] == POINT and "required" not in POINT  # the request's schema is untouched
    follows_the_rules = strict_schema(SHAPE)
    assert strict_schema(follows_the_rules) == follows_the_rules  # a schema OpenAI accepts is unchanged


def test_what_a_strict_schema_says_itself_is_kept():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "required": ["a"], "additionalProperties": {"type": "integer"},
              "anyOf": [{"properties": {"c": {"type": "object"}}}]}
    strict = strict_schema(schema)
    assert strict["required"] == ["a"] and strict["additionalProperties"] == {"type": "integer"}
    assert strict["anyOf"][0]["additionalProperties"] is False  # untyped, with properties: an object
    assert strict["anyOf"][0]["properties"]["c"] == {"type": "object", "additionalProperties": False, "required": []}


def test_the_strict_grammar_refuses_extra_and_missing_keys_at_every_level(compiler):
    loose, strict = Grammar.json_schema(SHAPE), Grammar.json_schema(strict_schema(SHAPE))
    whole = '{"name": "sq", "center": {"x": 1, "y": 2}, "corners": [{"x": 0, "y": 0}]}'
    assert matches(compiler, strict, whole) and matches(compiler, loose, whole)
    for extra in ('{"name": "sq", "center": {"x": 1, "y": 2}, "corners": [], "z": 3}',
                  '{"name": "sq", "center": {"x": 1, "y": 2, "z": 3}, "corners": []}',
                  '{"name": "sq", "center": {"x": 1, "y": 2}, "corners": [{"x": 0, "y": 0, "z": 0}]}'):
        assert matches(compiler, loose, extra), extra  # what strict changes: without it, extra keys pass
        assert not matches(compiler, strict, extra), extra
    for missing in ('{"name": "sq", "center": {"x": 1}, "corners": []}', '{"name": "sq", "corners": []}'):
        assert matches(compiler, loose, missing) and not matches(compiler, strict, missing), missing


def test_a_strict_tools_arguments_are_closed_at_every_level(compiler):
    tool = {"name": "draw", "parameters": SHAPE, "strict": True}
    call = '{"tool_calls": [{"name": "draw", "arguments": {"name": "sq", "center": {"x": 1, "y": 2}, "corners": []}}]}'
    nested_extra = call.replace('"y": 2}', '"y": 2, "z": 3}')
    strict_plan, loose_plan = ToolPlan(False, [tool], "required"), ToolPlan(False, [tool | {"strict": False}], "required")
    assert matches(compiler, strict_plan.grammar(), call)
    assert not matches(compiler, strict_plan.grammar(), nested_extra)
    assert matches(compiler, loose_plan.grammar(), nested_extra)  # non-strict: closed at the top level only


@pytest.fixture(scope="module")
def client(tiny_tokenizer):
    engine = Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2,
                               max_position_embeddings=1024), tiny_tokenizer)
    with TestClient(create_app(engine, ServerConfig("tiny", Defaults({"max_tokens": 200})))) as client:
        yield client


def keys_at_every_level(value) -> list[set]:
    found = [set(value)] if isinstance(value, dict) else []
    for child in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        found += keys_at_every_level(child)
    return found


def test_a_strict_response_format_answer_has_exactly_the_declared_keys(client):
    schema = {"type": "object", "properties": {"center": POINT, "label": {"enum": ["a", "b"]}}}
    body = {"messages": [{"role": "user", "content": "a point"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": schema}}}
    reply = client.post("/v1/chat/completions", json=body).json()
    answer = json.loads(reply["choices"][0]["message"]["content"])
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert keys_at_every_level(answer) == [{"center", "label"}, {"x", "y"}]


def test_a_strict_tool_call_has_exactly_the_declared_arguments(client):
    tool = {"type": "function", "function": {"name": "move", "strict": True, "parameters": {
        "type": "object", "properties": {"to": POINT}}}}
    body = {"messages": [{"role": "user", "content": "move"}], "tools": [tool], "tool_choice": "required"}
    reply = client.post("/v1/chat/completions", json=body).json()
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert calls and all(keys_at_every_level(json.loads(call["function"]["arguments"])) == [{"to"}, {"x", "y"}]
                         for call in calls)
