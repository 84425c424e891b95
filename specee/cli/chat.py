"""`specee chat`: an interactive conversation, each answer streamed."""
from __future__ import annotations

import sys

from . import loading
from .common import VERBOSE_HELP, choices, speed_line
from .loading import add_model_options
from .sampling import add_sampling_options, sampling_kwargs, validate_sampling


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="interactive conversation (empty line or Ctrl-D ends it)")
    add_model_options(chat)
    add_sampling_options(chat)
    chat.add_argument("--system", help="system message")
    chat.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def run(args) -> int:
    validate_sampling(args)
    engine = loading.load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("specee chat: type a message; an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        stream = engine.stream(messages, args.config, **sampling_kwargs(args))
        for event in stream:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(speed_line(stream.result, engine), file=sys.stderr)
        if args.verbose:
            print(choices(stream.result.stats), file=sys.stderr)
        messages.append({"role": "assistant", "content": stream.result.text})
    return 0
