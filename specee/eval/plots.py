"""The benchmark's plots, drawn from its summary and records."""
from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure  # the object API renders with Agg and leaves pyplot's global state alone
from matplotlib.ticker import MaxNLocator


def plot_speedup_by_category(summary: dict, path: Path) -> None:
    modes = [m for m in summary["modes"] if m != summary["reference_mode"]]
    groups = [*summary["categories"], "overall"]
    width = 0.8 / max(len(modes), 1)
    bars = len(groups) * max(len(modes), 1)
    fig = Figure(figsize=(min(24.0, max(6.0, 2.0 + 0.08 * bars)), 5.0))  # readable on one screen
    ax = fig.subplots()
    for i, mode in enumerate(modes):
        stats = summary["modes"][mode]
        values = [stats["categories"].get(g, {}).get("speedup_vs_dense") for g in summary["categories"]]
        values.append(stats["speedup_vs_dense"])
        ax.bar([x + i * width for x in range(len(groups))],
               [v if v is not None else float("nan") for v in values], width, label=mode,
               color=colormaps["tab20" if len(modes) > 10 else "tab10"](i))
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(groups))], groups, rotation=30, ha="right")
    ax.set_ylabel(f"speedup vs {summary['reference_mode']}")
    if modes:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_accuracy_vs_speedup(summary: dict, path: Path) -> bool:
    points = [(m, s["speedup_vs_dense"], s["accuracy"]) for m, s in summary["modes"].items()
              if s["speedup_vs_dense"] is not None and s["accuracy"] is not None]
    if not points:
        return False
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for mode, x, y in points:
        ax.scatter(x, y)
        ax.annotate(mode, (x, y), textcoords="offset points", xytext=(5, 5), fontsize="small")
    ax.set_xlabel(f"speedup vs {summary['reference_mode']}")
    ax.set_ylabel("accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def plot_histograms(records: list[dict], key: str, xlabel: str, path: Path) -> bool:
    """One step histogram of an integer per-token quantity per mode that has any; False if none."""
    by_mode: dict[str, list[int]] = {}
    for r in records:
        if not r["skipped"] and r[key]:
            by_mode.setdefault(r["mode"], []).extend(r[key])
    if not by_mode:
        return False
    low = min(min(values) for values in by_mode.values())
    high = max(max(values) for values in by_mode.values())
    bins = [b - 0.5 for b in range(low, high + 2)]  # one bin per integer value
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for mode, values in by_mode.items():
        ax.hist(values, bins=bins, density=True, histtype="step", linewidth=1.5, label=mode)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
