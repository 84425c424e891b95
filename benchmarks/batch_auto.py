"""`auto` against dense in a continuous batch, in one process: the short requests `specee bench-serve`
sends (`serve_bench.PROMPTS` in turn) through `batch.run_together`, --width at a time, the modes
taking turns (rotated each round) after a warm-up; greedy, stopping at EOS or --max-tokens, the
suffix cache off (a round would copy the answers of the rounds before it). Every pass is timed.
Per mode: passes and rows a run, the passes' seconds, the Python between passes (the members'
steps: drafting, verification's bookkeeping, the text), and `auto`'s speed over dense two ways:
the runs' wall times (geometric mean over rounds), and a modeled time that prices every pass on
a line through all passes' seconds against their rows (both modes' passes, so the machine's drift
between rounds, which moves a round's passes by 10-60% on a shared VM, falls on both; decode steps
and passes carrying a prompt on lines of their own) plus the mode's own Python. The answers must equal dense's.

    python benchmarks/batch_auto.py [--rounds 6] [--width 8] [--requests 32] [--max-tokens 128]
                                    [--prefix-cache] [--model FILE.gguf]
"""
import argparse
import json
import math
import statistics
import time

import specee
from specee.batch import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, Batch, run_together
from specee.engine import Generation
from specee.eval.bench import rotated
from specee.eval.serve_bench import PROMPTS

MODES = {"dense": "none", "auto": "auto"}
# Passes of at most this many rows are priced on one line (decode steps), larger ones (a new
# member's prompt chunk beside them) on another: a prompt's rows cost less each.
LINE_ROWS = 24


class TimedBatch(Batch):
    """A batch that adds each pass's (mode, rows, seconds) to `log`."""

    def __init__(self, model, mode: str, log: list[tuple[str, int, float]]) -> None:
        super().__init__(model, DEFAULT_PREFILL_CHUNK)
        self.mode, self.log = mode, log

    def run_pass(self) -> int:
        began = time.perf_counter()
        rows = super().run_pass()
        self.log.append((self.mode, rows, time.perf_counter() - began))
        return rows


def run(engine, strategy, mode: str, prompts: list[str], width: int, max_tokens: int,
        log: list[tuple[str, int, float]]) -> dict:
    """The requests through one batch (`batch.run_together`), each pass's (mode, rows, seconds)
    added to `log`."""
    generations = [Generation(engine, prompt, max_tokens=max_tokens, strategy=strategy) for prompt in prompts]
    passes: list[tuple[str, int, float]] = []
    began = time.perf_counter()
    run_together(engine.model, generations, width, batch=TimedBatch(engine.model, mode, passes))
    wall = time.perf_counter() - began
    log += passes
    results = [generation.result for generation in generations]
    method_passes = merged(result.stats.method_passes for result in results)
    return {"wall_s": wall, "pass_s": sum(s for _, _, s in passes), "passes": len(passes),
            "rows": sum(r for _, r, _ in passes), "tokens": sum(len(r.token_ids) for r in results),
            "answers": [r.token_ids for r in results], "method_passes": method_passes,
            "drafted": sum(r.stats.draft_tokens_proposed for r in results)}


def merged(counts) -> dict[str, int]:
    """Passes by method, summed over several counts of them."""
    total: dict[str, int] = {}
    for count in counts:
        for method, passes in count.items():
            total[method] = total.get(method, 0) + passes
    return total


def pass_line(log: list[tuple[str, int, float]], large: bool = False) -> tuple[float, float] | None:
    """(seconds, seconds per row): least squares through the passes of at most LINE_ROWS rows (`large`:
    of more), or None where they have fewer than two row counts."""
    points = [(rows, seconds) for _, rows, seconds in log if (rows > LINE_ROWS) == large]
    if len({rows for rows, _ in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression([r for r, _ in points], [s for _, s in points])
    return intercept, slope


def priced(log: list[tuple[str, int, float]], mode: str, small: tuple[float, float],
           large: tuple[float, float] | None) -> float:
    """`mode`'s passes in `log`, each priced on its line (`pass_line`'s, for the decode steps and for
    larger passes; a large pass without a line keeps its measured time)."""
    total = 0.0
    for m, rows, seconds in log:
        if m == mode:
            line = small if rows <= LINE_ROWS else large
            total += seconds if line is None else line[0] + line[1] * rows
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--width", type=int, default=DEFAULT_MAX_BATCH, help="generations sharing a pass")
    parser.add_argument("--requests", type=int, default=32, help="requests a run (the prompts in turn)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-cache", action="store_true", help="keep the prefix cache on (as the server does)")
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    args = parser.parse_args()
    engine = specee.load(args.model, suffix_cache_tokens=0, **({} if args.prefix_cache else {"prefix_cache_mb": 0}))
    strategies = {mode: engine.strategy(method) for mode, method in MODES.items()}  # built once, as a server does
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    print(f"{cpu}, {engine.cpu_tier} kernels, {engine.quantization} weights, width {args.width}, "
          f"{args.requests} requests, prefix cache {'on' if args.prefix_cache else 'off'}")
    log: list[tuple[str, int, float]] = []
    for mode in MODES:  # warm-up
        run(engine, strategies[mode], mode, prompts, args.width, args.max_tokens, [])
    runs = {mode: [] for mode in MODES}
    differ = 0
    for round_ in range(args.rounds):
        for mode in rotated(list(MODES), round_):
            runs[mode].append(run(engine, strategies[mode], mode, prompts, args.width, args.max_tokens, log))
        differ += runs["auto"][-1]["answers"] != runs["dense"][-1]["answers"]
        print(f"round {round_}: " + "  ".join(
            f"{mode} {runs[mode][-1]['wall_s']:.3f} s ({runs[mode][-1]['passes']} passes)" for mode in MODES))
    line, large_line = pass_line(log), pass_line(log, large=True)
    report = {"spec_method": MODES, "rounds": args.rounds, "width": args.width, "differ": differ, "modes": {}}
    for mode, done in runs.items():
        python_s = statistics.fmean(r["wall_s"] - r["pass_s"] for r in done)
        modeled = None
        if line is not None:
            modeled = priced(log, mode, line, large_line) / args.rounds + python_s
        method_passes = merged(r["method_passes"] for r in done)
        report["modes"][mode] = {
            "passes": statistics.fmean(r["passes"] for r in done), "rows": statistics.fmean(r["rows"] for r in done),
            "pass_s": statistics.fmean(r["pass_s"] for r in done), "python_s": python_s,
            "wall_s": statistics.fmean(r["wall_s"] for r in done), "modeled_s": modeled,
            "tokens": done[0]["tokens"], "method_passes": method_passes, "drafted": sum(r["drafted"] for r in done)}
        m = report["modes"][mode]
        print(f"{mode:>5}: {m['passes']:.0f} passes and {m['rows']:.0f} rows a run, passes {m['pass_s']:.3f} s, "
              f"Python between them {python_s:.3f} s" + (f", modeled {modeled:.3f} s" if modeled else ""))
    report["wall_ratio"] = math.exp(statistics.fmean(
        math.log(d["wall_s"] / a["wall_s"]) for d, a in zip(runs["dense"], runs["auto"])))
    modes = report["modes"]
    report["modeled_ratio"] = modes["dense"]["modeled_s"] / modes["auto"]["modeled_s"] if line is not None else None
    report["line"] = None if line is None else {"pass_s": line[0], "row_s": line[1]}
    modeled = f", modeled {report['modeled_ratio']:.3f}x" if line is not None else ""
    print(f"auto / dense: wall {report['wall_ratio']:.3f}x (geometric mean of {args.rounds} rounds){modeled}; "
          f"answers that differ: {differ}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
