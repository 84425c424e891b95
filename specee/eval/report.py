"""Benchmark outputs: per-prompt records in, summary metrics, tables, JSON and plots out."""
from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from statistics import geometric_mean

from .plots import plot_accuracy_vs_speedup, plot_histograms, plot_speedup_by_category

AGGREGATION = (
    "per prompt: a mode's decode tokens/s ((generated tokens - 1) / decode seconds, the first token "
    "belonging to prefill; the same definition for every system) over the baseline's on the same prompt; "
    "per category: the geometric mean of the per-prompt ratios (min-max shown); overall: the geometric "
    "mean over categories. tok/s columns follow the same rule. A prompt where a mode or its baseline "
    "generated fewer than 2 tokens has no decode rate and is left out of that ratio (counted as excluded)."
)


@dataclass
class BenchRecord:
    """One prompt run by one mode; `write_outputs` stores these as dicts (dataclasses.asdict)."""

    mode: str
    lossless: bool  # the mode promises the dense output token for token
    prompt_id: str
    category: str
    dataset: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    tokens_per_s: float | None = None  # decode rate, (new_tokens - 1) / decode_s; None below 2 tokens
    run_order: int = 0  # this mode's place among the modes that ran the prompt (they rotate)
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per target pass, bonus included
    exit_layers: list[int] = field(default_factory=list)  # layer each early-exited token left at
    avg_layers: float | None = None  # layers run per generated token
    bytes_per_token: float | None = None  # weight bytes read per generated token
    token_ids: list[int] = field(default_factory=list)
    matches_dense: bool | None = None
    first_divergence: int | None = None
    correct: bool | None = None
    skipped: str | None = None  # why the prompt was not run; None when it was
    drafting: dict | None = None  # speculative modes: counts for CTAR and drafting cost (modes.drafting_counts)
    exiting: dict | None = None  # early-exit modes: predictor and full-head check counts (modes.exit_counts)
    # Greedy modes other than dense: the share of dense's tokens this run matched before it diverged.
    before_divergence: float | None = None


RECORD_FIELDS = tuple(f.name for f in fields(BenchRecord))


def decode_rate(new_tokens: int, decode_s: float) -> float | None:
    """Decode tokens per second: the first token comes from prefill, so n - 1 tokens."""
    return (new_tokens - 1) / decode_s if new_tokens >= 2 and decode_s > 0 else None


def check_records(records: list[dict]) -> None:
    for index, record in enumerate(records):
        missing = [name for name in RECORD_FIELDS if name not in record]
        if missing:
            raise ValueError(f"record {index} ({record.get('mode')}, {record.get('prompt_id')}) lacks {missing}")


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def geomean(values: list[float]) -> float | None:
    return geometric_mean(values) if values else None


def token_weighted(records: list[dict], key: str) -> float | None:
    """Per-token average of a per-record per-token metric, so long outputs count for more."""
    measured = [r for r in records if r[key] is not None and r["new_tokens"] > 0]
    tokens = sum(r["new_tokens"] for r in measured)
    return sum(r[key] * r["new_tokens"] for r in measured) / tokens if tokens else None


def prompt_ratios(records: list[dict], baseline_mode: str, runs: dict[tuple, dict]) -> tuple[list[float], int]:
    """(per-prompt decode-rate ratios against the baseline on the same prompt, prompts excluded
    because either rate is undefined). Prompts the baseline did not run are not counted."""
    ratios, excluded = [], 0
    for r in records:
        base = runs.get((baseline_mode, r["dataset"], r["prompt_id"]))
        if base is None:
            continue
        if r["tokens_per_s"] is None or base["tokens_per_s"] is None:
            excluded += 1
        else:
            ratios.append(r["tokens_per_s"] / base["tokens_per_s"])
    return ratios, excluded


def category_stats(group: list[dict], runs: dict[tuple, dict], reference_mode: str, hf_mode: str) -> dict:
    """One mode on one category: geometric means over its prompts."""
    done = [r for r in group if not r["skipped"]]
    vs_dense, excluded = prompt_ratios(done, reference_mode, runs)
    vs_hf, _ = prompt_ratios(done, hf_mode, runs)
    accept_lengths = [n for r in done for n in r["accept_lengths"]]
    judged = [r["correct"] for r in done if r["correct"] is not None]
    compared = [r["matches_dense"] for r in done if r["lossless"] and r["matches_dense"] is not None]
    agreed = [float(r["matches_dense"]) for r in done if r["matches_dense"] is not None]
    return {
        "prompts": len(done),
        "skipped": len(group) - len(done),
        "excluded": excluded,
        "new_tokens": sum(r["new_tokens"] for r in done),
        "decode_s": sum(r["decode_s"] for r in done),
        "tokens_per_s": geomean([r["tokens_per_s"] for r in done if r["tokens_per_s"] is not None]),
        "speedup_vs_dense": geomean(vs_dense),
        "speedup_vs_dense_min": min(vs_dense, default=None),
        "speedup_vs_dense_max": max(vs_dense, default=None),
        "speedup_vs_hf": geomean(vs_hf),
        "mean_accept_length": mean(accept_lengths),
        "avg_layers": token_weighted(done, "avg_layers"),
        "bytes_per_token": token_weighted(done, "bytes_per_token"),
        "accuracy": mean([float(c) for c in judged]),
        "accuracy_n": len(judged),
        "agreement": mean(agreed),  # share of outputs token-identical to dense (any mode)
        "lossless_ok": all(compared) if compared else None,  # None: lossy mode or nothing compared
        "before_divergence": mean([r["before_divergence"] for r in done if r.get("before_divergence") is not None]),
    } | drafting_stats(done) | exit_stats(done)


CTAR_WIDTHS = range(1, 7)


def drafting_stats(done: list[dict]) -> dict:
    """Pooled over prompts: CTAR(1..6) (Kangaroo's: of the passes that drafted at least w tokens,
    the share whose first w were all accepted), the share of decode time spent drafting, and the
    drafting time per draft token relative to one verification pass."""
    counts = [r["drafting"] for r in done if r.get("drafting")]
    if not counts:
        return {"ctar": None, "drafting_share": None, "draft_cost": None}
    ctar = []
    for w in CTAR_WIDTHS:
        proposed = sum(c["position_proposed"][w - 1] for c in counts if len(c["position_proposed"]) >= w)
        accepted = sum(c["position_accepted"][w - 1] for c in counts if len(c["position_accepted"]) >= w)
        ctar.append(accepted / proposed if proposed else None)
    draft_s, verify_s = sum(c["draft_s"] for c in counts), sum(c["verify_s"] for c in counts)
    nodes, passes = sum(c["draft_nodes"] for c in counts), sum(c["passes"] for c in counts)
    decode_s = sum(r["decode_s"] for r in done if r.get("drafting"))
    return {"ctar": ctar, "drafting_share": draft_s / decode_s if decode_s else None,
            "draft_cost": (draft_s / nodes) / (verify_s / passes) if nodes and verify_s else None}


def exit_stats(done: list[dict]) -> dict:
    """Pooled over prompts: predictors run per token, the share of decode time in exit features,
    predictors and full-head checks, and the share of checks whose argmax was a candidate."""
    counts = [r["exiting"] for r in done if r.get("exiting")]
    if not counts:
        return {"predictors_per_token": None, "predictor_share": None, "check_agreement": None}
    passes, checks = sum(c["passes"] for c in counts), sum(c["exit_checks"] for c in counts)
    decode_s = sum(c["decode_s"] for c in counts)
    return {"predictors_per_token": sum(c["predictors_run"] for c in counts) / passes if passes else None,
            "predictor_share": sum(c["predictor_s"] for c in counts) / decode_s if decode_s else None,
            "check_agreement": sum(c["exit_checks_agreed"] for c in counts) / checks if checks else None}


def overall_stats(categories: dict[str, dict], done: list[dict]) -> dict:
    """One mode over the suite: ratios and rates are geometric means over categories; counts add
    up; per-token and per-pass quantities pool every prompt."""
    pooled = category_stats(done, {}, "", "")
    lows = [c["speedup_vs_dense_min"] for c in categories.values() if c["speedup_vs_dense_min"] is not None]
    highs = [c["speedup_vs_dense_max"] for c in categories.values() if c["speedup_vs_dense_max"] is not None]
    stats = pooled | {
        "excluded": sum(c["excluded"] for c in categories.values()),
        "skipped": sum(c["skipped"] for c in categories.values()),
        "speedup_vs_dense_min": min(lows, default=None),
        "speedup_vs_dense_max": max(highs, default=None),
    }
    for key in ("tokens_per_s", "speedup_vs_dense", "speedup_vs_hf"):
        stats[key] = geomean([c[key] for c in categories.values() if c[key] is not None])
    return stats


def summarize(records: list[dict], reference_mode: str = "dense", hf_mode: str = "hf", stopping: str = "") -> dict:
    """Per-mode and per-category statistics; `stopping` says how generation ended (for tables)."""
    check_records(records)
    runs = {(r["mode"], r["dataset"], r["prompt_id"]): r for r in records if not r["skipped"]}
    modes = list(dict.fromkeys(r["mode"] for r in records))  # in the order they were first run
    label = category_labels(records)
    categories = list(dict.fromkeys(label(r) for r in records))
    summary_modes = {}
    for mode in modes:
        of_mode = [r for r in records if r["mode"] == mode]
        by_category = {
            category: category_stats(in_category, runs, reference_mode, hf_mode)
            for category in categories
            if (in_category := [r for r in of_mode if label(r) == category])
        }
        stats = overall_stats(by_category, [r for r in of_mode if not r["skipped"]])
        stats["lossless"] = any(r["lossless"] for r in of_mode)
        stats["categories"] = by_category
        summary_modes[mode] = stats
    failures = [
        {key: r[key] for key in ("mode", "dataset", "prompt_id", "category", "first_divergence")}
        for r in records
        if not r["skipped"] and r["lossless"] and r["matches_dense"] is False
    ]
    return {
        "reference_mode": reference_mode,
        "hf_mode": hf_mode,
        "aggregation": AGGREGATION,
        "stopping": stopping,
        "categories": categories,
        "modes": summary_modes,
        "lossless_failures": failures,
    }


def category_labels(records: list[dict]):
    """record -> its category's name in the tables: "dataset/category" where datasets share a
    category name (Spec-Bench's coding questions are not HumanEval), else just the category."""
    datasets_of: dict[str, set[str]] = {}
    for r in records:
        datasets_of.setdefault(r["category"], set()).add(r["dataset"])

    def label(record: dict) -> str:
        shared = len(datasets_of[record["category"]]) > 1
        return f"{record['dataset']}/{record['category']}" if shared else record["category"]

    return label


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"  # capitals: a False here is a lossless check that failed
    return f"{value:{spec}}{suffix}"


MODE_COLUMNS = ("mode", "lossless", "prompts", "excluded", "tok/s", "vs dense", "min-max", "vs hf", "accept len",
                "layers", "MB/token", "weights GB/s", "accuracy", "ppl", "same as dense", "lossless ok")


def speedup_range(s: dict) -> str:
    low, high = s["speedup_vs_dense_min"], s["speedup_vs_dense_max"]
    return "-" if low is None else f"{low:.2f}-{high:.2f}x"


def mode_rows(summary: dict) -> list[list[str]]:
    rows = []
    for mode, s in summary["modes"].items():
        mb_per_token = s["bytes_per_token"] / 1e6 if s["bytes_per_token"] is not None else None
        rows.append([
            mode, "yes" if s["lossless"] else "no", str(s["prompts"]), str(s["excluded"]), fmt(s["tokens_per_s"]),
            fmt(s["speedup_vs_dense"], suffix="x"), speedup_range(s), fmt(s["speedup_vs_hf"], suffix="x"),
            fmt(s["mean_accept_length"]), fmt(s["avg_layers"], ".1f"), fmt(mb_per_token, ".1f"),
            fmt(s.get("weight_gb_s"), ".1f"), fmt(s["accuracy"], ".3f"),
            fmt(s.get("perplexity"), ".2f"), fmt(s["agreement"], ".2f"), fmt(s["lossless_ok"]),
        ])
    return rows


DRAFTING_COLUMNS = ("mode", *(f"CTAR{w}" for w in CTAR_WIDTHS), "drafting share", "draft cost/token")


def drafting_rows(summary: dict) -> list[list[str]]:
    """Speculative modes only (drafting_stats)."""
    return [[mode, *(fmt(c) for c in s["ctar"]), fmt(s["drafting_share"]), fmt(s["draft_cost"])]
            for mode, s in summary["modes"].items() if s.get("ctar")]


EXIT_COLUMNS = ("mode", "layers", "predictors/token", "predictor share", "check agreed", "fidelity (TF)",
                "ppl text (dense)", "ppl continuation (dense)", "tokens before divergence")


def exit_rows(summary: dict) -> list[list[str]]:
    """Early-exit modes: layers run, predictor cost, and what exits cost in quality (quality.py)."""
    rows = []
    for mode, s in summary["modes"].items():
        if s.get("predictors_per_token") is None:
            continue
        q = s.get("quality") or {}

        def vs_dense(key: str) -> str:
            return f"{fmt(q.get(key))} ({fmt(q.get(key + '_dense'))})"

        rows.append([mode, fmt(s["avg_layers"], ".1f"), fmt(s["predictors_per_token"], ".1f"),
                     fmt(s["predictor_share"]), fmt(s["check_agreement"]), fmt(q.get("fidelity"), ".4f"),
                     vs_dense("ppl_text"), vs_dense("ppl_continuation"), fmt(s["before_divergence"])])
    return rows


def category_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Speedup vs dense (geometric mean over the category's prompts, min-max), one row per
    category and one column per mode; the last row is the geometric mean over categories."""
    modes = list(summary["modes"])

    def cell(s: dict | None) -> str:
        if not s or s["speedup_vs_dense"] is None:
            return "-"
        return f"{s['speedup_vs_dense']:.2f}x ({speedup_range(s)})"

    rows = [[category] + [cell(summary["modes"][m]["categories"].get(category)) for m in modes]
            for category in summary["categories"]]
    rows.append(["overall"] + [fmt(summary["modes"][m]["speedup_vs_dense"], suffix="x") for m in modes])
    return ["category", *modes], rows


def failure_lines(summary: dict) -> list[str]:
    return [
        f"LOSSLESS FAILURE: mode {f['mode']} differs from {summary['reference_mode']} on "
        f"{f['dataset']}/{f['prompt_id']} ({f['category']}), first divergence at token {f['first_divergence']}"
        for f in summary["lossless_failures"]
    ]


def fixed_width(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [headers, *rows])


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(row) + " |" for row in lines)


def run_lines(summary: dict) -> list[str]:
    """What kind of run this was and how its numbers were aggregated."""
    lines = [summary["stopping"]] if summary.get("stopping") else []
    return lines + [f"aggregation: {summary['aggregation']}", "ppl: lossy modes only (a lossless mode has dense's)"]


def pooled_tables(summary: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) of the drafter and early-exit tables that have rows."""
    tables = [("drafters (pooled over prompts)", DRAFTING_COLUMNS, drafting_rows(summary)),
              ("early exit (pooled over prompts; TF: teacher forcing)", EXIT_COLUMNS, exit_rows(summary))]
    return [(title, list(columns), rows) for title, columns, rows in tables if rows]


def format_table(summary: dict) -> str:
    """Modes by metrics, then speedups by category; lossless failures last, where they are seen."""
    parts = [*run_lines(summary), fixed_width(list(MODE_COLUMNS), mode_rows(summary))]
    for title, columns, rows in pooled_tables(summary):
        parts += ["\n" + title, fixed_width(columns, rows)]
    parts += [f"\nspeedup vs {summary['reference_mode']} by category (decode tokens/s ratio)",
              fixed_width(*category_rows(summary))]
    return "\n".join(parts + failure_lines(summary))


def summary_markdown(summary: dict, meta: dict) -> str:
    parts = ["# specee bench", f"`{meta.get('command', '')}`", "\n".join(f"- {line}" for line in run_lines(summary)),
             markdown(list(MODE_COLUMNS), mode_rows(summary)),
             f"## Speedup vs {summary['reference_mode']} by category", markdown(*category_rows(summary))]
    for title, columns, rows in pooled_tables(summary):
        parts += [f"## {title[0].upper()}{title[1:]}", markdown(columns, rows)]
    if meta.get("peak_rss_mb"):
        parts.append(f"Process peak RSS over the whole run: {meta['peak_rss_mb']:.0f} MB.")
    failures = failure_lines(summary)
    if failures:
        parts.append("## Lossless failures\n\n" + "\n".join(f"- **{line}**" for line in failures))
    return "\n\n".join(parts) + "\n"


def write_outputs(out_dir: str | Path, records: list[dict], summary: dict, meta: dict) -> list[Path]:
    """Write records.jsonl, summary.json, summary.md and the plots that have data; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "records.jsonl", out_dir / "summary.json", out_dir / "summary.md",
               out_dir / "speedup_by_category.png"]
    written[0].write_text("".join(json.dumps(r) + "\n" for r in records))
    written[1].write_text(json.dumps({"meta": meta, **summary}, indent=2))
    written[2].write_text(summary_markdown(summary, meta))
    plot_speedup_by_category(summary, written[3])
    optional_plots = [
        ("accuracy_vs_speedup.png", lambda p: plot_accuracy_vs_speedup(summary, p)),
        ("exit_layers.png", lambda p: plot_histograms(records, "exit_layers", "exit layer", p)),
        ("acceptance_lengths.png", lambda p: plot_histograms(records, "accept_lengths", "tokens per target pass", p)),
    ]
    written += [out_dir / name for name, plot in optional_plots if plot(out_dir / name)]
    return written


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch  # here, not at the top: only this function needs it

    try:
        specee_version = version("specee")
    except PackageNotFoundError:  # running from a checkout that is not pip-installed
        specee_version = "unknown"
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "specee": specee_version,
    }
