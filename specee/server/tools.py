"""Tool calls: a request's tools put into the prompt, tool_choice enforced by a grammar, and the
calls read back out of the answer, whole or as it streams.

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
import uuid
from dataclasses import dataclass

from ..grammar import Grammar

NATIVE_OPEN, NATIVE_CLOSE = "<tool_call>", "</tool_call>"
NATIVE_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
GENERIC_OPEN = "{"
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

    def _call_schema(self) -> dict:
        """One call, {"name", "arguments"}, of any tool the choice allows. A function takes the
        arguments it declares: where its schema does not say, no others (as under OpenAI's strict)."""
        allowed = [t for t in self.tools if self.choice in ("auto", "required") or t["name"] == self.choice]
        return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                           "arguments": declared_only(t.get("parameters"))},
                           "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]}

    def grammar(self) -> Grammar | None:
        """The constraint the choice puts on the answer: a call for `required` and a named function;
        for `auto`, nothing in the native format, and text or a well-formed call in the generic one."""
        call = self._call_schema() | {"x-guidance": JSON_LAYOUT}
        if self.native:
            if self.choice == "auto":
                return None
            block = f'"{NATIVE_OPEN}\\n" %json {json.dumps(call)} "\\n{NATIVE_CLOSE}"'
            repeat = "" if self.single else ' ("\\n" call)*'
            return Grammar.lark(f"start: call{repeat}\ncall: {block}\n")
        calls = {"type": "array", "items": call, "minItems": 1} | ({"maxItems": 1} if self.single else {})
        schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False, "x-guidance": JSON_LAYOUT}
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

    def reader(self) -> "CallReader":
        return CallReader(self.native, {t["name"] for t in self.tools})


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


class CallReader:
    """Reads an answer as it streams. Text that cannot open a call is content and passes on at once;
    while the answer so far could still be the opening of a call it is held back; once it is one,
    the rest is read whole at the end and becomes tool calls (or content, if it is not a valid call)."""

    def __init__(self, native: bool, names: set[str]) -> None:
        self.native = native
        self.names = names
        self.opening = NATIVE_OPEN if native else GENERIC_OPEN
        self.text = ""
        self.mode = "undecided"  # then "content" or "call"

    def feed(self, delta: str) -> str:
        """The content to send now for this piece of the answer."""
        self.text += delta
        if self.mode == "content":
            return delta
        if self.mode == "call":
            return ""
        start = self.text.lstrip()
        if start.startswith(self.opening):
            self.mode = "call"
            return ""
        if self.opening.startswith(start):
            return ""  # still possibly a call (or nothing yet)
        self.mode = "content"
        return self.text

    def finish(self) -> tuple[str, list[dict]]:
        """(content not sent yet, the calls) at the end of the answer."""
        if self.mode == "content":
            return "", []
        calls = self._calls()
        return ("", calls) if calls else (self.text, [])

    def _calls(self) -> list[dict]:
        if self.native:
            found = [_decode(block) for block in NATIVE_CALL.findall(self.text)]
        else:
            found = (_decode(self.text.strip()) or {}).get("tool_calls")
            found = found if isinstance(found, list) else []
        if not found or not all(isinstance(c, dict) and c.get("name") in self.names and isinstance(
                c.get("arguments", {}), dict) for c in found):
            return []
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
                for c in found]


def _decode(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
