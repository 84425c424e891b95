"""Text <-> token ids, and the model's chat template, from Hugging Face tokenizer files."""
from __future__ import annotations

import functools
import hashlib
import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer

Messages = list[dict]


class Tokenizer:
    def __init__(self, directory: Path, eos_token_ids: list[int]) -> None:
        file = directory / "tokenizer.json"
        if not file.exists():
            raise ValueError(f"{directory} has no tokenizer.json")
        self.directory = directory
        self._tok = FastTokenizer.from_file(str(file))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_file = directory / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.exists() else config.get("chat_template")
        )
        eos = set(eos_token_ids)
        if self.eos_token is not None and self.token_id(self.eos_token) is not None:
            eos.add(self.token_id(self.eos_token))
        self.eos_token_ids = sorted(eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a token-level artifact (an n-gram table) is tied to: the vocabulary and the
        special tokens, whatever the weights, dtype or config file around them."""
        blob = json.dumps([sorted(self.vocab.items()), self.eos_token_ids, self.bos_token, self.eos_token])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def serialized(self) -> str:
        """The whole tokenizer as tokenizer.json text (for llguidance's own copy)."""
        return self._tok.to_str()

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass plain text (--no-chat)")
        from jinja2.exceptions import TemplateError

        try:
            return _compile(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        except TemplateError as e:  # the template's own raise_exception, or a broken template
            raise ValueError(f"the model's chat template refused these messages: {e}") from None

    def encode_prompt(self, prompt: str | Messages, chat: bool = True, tools: list[dict] | None = None) -> list[int]:
        """Token ids for a prompt: messages (or plain text wrapped as one user message) go
        through the chat template when `chat` and the model has one (with `tools` for a template
        that renders them)."""
        if isinstance(prompt, str) and not (chat and self.chat_template):
            return self.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # The template writes the special tokens itself.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


@functools.cache  # one compiled template per source
def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
