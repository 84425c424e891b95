"""`specee generate`: one prompt's completion, streamed to stdout, optionally under a grammar."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from . import loading
from .common import VERBOSE_HELP, UsageError, choices, speed_line
from .loading import add_model_options
from .sampling import add_sampling_options, sampling_kwargs, validate_sampling


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", nargs="?", help="prompt text, or - to read stdin (the default when stdin is piped)")
    add_model_options(gen)
    add_sampling_options(gen)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="end stdout with one JSON object of the result")
    gen.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA",
                            help="the answer is JSON matching this schema (JSON text, or a file holding it); "
                                 "'{}' for any JSON object")
    constraint.add_argument("--regex", help="the answer matches this regular expression, whole")
    constraint.add_argument("--grammar", metavar="FILE", help="the answer follows this Lark grammar (llguidance's)")


def run(args) -> int:
    validate_sampling(args)
    grammar = constraint(args)
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    engine = loading.load(args)
    stream = engine.stream(prompt, args.config, chat=not args.no_chat, grammar=grammar, **sampling_kwargs(args))
    for event in stream:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    result = stream.result
    sys.stdout.write("\n")
    print(speed_line(result, engine), file=sys.stderr)
    if args.verbose:
        print(choices(result.stats), file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict() | {"cpu_tier": engine.cpu_tier}))
    return 0


def read_prompt(argument: str | None) -> str:
    """The prompt text: the argument, or stdin when it is "-" or absent. A terminal is read only
    when asked with "-" (and says so); with no argument it is an error, not a silent wait."""
    if argument is not None and argument != "-":
        return argument
    if sys.stdin.isatty():
        if argument is None:
            raise UsageError('no prompt: give it as an argument, pipe it in, or pass "-" to type it (Ctrl-D ends it)')
        print("specee: reading the prompt from stdin until Ctrl-D", file=sys.stderr)
    return sys.stdin.read()


def constraint(args):
    """The answer's grammar from --json-schema, --regex or --grammar, checked before the model loads."""
    from ..grammar import Grammar, grammar_error

    try:
        if args.json_schema is not None:
            text = args.json_schema
            if not text.lstrip().startswith("{") and Path(text).is_file():
                text = Path(text).read_text()
            schema = json.loads(text) if text.strip() != "{}" else {"type": "object"}
            grammar = Grammar.json_schema(schema)
        elif args.regex is not None:
            grammar = Grammar.regex(args.regex)
        elif args.grammar is not None:
            grammar = Grammar.lark(Path(args.grammar).read_text())
        else:
            return None
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema is neither a file nor JSON: {e}") from None
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    if error := grammar_error(grammar):
        raise UsageError(error)
    if args.config.exit.kind != "none":
        raise UsageError("early exits choose among a few candidates: they cannot follow a grammar")
    if args.ignore_eos:
        raise UsageError("a grammar ends the answer when it is complete: drop --ignore-eos")
    return grammar
