"""The README is a door and docs/ the manual: the README stays short, its test command is CI's,
every relative link in README.md and docs/*.md leads to a file (and a heading, for an anchor), and
every command-line flag is documented somewhere. No model is loaded."""
import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not checked as links


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links are links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, repeated headings numbered -1, -2, ... as GitHub numbers them."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """The relative links of `text` (a page at `page`) that lead nowhere."""
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        if not path:  # an anchor on this page
            if anchor not in anchors(text):
                broken.append(f"{target}: no heading with anchor #{anchor} on this page")
            continue
        file = (page.parent / path).resolve()
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    return broken


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if "pytest" in line)
    assert command in README.read_text().splitlines()


def test_relative_links_lead_somewhere():
    broken = [f"{page.relative_to(ROOT)}: {b}" for page in PAGES for b in broken_links(page, page.read_text())]
    assert not broken, "\n".join(broken)


def test_link_check_catches_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## The `specee serve` route (issue 1): yes, no\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    good = "[a](there.md) [b](there.md#the-specee-serve-route-issue-1-yes-no) [c](there.md#same-1) [d](#top)\n# Top\n"
    assert broken_links(page, good) == []
    bad = "[a](missing.md) [b](there.md#nowhere) [c](there.md#same-2) [d](#gone) `[e](inline-code.md)`\n"
    assert len(broken_links(page, bad)) == 4


def test_every_command_line_flag_is_documented():
    from specee.cli import build_parser

    flags = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            else:
                flags.update(o for o in action.option_strings if o.startswith("--") and o != "--help")

    walk(build_parser())
    text = "\n".join(page.read_text() for page in PAGES)
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert not missing, f"flags not in README.md or docs/: {missing}"
