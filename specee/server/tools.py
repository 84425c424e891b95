"""Tool calls: a request's tools put into the prompt, tool_choice enforced by a grammar, and the
calls read back out of the answer, whole or as it streams (calls.py).

Two formats. A model whose chat template knows tools (it reads `tools`) gets them from its own
template and answers in the Hermes format its family was trained on (Qwen 2.5, Hermes, SmolLM3):
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. A template that does not gets a
system message of ours listing the tools and asking for `{"tool_calls": [{"name", "arguments"}]}`
(llama.cpp's generic format does the same): there, `auto` constrains the answer to either plain text
or such an object, so a call is always well formed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from ..grammar import Grammar, strict_schema
from .calls import DEFAULT_MAX_TOOL_CALLS, NATIVE_CLOSE, NATIVE_OPEN, CallReader

LOCAL_DEFINITION = re.compile(r"#/(\$defs|definitions)/(.+)")  # a reference to a definition in the same schema
# A call is written as json.dumps writes it (a grammar's `%json` would otherwise allow any whitespace).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON Schema of their arguments):\n{tools}\n"
    'To call tools, answer with only a JSON object: {{"tool_calls": [{{"name": <tool name>, "arguments": '
    "<arguments object>}}]}}. {choice}"
)
GENERIC_CHOICES = {"auto": "Otherwise answer in plain text.", "required": "You must call at least one tool."}


def knows_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


@dataclass
class ToolPlan:
    """What a request's tools do to its prompt, its grammar and the reading of its answer."""

    native: bool  # the model's own template renders the tools (Hermes calls), else our generic format
    tools: list[dict]  # OpenAI function definitions: name, description, parameters
    choice: str = "auto"  # "auto", "required", or the name of the one function to call
    parallel: bool = True  # more than one call per answer
    max_calls: int = DEFAULT_MAX_TOOL_CALLS  # at most this many (a model may otherwise repeat a call until cut)

    def template_tools(self) -> list[dict] | None:
        """The `tools` the chat template renders (native format only)."""
        return [{"type": "function", "function": tool} for tool in self.tools] if self.native else None

    def system_message(self) -> str | None:
        """Our tool instructions (generic format only), added to the system message."""
        if self.native:
            return None
        listed = [{"name": t["name"], "description": t.get("description", ""),
                   "parameters": t.get("parameters") or {"type": "object"}} for t in self.tools]
        choice = GENERIC_CHOICES.get(self.choice, f"You must call the tool {self.choice!r}.")
        return GENERIC_INSTRUCTIONS.format(tools=json.dumps(listed, ensure_ascii=False), choice=choice)

    @property
    def single(self) -> bool:
        """One call per answer: parallel calls refused, or one function named."""
        return not self.parallel or self.choice not in ("auto", "required")

    @property
    def most_calls(self) -> int:
        return 1 if self.single else self.max_calls

    def _call_schema(self) -> dict:
        """One call, {"name", "arguments"}, of any tool the choice allows. A function takes the
        arguments it declares: where its schema does not say, no others (a strict one: at every level)."""
        allowed = [t for t in self.tools if self.choice in ("auto", "required") or t["name"] == self.choice]
        definitions: dict = {}
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                   "arguments": hoisted(arguments_schema(t), t["name"], definitions)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
        return {"anyOf": calls}, definitions

    def grammar(self) -> Grammar | None:
        """The constraint the choice puts on the answer: a call for `required` and a named function;
        for `auto`, nothing in the native format, and text or a well-formed call in the generic one."""
        call, definitions = self._call_schema()
        # References are read from the root of the grammar's schema: the call's own (native), or
        # the {"tool_calls": [...]} object around it (generic).
        root = {"$defs": definitions} if definitions else {}
        call |= {"x-guidance": JSON_LAYOUT}
        if self.native:
            if self.choice == "auto":
                return None
            block = f'"{NATIVE_OPEN}\\n" %json {json.dumps(call | root)} "\\n{NATIVE_CLOSE}"'
            repeat = "" if self.most_calls == 1 else f' ("\\n" call){{0,{self.most_calls - 1}}}'
            return Grammar.lark(f"start: call{repeat}\ncall: {block}\n")
        calls = {"type": "array", "items": call, "minItems": 1, "maxItems": self.most_calls}
        schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False, "x-guidance": JSON_LAYOUT} | root
        if self.choice != "auto":
            return Grammar.json_schema(schema)
        # Plain text may not open with "{": that is how a reader tells it from a call.
        return Grammar.lark(f"start: reply | call\nreply: /[^{{][\\s\\S]*/\ncall: %json {json.dumps(schema)}\n")

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The messages as the template reads them: earlier calls and tool results in this format."""
        if self.native:
            return [native_message(m) for m in messages]
        converted = [generic_message(m) for m in messages]
        instructions = self.system_message()
        if instructions is not None:
            if converted and converted[0]["role"] == "system":
                converted[0] = converted[0] | {"content": converted[0]["content"] + "\n\n" + instructions}
            else:
                converted.insert(0, {"role": "system", "content": instructions})
        return converted

    def reader(self) -> CallReader:
        return CallReader(self.native, {t["name"] for t in self.tools}, self.most_calls)

    def stop_check(self) -> Callable[[str], bool]:
        """For one answer: given each piece of its text, whether its calls are done (a call that
        repeats an earlier one, or the most calls), so the generation ends there instead of
        writing the same call again until max_tokens (a model's usual loop in `required`)."""
        reader = self.reader()

        def done(piece: str) -> bool:
            reader.feed(piece)
            return reader.mode == "call" and reader.ended
        return done


def hoisted(schema: dict, tool: str, definitions: dict) -> dict:
    """The arguments' schema with its definitions ($defs, definitions) moved into `definitions`
    under the tool's name, and its references rewritten to them: inside a call the schema is
    nested, and a `#/$defs/...` reference is read from the root (pydantic writes nested models so)."""
    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and (match := LOCAL_DEFINITION.match(ref)):
            node = node | {"$ref": f"#/$defs/{tool}.{match.group(2)}"}
        return {key: rewrite(value) for key, value in node.items()}

    schema = dict(schema)
    for key in ("$defs", "definitions"):
        members = schema.pop(key, None) or {}
        if not isinstance(members, dict):
            raise ValueError(f"{key} of {tool!r} is not an object of named schemas")
        for name, member in members.items():
            definitions[f"{tool}.{name}"] = rewrite(member)
    return rewrite(schema)


def arguments_schema(tool: dict) -> dict:
    """The schema a call's arguments follow: a strict function's by OpenAI's strict rules at every
    level, any other's closed at its top (the arguments it declares, unless it says otherwise)."""
    if tool.get("strict") and tool.get("parameters"):
        return strict_schema(tool["parameters"])
    return declared_only(tool.get("parameters"))


def declared_only(parameters: dict | None) -> dict:
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return parameters | {"additionalProperties": False}
    return parameters


def native_message(message: dict) -> dict:
    """A message for a template that knows tools: call arguments as objects, as HF templates expect."""
    if not message.get("tool_calls"):
        return message
    calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                               "arguments": _arguments(c["function"]["arguments"])}, "id": c["id"]}
             for c in message["tool_calls"]]
    return message | {"content": message.get("content") or "", "tool_calls": calls}


def generic_message(message: dict) -> dict:
    """A message for a template that does not know tools: a call as the JSON the model is asked to
    write, a tool's result as a user message that names it."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"Result of tool call {message.get('tool_call_id', '')}: "
                                           f"{message['content']}"}
    if message.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                 for c in message["tool_calls"]]
        text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        return {"role": "assistant", "content": ((message.get("content") or "") + "\n" + text).strip()}
    return message


def _arguments(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
