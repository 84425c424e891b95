"""Reading tool calls out of an answer as it grows: content passes on at once, each call is found
as its JSON is written (its name as soon as it is whole, its arguments piece by piece), and the
calls that end an answer are settled: complete ones kept, a cut one dropped, a repeat of an
earlier call dropped, at most `max_calls`.

Two formats (tools.py): Hermes blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(native), or one object `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (generic).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

NATIVE_OPEN, NATIVE_CLOSE = "<tool_call>", "</tool_call>"
GENERIC_OPEN = "{"
DEFAULT_MAX_TOOL_CALLS = 8  # calls per answer, unless a request's specee.max_tool_calls says otherwise
MAX_TOOL_CALLS = 128
GENERIC_START = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
NATIVE_BEFORE_CALL = re.compile(r"<tool_call>\s*\Z")  # what stands right before a native call's "{"
ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*\Z')  # what stands right before the arguments' "{"
NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')


@dataclass
class FoundCall:
    """One call object in the answer, as far as it is written: offsets into the answer's text."""

    start: int  # its "{"
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    end: int | None = None  # after its "}", once it is complete
    name: str | None = None  # once its name is whole (written first, as the grammars write it)
    arguments_start: int | None = None  # the arguments object's "{"
    arguments_end: int | None = None
    fate: str = "open"  # "kept", "dropped" (invalid, a repeat, past the cap) or "open" (not settled yet)
    sent: int | None = None  # streamed: characters of its arguments sent (None: not announced)
    index: int | None = None  # streamed: its index among the calls sent
    identity: tuple[str, str] | None = None  # kept: its name and arguments, to tell a repeat


class CallScanner:
    """Follows the brackets of an answer outside JSON strings, to find each call object, its name
    and the span of its arguments object while they are written (one pass over each new piece)."""

    def __init__(self, native: bool) -> None:
        self.native = native
        self.base = 0 if native else 2  # brackets open around a call: none, or {"tool_calls": [
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.calls: list[FoundCall] = []

    def feed(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])
        self._read_name()

    def _read(self, i: int, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return
        if char == '"':
            self.in_string = True
        elif char in "{[":
            if char == "{":
                self._opening(i)
            self.depth += 1
        elif char in "}]":
            self.depth = max(self.depth - 1, 0)
            if char == "}":
                self._closing(i)

    def _opening(self, i: int) -> None:
        call = self.calls[-1] if self.calls and self.calls[-1].end is None else None
        if call is None and self.depth == self.base and (NATIVE_BEFORE_CALL.search(self.text, 0, i) if self.native
                                                         else GENERIC_START.match(self.text)):
            self.calls.append(FoundCall(i))
        elif call is not None and self.depth == self.base + 1 and call.arguments_start is None and \
                ARGUMENTS_KEY.search(self.text, call.start, i):
            call.arguments_start = i

    def _closing(self, i: int) -> None:
        call = self.calls[-1] if self.calls and self.calls[-1].end is None else None
        if call is None:
            return
        if self.depth == self.base + 1 and call.arguments_start is not None and call.arguments_end is None:
            call.arguments_end = i + 1
        elif self.depth == self.base:
            call.end = i + 1

    def _read_name(self) -> None:
        for call in self.calls:
            if call.name is None and (match := NAME_FIRST.match(self.text, call.start)):
                call.name = _decode(match.group(1))

    def arguments(self, call: FoundCall) -> str:
        """The arguments' text written so far."""
        if call.arguments_start is None:
            return ""
        return self.text[call.arguments_start:call.arguments_end or len(self.text)]


class CallReader:
    """Reads one answer. Text that cannot open a call is content and passes on at once; while the
    answer so far could still be the opening of a call it is held back; once it is one, its calls
    are read as they are written (`deltas` streams them, `finish` gives them whole)."""

    def __init__(self, native: bool, names: set[str], max_calls: int = DEFAULT_MAX_TOOL_CALLS) -> None:
        self.native = native
        self.names = names
        self.max_calls = max_calls
        self.opening = NATIVE_OPEN if native else GENERIC_OPEN
        self.text = ""
        self.mode = "undecided"  # then "content" or "call"
        self.scanner = CallScanner(native)
        self.repeated = False  # a complete call repeated an earlier one
        self.announced = 0  # calls whose first delta went out

    def feed(self, delta: str) -> str:
        """The content to send now for this piece of the answer."""
        self.text += delta
        if self.mode == "content":
            return delta
        if self.mode == "call":
            self.scanner.feed(delta)
            return ""
        start = self.text.lstrip()
        if start.startswith(self.opening):
            self.mode = "call"
            self.scanner.feed(self.text)
            return ""
        if self.opening.startswith(start):
            return ""  # still possibly a call (or nothing yet)
        self.mode = "content"
        return self.text

    @property
    def ended(self) -> bool:
        """Whether the answer's calls are done: a complete call repeated an earlier one, or
        `max_calls` calls are complete. The generation may stop here."""
        self._settle()
        return self.repeated or sum(call.fate == "kept" for call in self.scanner.calls) >= self.max_calls

    def _settle(self) -> None:
        """Decide the fate of each complete call, in order: kept if it is a valid call of an offered
        tool, unlike every kept one, within the cap; else dropped."""
        kept = {call.identity for call in self.scanner.calls if call.fate == "kept"}
        for call in self.scanner.calls:
            if call.fate != "open" or call.end is None:
                continue
            identity = self._identity(call)
            if identity is None or len(kept) >= self.max_calls:
                call.fate = "dropped"
            elif identity in kept:
                call.fate, self.repeated = "dropped", True
            else:
                call.fate, call.identity = "kept", identity
                kept.add(identity)

    def _identity(self, call: FoundCall) -> tuple[str, str] | None:
        """(name, arguments as canonical JSON) of a complete call of an offered tool with an object
        of arguments; None for anything else. Two calls with equal identities are one repeated."""
        value = _decode(self.scanner.text[call.start:call.end])
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        try:
            return value["name"], json.dumps(arguments, sort_keys=True)
        except RecursionError:  # parsed just below the limit, written just above it
            return None

    def calls(self) -> list[dict]:
        """The kept calls, in OpenAI's shape (arguments as the model wrote them: valid JSON)."""
        self._settle()
        return [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": self.scanner.arguments(call) or "{}"}}
            for call in self.scanner.calls if call.fate == "kept"]

    def deltas(self) -> list[dict]:
        """The tool-call deltas to stream now (OpenAI's shape): a call's index, id, type, name and
        empty arguments once its name is whole, then its arguments piece by piece. A call whose
        arguments so far begin an earlier call's of the same name waits, so a repeat is never sent."""
        self._settle()
        out = []
        for call in self.scanner.calls:
            if call.fate == "dropped":
                continue
            if call.sent is None:
                if call.name not in self.names or self.announced >= self.max_calls or self._may_repeat(call):
                    break  # not known yet (a later call cannot go before it)
                call.sent, call.index = 0, self.announced
                self.announced += 1
                out.append({"index": call.index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            arguments = self.scanner.arguments(call)
            if call.end is not None and not arguments and call.fate == "kept":
                arguments = "{}"  # a complete call that wrote no arguments
            if len(arguments) > call.sent:
                out.append({"index": call.index, "function": {"arguments": arguments[call.sent:]}})
                call.sent = len(arguments)
            if call.end is None:
                break
        return out

    def _may_repeat(self, call: FoundCall) -> bool:
        if call.fate == "kept":
            return False
        written = self.scanner.arguments(call)
        return any(earlier.name == call.name and self.scanner.arguments(earlier).startswith(written)
                   for earlier in self.scanner.calls if earlier is not call and earlier.fate == "kept")

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """(content not sent yet, the kept calls) at the end of the answer. An answer that opened a
        call but holds no valid one is content, unless `max_tokens` cut it (`cut`): then it is the
        partial call, dropped."""
        if self.mode == "content":
            return "", []
        calls = self.calls()
        if calls or self.announced:
            return "", calls
        return ("" if cut and self.mode == "call" else self.text), []


def _decode(text: str):
    """The JSON value of a text, or None for text that is not one. A model may nest a value past
    what Python's parser takes (RecursionError, ~1,000 levels): no call either, never an error."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
