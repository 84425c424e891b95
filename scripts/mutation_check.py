"""Breaks the code on purpose and checks that the fast tier notices: each mutation is applied to a
copy of this checkout, `pytest -m "not slow"` runs there, and the mutation counts as caught when
tests fail. One JSON line per mutation, then a summary; exit 1 if any mutation went unnoticed.

    python scripts/mutation_check.py              # every mutation (a few minutes each)
    python scripts/mutation_check.py --only counter

Kernel libraries built from a mutated source are removed from the cache afterwards."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's specee, for its cache folder


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the checkout
    old: str
    new: str
    why: str


MUTATIONS = (
    Mutation("tier-reduction-order", "specee/model/kernels/vec_avx2.h",
             "  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));\n"
             "  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));",
             "  alignas(16) float lane[4];\n  _mm_store_ps(lane, four);\n"
             "  return ((lane[0] + lane[3]) + lane[1]) + lane[2];",
             "the AVX2 tier adds a sum's last four lanes in another order than the portable tier"),
    Mutation("greedy-verification", "specee/verification/acceptance.py",
             "if draft.tokens[c] == wanted), None)",
             "if draft.tokens[c] == wanted or c == len(draft) - 1), None)",
             "greedy verification keeps a draft's last node whatever the target chose"),
    Mutation("accepted-counter", "specee/engine.py",
             "                stats.draft_tokens_accepted -= step.drafted - drafted  # count only what reached the user\n",
             "",
             "accepted drafts cut at max_tokens are still counted as accepted"),
)


def mutated_copy(mutation: Mutation, into: Path) -> None:
    """The checkout's files (tracked and untracked, not ignored) under `into`, with `mutation` applied."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    target = into / mutation.path
    text = target.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: the text to change is not in {mutation.path} exactly once; update MUTATIONS")
    target.write_text(text.replace(mutation.old, mutation.new))


def kernel_folders() -> set[Path]:
    from specee.model.loading import cache_root

    folder = cache_root() / "kernels"
    return set(folder.iterdir()) if folder.exists() else set()


def run(mutation: Mutation, pytest_args: list[str]) -> dict:
    before = kernel_folders()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutation.name}-") as scratch:
        copy = Path(scratch)
        mutated_copy(mutation, copy)
        started = time.perf_counter()
        # This script's own tests fail in any mutated copy (it is not a git checkout, and its text moved).
        done = subprocess.run([sys.executable, "-m", "pytest", *pytest_args, "--ignore", "tests/test_mutation_check.py"],
                              cwd=copy, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(copy)})
        seconds = time.perf_counter() - started
    for folder in kernel_folders() - before:  # built from the mutated source
        shutil.rmtree(folder, ignore_errors=True)
    failed = sorted(set(re.findall(r"^FAILED (\S+)", done.stdout, re.MULTILINE)))
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return {"mutation": mutation.name, "why": mutation.why, "caught": done.returncode == 1 and bool(failed),
            "failed": len(failed), "first_failed": failed[:10], "pytest": summary, "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS],
                        help="run this mutation (repeatable; default: all)")
    parser.add_argument("--pytest-args", default='-q -m "not slow" -n 2 --dist loadfile -p no:cacheprovider -rf',
                        help="what pytest runs in each mutated copy (default: the fast tier)")
    args = parser.parse_args(argv)
    results = []
    for mutation in MUTATIONS:
        if not args.only or mutation.name in args.only:
            results.append(run(mutation, shlex.split(args.pytest_args)))
            print(json.dumps(results[-1]), flush=True)
    missed = [r["mutation"] for r in results if not r["caught"]]
    print(json.dumps({"mutations": len(results), "caught": len(results) - len(missed), "missed": missed}))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
