"""What every command shares: the usage error and its exit code, an output path checked before the
work it records, and the lines said after an answer."""
from __future__ import annotations

import os
from pathlib import Path

EXIT_BAD_INPUT = 2
VERBOSE_HELP = "after each answer, list the passes by drafting method and auto's switches with their reasons"


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2."""


def writable(path: Path, flag: str, folder: bool) -> Path:
    """`path` if this process can write it there (a folder, or a file), else a UsageError naming
    `flag`: checked before a benchmark's minutes of work, not after them."""
    absolute = path.absolute()
    existing = next(p for p in (absolute, *absolute.parents) if p.exists())
    kind_fits = (existing.is_dir() if folder else existing.is_file()) if existing == absolute else existing.is_dir()
    if not kind_fits or not os.access(existing, os.W_OK):
        raise UsageError(f"{flag} {str(path)!r}: cannot write a {'folder' if folder else 'file'} there")
    return path


def speed_line(result, engine) -> str:
    s = result.stats
    kernels = f"compiled kernels ({engine.cpu_tier})" if engine.model.uses_kernels else "PyTorch kernels"
    speculative = f"; {s.mean_acceptance_length:.2f} tokens per target pass" if s.accept_lengths else ""
    cached = f" ({s.cached_tokens} from the prefix cache)" if s.cached_tokens else ""
    return (
        f"[{engine.quantization} weights, {kernels}; {result.prompt_tokens} prompt tokens{cached}, prefill {s.prefill_s:.2f} s; {result.completion_tokens} tokens "
        f"in {s.decode_s:.2f} s = {s.tokens_per_s:.1f} tokens/s{speculative}; finish: {result.finish_reason}]"
    )


def choices(stats) -> str:
    """The passes by the method that drafted them, and auto's switches with the acceptance behind each."""
    passes = ", ".join(f"{method} {count}" for method, count in sorted(stats.method_passes.items(), key=lambda m: -m[1]))
    lines = [f"[passes by drafting method: {passes or 'none'}; {stats.switches} switches]"]
    if stats.drafters:  # auto's own counts, per drafter it chose
        counts = "; ".join(f"{name}: {c['passes']} passes" + (f" (+{c['branches']} as a second branch)" if c["branches"] else "")
                           + f", {c['drafted']} drafted, {c['accepted']} accepted"
                           for name, c in sorted(stats.drafters.items(), key=lambda d: -d[1]["passes"]))
        lines.append(f"[auto's drafters: {counts}]")
    for s in stats.switch_log:
        measured = ", ".join(f"{source} {rate:.0%}" for source, rate in s["acceptance"].items()) or "nothing yet"
        others, rows = s["sharing"]
        load = f", sharing the pass with {others} ({rows} rows)" if others else ""
        offer = s["offer"]
        why = "no draft offered" if offer is None else (
            f"best offer {offer['source']} x{offer['draft']}: {offer['expected']:.2f} tokens expected, "
            f"{offer['gain']:.2f}x a dense step's tokens per cost")
        if s.get("resting"):
            why = "recent drafts gave fewer tokens per cost than dense steps: resting"
        lines.append(f"  token {s['at']}: {s['from']} -> {s['to']} ({why} at a row cost of {s['row_cost']:.2f}{load}; "
                     f"accepted so far: {measured})")
    if stats.switches > len(stats.switch_log):
        lines.append(f"  ... {stats.switches - len(stats.switch_log)} more")
    return "\n".join(lines)
