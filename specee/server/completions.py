"""From a validated request to a Generation (server defaults, speculative options, context check),
and from a generation's events and result to the OpenAI response shapes."""
from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field

from ..engine import Engine, Event, Generation, Result, TokenLogprob
from ..strategies.config import SpecConfig
from ..text_stream import TextStream
from .errors import BadRequest
from .schemas import ChatRequest, CompletionRequest, Sampling
from .tools import CallReader, ToolPlan, knows_tools

# Distinct speculative configurations whose strategies are kept (strategies hold no request state).
STRATEGY_CACHE_SIZE = 32


@dataclass
class Defaults:
    """What a request gets for what it leaves out: the `specee serve` flags."""

    generation: dict = field(default_factory=lambda: {"max_tokens": 256})  # max_tokens, temperature, ...
    spec: SpecConfig = field(default_factory=SpecConfig)


class Planner:
    """Builds each request's Generation; strategies are built once per distinct configuration."""

    def __init__(self, engine: Engine, defaults: Defaults) -> None:
        self.engine = engine
        self.defaults = defaults
        self._strategy = functools.lru_cache(maxsize=STRATEGY_CACHE_SIZE)(engine.strategy)
        # Bad server flags fail at start (a ValueError, as on the command line), not on a request.
        self._strategy(defaults.spec)

    def strategy_for(self, requested: dict | None):
        try:
            return self._strategy(self.defaults.spec.merged(requested) if requested else self.defaults.spec)
        except ValueError as e:
            raise BadRequest(f"specee: {e}", param="specee", code="invalid_value") from None

    def generation(self, request: Sampling, prompt: Prompt) -> Generation:
        prompt_ids, prompt_param = prompt.ids, prompt.param
        requested = request.specee.decoding if request.specee else None
        strategy = self.strategy_for(requested)
        grammar = request.grammar()
        try:
            tool_grammar = prompt.tools.grammar() if prompt.tools else None
        except ValueError as e:  # a tool's parameters the grammar compiler cannot read
            raise BadRequest(f"tools: {e}", param="tools", code="invalid_value") from None
        if tool_grammar is not None:
            if grammar is not None:
                raise BadRequest(f"{grammar[1]}: one constraint per request, and tool_choice "
                                 f"{prompt.tools.choice!r} is one", param=grammar[1], code="invalid_value")
            grammar = tool_grammar, "tools"
        room = self.engine.context_length - len(prompt_ids)
        if room < 0 or room == 0 and request.token_limit != 0:  # max_tokens 0 scores a prompt that fills the context
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens but the context is "
                             f"{self.engine.context_length}", param=prompt_param, code="context_length_exceeded")
        max_tokens = request.token_limit
        if max_tokens is None:
            max_tokens = min(self.defaults.generation.get("max_tokens", 256), room)
        elif max_tokens > room:
            raise BadRequest(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) is over the "
                             f"context ({self.engine.context_length})",
                             param="max_tokens", code="context_length_exceeded")
        options = dict(self.defaults.generation, max_tokens=max_tokens)
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty"):
            if getattr(request, name) is not None:
                options[name] = getattr(request, name)
        if request.token_bias:
            vocab = self.engine.model.config.vocab_size
            if max(request.token_bias) >= vocab:
                raise BadRequest(f"logit_bias: token {max(request.token_bias)} is outside the vocabulary (ids 0.."
                                 f"{vocab - 1})", param="logit_bias", code="invalid_value")
            options["logit_bias"] = request.token_bias
        if strategy.greedy_only and options.get("temperature", 0) > 0:
            raise BadRequest(f"{strategy.name} runs greedy only: use temperature 0", param="temperature",
                             code="invalid_value")
        if request.logprobs_asked is not None:
            options["logprobs"] = request.logprobs_asked
        if getattr(request, "prompt_logprobs_asked", None) is not None:
            options["prompt_logprobs"] = request.prompt_logprobs_asked
        if request.specee is not None and request.specee.prefix_cache is False:
            options["prefix_cache"] = False
        if request.ignore_eos:
            if grammar is not None:  # a constraint ends the answer where it is complete
                raise BadRequest(f"ignore_eos: {grammar[1]} ends the answer when it is complete",
                                 param="ignore_eos", code="invalid_value")
            options["ignore_eos"] = True
        if not strategy.full_logits:  # early exits
            asked = [name for name in ("presence_penalty", "frequency_penalty", "logit_bias") if options.get(name)]
            asked += ["logprobs"] if "logprobs" in options or "prompt_logprobs" in options else []
            asked += [grammar[1]] if grammar else []
            for name in asked:
                raise BadRequest(f"{name}: early exits choose among a few candidates, over no full distribution",
                                 param=name, code="invalid_value")
        if grammar is not None:
            try:
                self.engine.grammars.check(grammar[0])
            except ValueError as e:
                raise BadRequest(f"{grammar[1]}: {e}", param=grammar[1], code="invalid_value") from None
            options["grammar"] = grammar[0]
        if prompt.tools is not None:
            options["stop_check"] = prompt.tools.stop_check
        try:
            return self.engine.stream(prompt_ids, strategy=strategy, **options)
        except ValueError as e:
            raise BadRequest(str(e), param=prompt_param, code="invalid_value") from None


@dataclass
class Prompt:
    ids: list[int]
    param: str  # the request parameter it came from
    tools: ToolPlan | None = None  # how the request's tools were put in, and its answer is read
    echo: str | None = None  # completions with echo: the prompt's text, shown before the answer


def prompts_of(engine: Engine, request: ChatRequest | CompletionRequest) -> list[Prompt]:
    """The request's prompts: a chat's one, or each of a completion's."""
    if isinstance(request, ChatRequest):
        return [chat_prompt(engine, request)]
    return [completion_prompt(engine, prompt, request.echo) for prompt in request.prompts]


def completion_prompt(engine: Engine, prompt: str | list[int], echo: bool) -> Prompt:
    if isinstance(prompt, str):
        try:
            ids = engine.encode(prompt, chat=False)
        except UnicodeError as e:  # lone surrogates
            raise BadRequest(f"cannot encode the prompt: {e}", param="prompt", code="invalid_value") from None
        return Prompt(ids, "prompt", echo=prompt if echo else None)
    check_token_ids(engine, prompt, "prompt")
    return Prompt(list(prompt), "prompt", echo=engine.tokenizer.decode(prompt, skip_special_tokens=False) if echo
                  else None)


def check_token_ids(engine: Engine, ids: list[int], param: str) -> None:
    vocab = engine.model.config.vocab_size
    if any(not 0 <= token < vocab for token in ids):
        outside = next(token for token in ids if not 0 <= token < vocab)
        raise BadRequest(f"{param}: token {outside} is outside the vocabulary (ids 0..{vocab - 1})", param=param,
                         code="invalid_value")


def chat_prompt(engine: Engine, request: ChatRequest) -> Prompt:
    try:
        messages = [m.for_template() for m in request.messages]
        tokenizer = engine.tokenizer
        plan = None
        if request.tools and request.tool_choice_name != "none":
            plan = ToolPlan(knows_tools(tokenizer.chat_template), [t.function.model_dump(exclude_none=True)
                                                                  for t in request.tools],
                            request.tool_choice_name, request.parallel_tool_calls is not False,
                            request.max_tool_calls)
        elif any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            plan = ToolPlan(knows_tools(tokenizer.chat_template), [], "none")  # earlier calls, no new ones
        if plan is not None:
            messages = plan.conversation(messages)
        ids = tokenizer.encode_prompt(messages, chat=True, tools=plan.template_tools() if plan else None)
        return Prompt(ids, "messages", plan if plan is not None and plan.tools else None)
    except (ValueError, UnicodeError) as e:  # a template that refuses the messages, lone surrogates
        raise BadRequest(f"cannot encode the prompt: {e}", code="invalid_value") from None


@dataclass
class ChoiceState:
    """What one choice's chunks have sent so far."""

    pieces: TextStream  # each token's own text, without stop handling
    calls: CallReader | None  # reads tool calls out of the answer
    prompt: Prompt
    sent_role: bool = False
    offset: int = 0  # completions' logprobs: where the next token's text starts
    echoed: bool = False  # the prompt's text (echo) has gone out


class Shaper:
    """One response's OpenAI shapes: chat or completion, whole or chunk by chunk, for `n` choices
    of each prompt (choice i answers prompt i // n, as OpenAI orders them). Each chunk's `specee`
    field says how every token was made, for the live page."""

    def __init__(self, chat: bool, model_id: str, engine: Engine, prompts: list[Prompt], n: int = 1) -> None:
        self.chat = chat
        self.model_id = model_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.n = n
        self._tokenizer = engine.tokenizer
        self._choices = [ChoiceState(TextStream(engine.tokenizer), prompt.tools.reader() if prompt.tools else None,
                                     prompt) for prompt in prompts for _ in range(n)]

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id, "choices": choices,
                **extra}

    def _token(self, token: int, logprob: float) -> dict:
        text = self._tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, logprobs: list[TokenLogprob] | None, state: ChoiceState) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat's `content` list, or completions'
        parallel lists (text offsets counted from the text sent before)."""
        if logprobs is None:
            return None
        entries = [self._token(t.token, t.logprob) | {"top_logprobs": [self._token(i, v) for i, v in t.top]}
                   for t in logprobs]
        if self.chat:
            return {"content": entries}
        offsets = []
        for entry in entries:
            offsets.append(state.offset)
            state.offset += len(entry["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def _echo(self, state: ChoiceState, prompt_logprobs: list[TokenLogprob] | None) -> tuple[str, dict | None]:
        """Completions with echo, once per choice: the prompt's text and, with logprobs, its
        tokens' (the first has none: nothing comes before it), offsets counted from the prompt's start."""
        if state.echoed or state.prompt.echo is None:
            return "", None
        state.echoed = True
        if prompt_logprobs is None:
            return state.prompt.echo, None
        shaped = self._logprobs(prompt_logprobs, state)
        first = self._tokenizer.decode(state.prompt.ids[:1], skip_special_tokens=False)
        shaped = {"tokens": [first] + shaped["tokens"], "token_logprobs": [None] + shaped["token_logprobs"],
                  "top_logprobs": [None] + shaped["top_logprobs"],
                  "text_offset": [0] + [offset + len(first) for offset in shaped["text_offset"]]}
        state.offset = len(state.prompt.echo)  # the answer's tokens follow the prompt's text
        return state.prompt.echo, shaped

    def _completion_choice(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
                           prompt_logprobs: list[TokenLogprob] | None, finish: str | None) -> dict:
        state = self._choices[index]
        echo, echoed_logprobs = self._echo(state, prompt_logprobs)
        shaped = self._logprobs(logprobs, state)
        if echoed_logprobs is not None:
            shaped = {key: echoed_logprobs[key] + (shaped[key] if shaped else []) for key in echoed_logprobs}
        return {"index": index, "text": echo + text, "logprobs": shaped, "finish_reason": finish}

    def chunk(self, event: Event, index: int = 0) -> dict:
        state = self._choices[index]
        tokens = [
            {"id": t, "text": state.pieces.add([t]), "source": "draft" if i < event.drafted else "target",
             "exit_layer": event.exit_layer, "method": event.method}
            for i, t in enumerate(event.token_ids)
        ]
        if self.chat:
            delta, finish = {"content": event.text}, event.finish_reason
            if state.calls is not None:  # content as it is known to be content; calls as they are written
                delta, finish = self._call_delta(state.calls, event.text, finish)
            if not state.sent_role:
                delta = {"role": "assistant", **delta}
                state.sent_role = True
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(event.logprobs, state),
                      "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice], specee={"tokens": tokens})
        choice = self._completion_choice(index, event.text, event.logprobs, event.prompt_logprobs, event.finish_reason)
        return self._envelope("text_completion", [choice], specee={"tokens": tokens})

    @staticmethod
    def _call_delta(calls: CallReader, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chunk's delta and finish reason in an answer that may call tools: content as soon as
        it is known to be content, each call's name and then its arguments as they are written."""
        content, deltas = calls.feed(text), calls.deltas()
        if finish is not None:
            rest, _ = calls.finish(cut=finish == "length")
            content, deltas = content + rest, deltas + calls.deltas()
            if calls.announced and finish != "length":
                finish = "tool_calls"
        delta = {"content": content} if content else {}
        if deltas:
            delta["tool_calls"] = deltas
        return delta, finish

    def usage_chunk(self, results: list[Result]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage(results, self.n), specee={"stats": stats_summary(results[0])})

    def _choice(self, result: Result, index: int) -> dict:
        state = self._choices[index]
        if not self.chat:
            return self._completion_choice(index, result.text, result.logprobs, result.prompt_logprobs,
                                           result.finish_reason)
        message, finish = {"role": "assistant", "content": result.text}, result.finish_reason
        if state.calls is not None:
            content = state.calls.feed(result.text)
            rest, calls = state.calls.finish(cut=finish == "length")
            if calls:  # a cut answer keeps its complete calls, and says it was cut
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = "length" if finish == "length" else "tool_calls"
            else:
                message["content"] = content + rest
        return {"index": index, "message": message, "logprobs": self._logprobs(result.logprobs, state),
                "finish_reason": finish}

    def whole(self, results: list[Result]) -> dict:
        """The response to a request whose choices ended with `results`; `specee.stats` are the
        first choice's."""
        choices = [self._choice(result, i) for i, result in enumerate(results)]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices,
                              usage=usage(results, self.n), specee={"stats": stats_summary(results[0])})


def usage(results: list[Result], n: int = 1) -> dict:
    """Each prompt once (its n choices share it), the completions of every choice."""
    firsts = results[::n]  # one choice of each prompt
    prompt = sum(result.prompt_tokens for result in firsts)
    completion = sum(result.completion_tokens for result in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(result.stats.cached_tokens for result in firsts)}}


def stats_summary(result: Result) -> dict:
    s = result.stats
    return {"target_passes": s.target_passes, "draft_tokens_proposed": s.draft_tokens_proposed,
            "draft_tokens_accepted": s.draft_tokens_accepted, "mean_acceptance_length": s.mean_acceptance_length,
            "prefill_s": s.prefill_s, "decode_s": s.decode_s, "tokens_per_s": s.tokens_per_s,
            "avg_forward_layers": s.avg_forward_layers, "exit_histogram": s.exit_histogram,
            "method_passes": s.method_passes, "switches": s.switches, "switch_log": s.switch_log}
