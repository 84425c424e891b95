"""Structured output: a grammar (JSON schema, regex or Lark) that the answer must match, enforced
by masking the target's logits with llguidance's token masks.

A `Grammar` is what a request asks for, checked once against the tokenizer; a `Constraint` follows
one generation: it tracks the committed tokens in a matcher and masks any row of a pass, given the
draft tokens between the committed text and that row, so verification of chains and trees sees
the grammar exactly as dense decoding does.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import torch

from .verification.draft import Draft


KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "lark": "grammar"}
# How llguidance's error begins when a token does not fit the grammar (a bug here: masks allowed it).
REFUSED_TOKEN = "doesn't satisfy the grammar"
# Distinct grammars whose check (a matcher and its first mask) is remembered: a request's grammar
# is checked when it arrives and again when its generation starts.
CHECKED_GRAMMARS = 64


class GrammarError(RuntimeError):
    """The grammar itself failed while an answer was generated (llguidance gave up on it, e.g. a
    regex whose lexer grows past its limits): the request's fault, never a silently broken answer."""


def is_engine_panic(error: BaseException) -> bool:
    """A bug inside llguidance (Rust) reaches Python as pyo3's PanicException, a BaseException
    that `except Exception` lets through (it would end a server's worker thread). Seen: its error
    message for some invalid schemas cuts a multi-byte character in two."""
    return type(error).__name__ == "PanicException"


def panic_message(error: BaseException) -> str:
    return f"the grammar engine failed on it ({str(error).splitlines()[0][:200] if str(error) else 'a panic'})"


def panics_as(kind: type[Exception]):
    """A function calling llguidance: a panic in it is raised as `kind` (a ValueError when a
    grammar is built, a GrammarError when a generation's constraint fails)."""
    def decorate(function):
        @functools.wraps(function)
        def guarded(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except BaseException as error:
                if is_engine_panic(error):
                    raise kind(panic_message(error)) from None
                raise
        return guarded
    return decorate


def limits():
    """llguidance's default limits, with short errors: no parser state or grammar in messages."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def matcher_error(matcher) -> str:
    """The matcher's error in one line, without llguidance's trailing markers."""
    lines = [line for line in matcher.get_error().splitlines() if line.strip() and not line.startswith("<")]
    return " ".join(lines) or "the grammar failed"


@dataclass(frozen=True)
class Grammar:
    """A request's constraint on its answer, in llguidance's grammar form."""

    kind: str  # "json_schema", "json_object", "regex" or "lark": what the request sent
    source: str  # the llguidance grammar (a JSON document)

    @staticmethod
    @panics_as(ValueError)
    def json_schema(schema: dict | bool | str) -> "Grammar":
        import llguidance

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object (or true/false)")
        # The default separators and whitespace of JSON, as `json.dumps` writes it.
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        try:
            return Grammar("json_schema", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        except ValueError as error:
            raise ValueError(f"cannot read the JSON schema: {error}") from None

    @staticmethod
    def json_object() -> "Grammar":
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return Grammar("json_object", Grammar.json_schema({"type": "object"}).source)

    @staticmethod
    @panics_as(ValueError)
    def regex(pattern: str) -> "Grammar":
        import llguidance

        return Grammar("regex", llguidance.LLMatcher.grammar_from_regex(pattern))

    @staticmethod
    @panics_as(ValueError)
    def lark(text: str) -> "Grammar":
        """A Lark grammar as llguidance reads it (also takes GBNF-like `start:` rules)."""
        import llguidance

        return Grammar("lark", llguidance.LLMatcher.grammar_from_lark(text))


# Keywords whose value is one subschema, or a list or a name -> subschema map of them (allOf is left
# alone: closing each of its members would refuse the keys the others declare).
SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def strict_schema(schema):
    """A schema sent with `strict: true`, read by OpenAI's Structured Outputs rules: every object
    is closed (`additionalProperties: false`) and requires all its properties, wherever the schema
    does not say otherwise (an explicit `additionalProperties` or `required` is kept). OpenAI
    refuses a strict schema that leaves these out; specee applies them instead, so a schema that
    follows the rules is unchanged and one that does not still gets closed, complete objects."""
    if not isinstance(schema, dict):
        return schema
    strict = dict(schema)
    for key in SUBSCHEMA:
        if key in strict:
            strict[key] = strict_schema(strict[key])
    for key in SUBSCHEMA_LISTS:
        if isinstance(strict.get(key), list):
            strict[key] = [strict_schema(member) for member in strict[key]]
    for key in SUBSCHEMA_MAPS:
        if isinstance(strict.get(key), dict):
            strict[key] = {name: strict_schema(member) for name, member in strict[key].items()}
    if is_object_schema(strict):
        strict.setdefault("additionalProperties", False)
        properties = strict.get("properties", {})
        # (properties that are no object: the grammar compiler refuses the schema, saying so)
        strict.setdefault("required", list(properties) if isinstance(properties, dict) else [])
    return strict


def is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or isinstance(kind, list) and "object" in kind or kind is None and "properties" in schema


def grammar_error(grammar: Grammar, ll_tokenizer=None) -> str:
    """Why the grammar cannot run ("" when it can): checked alone, or against a model's tokenizer."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar.source, ll_tokenizer)
    if not error:
        return ""
    # One line: llguidance's first, and its "error:" line where it draws the source under it.
    lines = error.strip().splitlines()
    reason = " ".join([lines[0]] + [line.strip() for line in lines[1:] if line.startswith("error:")])
    return f"the {KIND_NAMES[grammar.kind]} cannot be used: {reason}"


class GrammarCompiler:
    """The tokenizer side of llguidance for one model, built once (it takes ~0.4 s)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's rows of logits (may exceed the tokenizer's)
        self._error = functools.lru_cache(maxsize=CHECKED_GRAMMARS)(self._find_error)

    @functools.cached_property
    def ll_tokenizer(self):
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer.serialized(), n_vocab=self.vocab_size,
                                      eos_token=self.tokenizer.eos_token_ids)

    def check(self, grammar: Grammar) -> None:
        """Raise ValueError with llguidance's message if the grammar cannot run on this model."""
        if error := self._error(grammar):
            raise ValueError(error)

    def _find_error(self, grammar: Grammar) -> str:
        """Why the grammar cannot run ("" when it can). Besides validating it, build a matcher and
        its first mask: a grammar llguidance can read may still be too complex to run on this
        vocabulary (a lexer past its limits), and that must be a refusal, not an empty answer."""
        import llguidance

        try:
            if error := grammar_error(grammar, self.ll_tokenizer):
                return error
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar.source, log_level=0, limits=limits())
            matcher.compute_bitmask()
            if matcher.is_error():
                return f"the {KIND_NAMES[grammar.kind]} cannot be used: {matcher_error(matcher)}"
        except BaseException as error:
            if not is_engine_panic(error):
                raise
            return f"the {KIND_NAMES[grammar.kind]} cannot be used: {panic_message(error)}"
        return ""

    def constraint(self, grammar: Grammar) -> "Constraint":
        import llguidance

        self.check(grammar)
        return Constraint(llguidance.LLMatcher(self.ll_tokenizer, grammar.source, log_level=0, limits=limits()),
                          self.vocab_size, self.tokenizer.eos_token_ids)


class Constraint:
    """One generation's grammar state. The matcher holds the committed output; masks for rows
    deeper in a draft consume the draft path, compute, and roll back."""

    def __init__(self, matcher, vocab_size: int, end_tokens: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.end_tokens = torch.zeros(vocab_size, dtype=torch.bool)
        self.end_tokens[end_tokens] = True
        self.consumed = 0  # output tokens the matcher has taken

    @panics_as(GrammarError)
    def advance(self, output: list[int]) -> None:
        """Bring the matcher up to the committed `output` (only ever longer). Tokens after the
        grammar's end (its end-of-sequence token) are past the answer and not its business."""
        for token in output[self.consumed:]:
            self._raise_if_failed()
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(token):
                if REFUSED_TOKEN not in self.matcher.get_error():  # a limit reached, not a token refused
                    self._raise_if_failed()
                raise RuntimeError(f"a committed token broke the grammar: {self.matcher.get_error()}")
        self.consumed = len(output)

    def _raise_if_failed(self) -> None:
        """A matcher in error is also "stopped": without this check the answer would simply end,
        its constraint silently broken."""
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed during generation: {matcher_error(self.matcher)}")

    @panics_as(GrammarError)
    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (once it has ended, the end tokens)."""
        self._raise_if_failed()
        if self.matcher.is_stopped():
            return self.end_tokens
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._raise_if_failed()
        return torch.from_numpy(np.unpackbits(packed, count=self.vocab_size, bitorder="little").view(np.bool_))

    @panics_as(GrammarError)
    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        """[rows, vocab] bool: what the grammar allows after each path of draft tokens. A path the
        grammar refuses part-way leads to a row no accepted path can reach: it is left unmasked."""
        if paths == [[]]:  # dense decoding's one row
            return self.allowed().unsqueeze(0)
        rows = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for row, path in enumerate(paths):
            taken = self.matcher.try_consume_tokens(path) if path else 0
            if taken == len(path):
                rows[row] = self.allowed()
            if taken:
                self.matcher.rollback(taken)
        return rows

    @panics_as(GrammarError)
    def forced(self) -> list[int]:
        """Tokens the grammar forces next (llguidance's fast-forward tokens), possibly none."""
        forced = list(self.matcher.compute_ff_tokens())
        self._raise_if_failed()
        return forced

    @panics_as(GrammarError)
    def admissible(self, draft: Draft) -> Draft:
        """The draft without the nodes (and their subtrees) the grammar refuses. Only for drafts
        verification treats as deterministic: dropping a node there changes nothing but the pass."""
        keep: dict[int, int] = {-1: -1}  # draft node -> kept node
        paths: dict[int, list[int]] = {-1: []}
        tokens, parents, rows = [], [], []
        for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            if parent not in keep:
                continue
            path = paths[parent] + [token]
            taken = self.matcher.try_consume_tokens(path)
            if taken:
                self.matcher.rollback(taken)
            if taken < len(path):
                continue
            keep[node], paths[node] = len(tokens), path
            tokens.append(token)
            parents.append(keep[parent])
            rows.append(node)
        if len(tokens) == len(draft):
            return draft
        q = draft.q[rows] if draft.q is not None else None
        return Draft(tokens, parents, q, draft.sampled)
