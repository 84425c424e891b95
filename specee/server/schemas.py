"""Request bodies of the OpenAI-compatible API, validated strictly: a wrong type, an out-of-range
value or an unknown field is a 400 naming the parameter, never a silent default."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..drafters.registry import find_method
from ..exits.registry import find_exit
from ..grammar import Grammar, strict_schema
from ..sampling import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS
from ..strategies.config import request_schema
from .calls import DEFAULT_MAX_TOOL_CALLS, MAX_TOOL_CALLS
from .errors import BadRequest
from .json_depth import MAX_JSON_DEPTH, raw_nesting_depth

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 16  # n: each choice holds a batch slot while it runs
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
# Levels of arrays and objects in a JSON schema (response_format, a tool's parameters): real
# schemas nest a few levels; the grammar compiler and validators walk them level by level.
MAX_SCHEMA_DEPTH = 32
# A logit_bias key: a token id in ASCII digits ("²" and "٣" are digits to str.isdigit, not ids).
TOKEN_ID = re.compile(r"[0-9]{1,9}")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# The `specee` extension field: speculative and early-exit options for this request, declared in
# strategies/config.py. A request that names a spec_method replaces the server's defaults; one that
# does not adjusts them. Paths to tables, draft models or exit predictors are server flags only, so
# a client cannot make the server read its files.
SpecOptions = request_schema(Strict, {"spec_method": find_method, "exit": find_exit})
MAX_GRAMMAR_CHARS = 100_000  # a regex or Lark grammar; a JSON schema is bounded by the body size


class Extension(SpecOptions):
    """`specee`: the decoding options above, a constraint beyond OpenAI's JSON ones, and whether
    the prefix cache serves this request."""

    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)  # the answer matches it whole
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)  # Lark, as llguidance reads it
    prefix_cache: bool | None = None  # false: neither reuse nor keep this request's prefix
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_TOOL_CALLS)  # calls per answer (default 8)

    @property
    def decoding(self) -> dict:
        return self.model_dump(exclude_none=True, exclude={"regex", "grammar", "prefix_cache", "max_tool_calls"})


def nesting_depth(value: object) -> int:
    """Levels of arrays and objects in a parsed JSON value, counted without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def shallow_schema(schema):
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


class JsonSchema(Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict | bool = Field(True, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _shallow(cls, schema):
        return shallow_schema(schema)

    @property
    def closed_schema(self) -> dict | bool:
        """The schema the answer follows: under strict, OpenAI's rules (closed objects, all required)."""
        return strict_schema(self.schema_) if self.strict else self.schema_


class ResponseFormat(Strict):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self


class StreamOptions(Strict):
    include_usage: bool = False


# Standard fields this server cannot honour yet, each with the value that asks for nothing (the
# default an OpenAI client may send anyway): that value is accepted, any other is a 400 saying so.
NEUTRAL = {
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class Sampling(Strict):
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, sharing the prompt's prefill
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    specee: Extension | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    ignore_eos: bool = False  # vLLM's and llama-server's: run to max_tokens past end-of-sequence tokens
    # NEUTRAL's fields, typed loosely here and checked by value in _neutral.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    @model_validator(mode="after")
    def _neutral(self):
        for name, values in NEUTRAL.items():
            value = getattr(self, name, None)
            if not any(same(value, neutral) for neutral in values):
                raise ParameterError(name, f"{value!r} is not supported by this server yet; leave it out or "
                                           f"send {values[1]!r}")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for token, value in (bias or {}).items():
            if not TOKEN_ID.fullmatch(token):
                raise ValueError(f"keys are token ids in ASCII digits, got {token[:20]!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
        return bias

    @property
    def token_bias(self) -> dict[int, float] | None:
        return {int(token): value for token, value in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or not all(strings):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return strings

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def grammar(self) -> tuple[Grammar, str] | None:
        """The constraint the request puts on its answer and the parameter it came from, if any."""
        asked = []
        if self.response_format is not None and self.response_format.type == "json_object":
            asked.append((Grammar.json_object, (), "response_format"))
        elif self.response_format is not None and self.response_format.type == "json_schema":
            asked.append((Grammar.json_schema, (self.response_format.json_schema.closed_schema,), "response_format"))
        for name in ("regex", "grammar"):
            if self.specee is not None and getattr(self.specee, name) is not None:
                make = Grammar.regex if name == "regex" else Grammar.lark
                asked.append((make, (getattr(self.specee, name),), f"specee.{name}"))
        if len(asked) > 1:
            raise BadRequest(f"{asked[1][2]}: one constraint per request (also {asked[0][2]})", param=asked[1][2],
                             code="invalid_value")
        if not asked:
            return None
        make, args, param = asked[0]
        try:
            return make(*args), param
        except ValueError as e:
            raise BadRequest(f"{param}: {e}", param=param, code="invalid_value") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ParameterError(ValueError):
    """A value a validator refuses, with the request parameter to name in the 400."""

    def __init__(self, param: str, message: str, code: str = "unsupported_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def same(value, neutral) -> bool:
    """Equal as JSON values: False is not 0, and 0 is 0.0."""
    if isinstance(value, bool) or isinstance(neutral, bool) or value is None or neutral is None:
        return value is neutral
    return type(value) in (int, float) and type(neutral) in (int, float) and value == neutral or \
        type(value) is type(neutral) and value == neutral


class TextPart(Strict):
    type: Literal["text"]
    text: str


# Parts a multimodal model reads; this engine's models read text only.
OTHER_MODALITIES = {"image_url": "images", "input_audio": "audio", "file": "files", "video_url": "video"}


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _shallow(cls, arguments):
        # JSON inside a string: the body's depth limit never saw it, and the prompt parses it.
        if raw_nesting_depth(arguments.encode("utf-8", "surrogatepass")) > MAX_JSON_DEPTH:
            raise ValueError(f"the arguments nest deeper than {MAX_JSON_DEPTH} levels")
        return arguments


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may have tool_calls instead)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in OTHER_MODALITIES:
                raise ValueError(f"this model reads text only, not {OTHER_MODALITIES[kind]} (a {kind!r} part)")
        return content

    def for_template(self) -> dict:
        """The message as the chat template reads it: text parts joined by newlines (as vLLM
        joins them), a developer message as the system message it replaces."""
        content = self.content if isinstance(self.content, (str, type(None))) else "\n".join(
            part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        extra = {"name": self.name, "tool_call_id": self.tool_call_id,
                 "tool_calls": [call.model_dump() for call in self.tool_calls] if self.tool_calls else None}
        return message | {key: value for key, value in extra.items() if value is not None}


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _shallow(cls, schema):
        return shallow_schema(schema)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ParameterError("top_logprobs", "needs logprobs: true", code="invalid_value")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = {tool.function.name for tool in self.tools or ()}
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ParameterError("tool_choice", f"names {self.tool_choice.function.name!r}, which is not in tools",
                                 code="invalid_value")
        if self.tool_choice == "required" and not names:
            raise ParameterError("tool_choice", "required needs tools", code="invalid_value")
        return self

    @property
    def max_tool_calls(self) -> int:
        asked = self.specee.max_tool_calls if self.specee is not None else None
        return asked if asked is not None else DEFAULT_MAX_TOOL_CALLS

    @property
    def tool_choice_name(self) -> str:
        """none, auto, required, or the name of the function to call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @property
    def logprobs_asked(self) -> int | None:
        """The alternatives per token the engine reports, or None for no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None
    modalities: Any = None


class CompletionRequest(Sampling):
    # OpenAI's four forms: a text, texts (each its own choices), token ids, lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt alone
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # alternatives per token
    echo: bool = False  # the prompt before the answer, and its tokens' log-probabilities with logprobs

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """The alternatives per prompt token reported (echo with logprobs), or None."""
        return self.logprobs if self.echo else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids."""
        prompt = self.prompt
        return [prompt] if isinstance(prompt, str) or prompt and isinstance(prompt[0], int) else list(prompt)

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) or prompt and isinstance(prompt[0], int) else prompt
        if not prompts or not all(prompts):
            raise ValueError("an empty prompt: send text or token ids")
        if any(token < 0 for ids in prompts if not isinstance(ids, str) for token in ids):
            raise ValueError("token ids are not negative")
        return prompt

    @model_validator(mode="after")
    def _choices_and_echo(self):
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ParameterError("prompt", f"{len(self.prompts)} prompts of n={self.n} choices each: at most "
                                           f"{MAX_CHOICES} choices a request", code="invalid_value")
        if self.token_limit == 0 and not self.echo:
            raise ParameterError("max_tokens", "0 generates nothing: it goes with echo (the prompt, and its "
                                               "log-probabilities with logprobs)", code="invalid_value")
        return self

    best_of: Any = None
    suffix: Any = None


class TokenizeRequest(Strict):
    """/tokenize: the text as llama-server (`content`, `add_special`) or vLLM (`prompt`,
    `add_special_tokens`) sends it."""

    content: str | None = None
    prompt: str | None = None
    add_special: bool = False  # the tokenizer's own special tokens (a BOS), as llama-server's flag
    add_special_tokens: bool | None = None  # vLLM's name for it; said, it wins
    model: str | None = None

    @model_validator(mode="after")
    def _one_text(self):
        if (self.content is None) == (self.prompt is None):
            raise ValueError("send the text as content or as prompt (one of them)")
        return self

    @property
    def text(self) -> str:
        return self.content if self.content is not None else self.prompt

    @property
    def special(self) -> bool:
        return self.add_special if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(Strict):
    tokens: list[int]
    model: str | None = None


# What pydantic adds to an error's location for the member of a union that refused the value.
TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}


def parse(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        if isinstance(first.get("ctx", {}).get("error"), ParameterError):
            error = first["ctx"]["error"]
            raise BadRequest(f"{error.param}: {error}", param=error.param, code=error.code) from None
        # Union members add their type name to the location; keep only the request's own keys.
        path = [str(p) for p in first["loc"] if not (isinstance(p, str) and (p in TYPE_NAMES or "[" in p))]
        param = ".".join(path) or None
        message = first["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{param}: {message}" if param else message, param=param,
                         code="invalid_value") from None
