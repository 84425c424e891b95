"""Options declared once, as `SpecConfig` is for decoding. A dataclass field's metadata (its help,
the parser of its flag's text, its choices) makes the CLI flag (`add_flags`), checks the keywords a
Python call gives (`checked`) and converts the values a config file gives (`from_mapping`).
`LoadOptions` are loading's: `specee.load`, every command's model flags, the server's replicas and a
Ray Serve config take exactly these."""
from __future__ import annotations

import argparse
import difflib
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .model.kernels import TIER_NAMES


def option(default: Any = None, help: str | None = None, *, flag: str | None = "",
           parse: Callable[[str], Any] | None = None, choices: tuple | None = None, action: str | None = None):
    """A declared option. flag: "" = from the field's name (ctx_size: --ctx-size), None = no flag;
    parse: turns the flag's text into the value, refusing what is out of range (argparse's `type`);
    action: store_true, store_false or append (their flags take no text, or repeat); help: "{default}"
    in it becomes the default a parser is given."""
    return field(default=default, metadata=dict(help=help, flag=flag, parse=parse, choices=choices, action=action))


def _int_from(low: int, name: str) -> Callable[[str], int]:
    """A parser: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {name}, got {value}")
        return value
    return parse


positive_int = _int_from(1, "a positive integer")
non_negative_int = _int_from(0, "a whole number >= 0")


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def flag_of(f) -> str | None:
    spelled = f.metadata["flag"]
    return "--" + f.name.replace("_", "-") if spelled == "" else spelled


def add_flags(parser, options: type, defaults: dict | None = None) -> None:
    """A flag for every field of `options` that has one, on `parser` (or an argument group); dest:
    the field's name; `defaults` by name over the declared ones."""
    for f in fields(options):
        if flag_of(f) is None:
            continue
        m = f.metadata
        default = (defaults or {}).get(f.name, f.default)
        help_text = m["help"].replace("{default}", f"{default:g}" if isinstance(default, float) else str(default)) \
            if m["help"] else m["help"]
        if m["action"] == "append":
            parser.add_argument(flag_of(f), dest=f.name, action="append", default=list(default), help=help_text)
        elif m["action"]:
            parser.add_argument(flag_of(f), dest=f.name, action=m["action"], default=default, help=help_text)
        else:
            parser.add_argument(flag_of(f), dest=f.name, type=m["parse"], choices=m["choices"], default=default,
                                help=help_text)


def from_namespace(options: type, args: argparse.Namespace):
    """The options the parsed flags give (fields a parser lacks keep their defaults)."""
    return options(**{f.name: getattr(args, f.name) for f in fields(options) if hasattr(args, f.name)})


def checked(options: type, keywords: dict, caller: str):
    """`options` from keywords, an unknown one a TypeError that names the known ones."""
    known = [f.name for f in fields(options)]
    for name in keywords:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{caller} has no option {name!r}{hint}; its options: {', '.join(known)}")
    return options(**keywords)


def converted(f, value, name: str):
    """A value from a config file (YAML: text, numbers, booleans, lists) checked and converted as the
    field's flag would check and convert its text; a ValueError naming `name` where it is refused."""
    m = f.metadata
    if m["action"] in ("store_true", "store_false"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} takes true or false, got {value!r}")
        return value
    if m["action"] == "append":
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} takes a list, got {value!r}")
        return [str(item) for item in value]
    text = str(value)
    try:
        value = m["parse"](text) if m["parse"] else text
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None
    if m["choices"] and value not in m["choices"]:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(m['choices'])}")
    return value


def from_mapping(options: type, mapping: dict):
    """`options` from a config file's values by field name (None: the default), each converted as its
    flag's text would be."""
    by_name = {f.name: f for f in fields(options)}
    return options(**{name: converted(by_name[name], value, name) for name, value in mapping.items()
                      if value is not None})


def signature(options: type, positional: int = 1) -> inspect.Signature:
    """The signature of a function taking `options` as keywords (the first `positional` also by
    position), for help() and editors."""
    kinds = [inspect.Parameter.POSITIONAL_OR_KEYWORD] * positional + [inspect.Parameter.KEYWORD_ONLY] * len(fields(options))
    return inspect.Signature([inspect.Parameter(f.name, kind, default=f.default, annotation=f.type)
                              for f, kind in zip(fields(options), kinds)])


@dataclass(frozen=True)
class LoadOptions:
    """How a model loads. `quantization`: auto (on the CPU kernels a GGUF file's own blocks, else int4;
    none on a GPU), none, int8, int4 or gguf; the quantized formats run on the CPU. `compile`: on the
    CPU, run on specee's compiled kernels (built once per machine; False: PyTorch's own, slower), in
    `cpu_tier` (default: the best this CPU runs, or $SPECEE_CPU_TIER; every tier gives the same bits).
    `threads`: PyTorch's and the kernels' threads (None: as PyTorch has them; the CLI's default is
    the physical cores). `ctx_size`: the longest prompt plus answer a generation may hold (default
    the model's context, at most 4096). `prefix_cache_mb`: the prefix cache's memory (default on the
    CPU kernels: the model's K/V for 8192 tokens, at most an eighth of the available memory and
    1 GiB; else 0 = off). `suffix_cache_tokens`: what `auto`'s suffix cache of earlier requests keeps
    (None: its default). `kv_cache_dtype`: fp32, fp16 on the CPU kernels, or auto (fp16 where quantized
    weights run on them). The help texts are the flags'."""

    model: Any = option(help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    dtype: str = option("fp32", "fp32 or bf16 (default fp32)")
    device: str = option("cpu", "cpu or cuda (default cpu)")
    threads: int | None = option(help="CPU threads (default: the physical cores this process may run on)",
                                 parse=positive_int)
    quantization: str = option(
        "auto", "weights: auto (on the CPU a GGUF file's own format, else int4; none on a GPU), none (dense --dtype), "
                "int8 (per channel), int4 (groups of 32; head int8) or gguf (the GGUF file's own blocks: Q4_0/Q4_1 "
                "as int4, the K-quants and Q5_0 in 4 or 6 bits with their own scales, Q8_0 as 8-bit codes with one "
                "scale a group, Q5_1 as grouped int8); the quantized formats run on the CPU (default {default})")
    compile: bool = option(
        True, "run on PyTorch's own CPU kernels instead of specee's compiled ones (built once per machine into the "
              "cache folder): slower, and its greedy tokens may differ from the compiled run's",
        flag="--no-compile", action="store_false")
    ctx_size: int | None = option(
        help="the longest prompt plus answer a generation may hold, in tokens (default: the model's context, at most "
             "4096); the KV cache grows up to it, and the memory check counts it full", parse=positive_int)
    prefix_cache_mb: float | None = option(
        help="memory for the prefix cache, which keeps earlier prompts' and answers' K/V so a prompt that begins the "
             "same way prefills only the rest (default on the CPU kernels: the model's K/V for 8192 tokens, at most an "
             "eighth of the available memory and 1024; 0 = off; off by default elsewhere)", parse=non_negative_float)
    suffix_cache_tokens: int | None = option(
        help="tokens of earlier prompts and answers the server-wide suffix cache keeps for `auto` to draft from "
             "(default 262144, about 16 MB; 0 = off)", parse=non_negative_int)
    kv_cache_dtype: str = option(
        "auto", "the KV cache's element on the CPU: fp32, fp16 (half its memory, and half the bytes a step reads at long "
                "contexts; specee's compiled kernels only; each key and value rounded to fp16, as llama.cpp's default "
                "cache; speculative decoding matches dense decoding on the same cache), or auto (fp16 where quantized "
                "weights run on the compiled kernels, else fp32) (default {default})",
        choices=("auto", "fp32", "fp16"))  # loader.KV_CACHE_CHOICES, without importing torch
    cpu_tier: str | None = option(
        help="which instruction set specee's kernels use: auto (the best this CPU runs; or $SPECEE_CPU_TIER), or a "
             "lower tier to run and time it; every tier gives the same bits", choices=("auto",) + TIER_NAMES)

    def keywords(self) -> dict:
        """Every option by name: what `load_engine` takes."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def flags(self, leave_out: tuple[str, ...] = ()) -> list[str]:
        """The flags that give these options (those at their default left out): the inverse of parsing."""
        given = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in leave_out or value == f.default:
                continue
            given.append(flag_of(f) if f.metadata["action"] else f"{flag_of(f)}={value}")
        return given


def flag(options: type, name: str) -> str:
    """The flag of the option `name`, as a message spells it."""
    return flag_of(next(f for f in fields(options) if f.name == name))
