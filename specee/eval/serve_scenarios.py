"""The conversations `specee bench-serve --scenario` replays. Each is a script of user turns; a
client sends the first, appends the server's own answer and the next turn, and sends the whole
history again, as chat front-ends and agents do, so that every request after the first begins with
the one before it.

- `chat`: multi-turn conversations from MT-Bench (held out: no constant of specee is tuned on
  them), three two-turn questions of different categories one after another: six turns, histories
  of up to ~2,000 tokens with the model's answers.
- `agent`: an agent loop: a fixed ~1,000-token system prompt (a tool catalogue and rules, the
  same for every client) and a task, then short observations, as a tool loop sends them.

Every run tags its conversations at the very start of their first message, so that nothing one
run (or one concurrency) cached is found by the next: each run pays for its own prefixes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .datasets import Prompt, load_all, round_robin

SCENARIOS = ("requests", "chat", "agent")  # requests: the short independent requests of serve_bench.PROMPTS
CHAT_QUESTIONS = 3  # MT-Bench questions per conversation (two turns each)
AGENT_CALLS = 5

TOOLS = [
    ("list_files", "List the files under a directory of the repository, with their sizes.",
     "path (string, required): a directory relative to the repository root; depth (integer): how many levels"),
    ("read_file", "Read a text file of the repository, whole or a range of lines.",
     "path (string, required); start_line (integer); end_line (integer)"),
    ("search_code", "Search the repository's files for a regular expression, returning matching lines.",
     "pattern (string, required): a Python regular expression; glob (string): which files, e.g. '*.py'"),
    ("write_file", "Create or overwrite a text file with the given content.",
     "path (string, required); content (string, required)"),
    ("apply_patch", "Apply a unified diff to the repository; fails without changing anything if a hunk does not apply.",
     "diff (string, required): the patch, with file headers"),
    ("run_tests", "Run the project's test suite, or the tests matching a keyword, and return the summary.",
     "keyword (string): pytest -k expression; timeout_s (integer): default 600"),
    ("run_command", "Run a shell command in the repository root and return its exit code, stdout and stderr.",
     "command (string, required); timeout_s (integer): default 60"),
    ("git_status", "Show the working tree's changed, staged and untracked files.", "none"),
    ("git_diff", "Show the diff of the working tree against HEAD, or of one file.", "path (string)"),
    ("git_commit", "Commit the staged changes with a message.", "message (string, required)"),
    ("web_search", "Search the web and return the titles, addresses and snippets of the first results.",
     "query (string, required); count (integer): at most 10"),
    ("fetch_page", "Fetch a web page and return its text without markup.", "url (string, required)"),
    ("python", "Run a Python snippet in a sandbox and return what it printed.", "code (string, required)"),
    ("calculator", "Evaluate an arithmetic expression exactly.", "expression (string, required)"),
    ("ask_user", "Ask the user a question and wait for the answer; use sparingly.", "question (string, required)"),
    ("open_issue", "Read an issue of the project's tracker with its comments.", "number (integer, required)"),
    ("comment_issue", "Add a comment to an issue of the project's tracker.",
     "number (integer, required); body (string, required): Markdown"),
    ("install_package", "Install a Python package into the project's virtual environment.",
     "name (string, required); version (string): a pip version specifier"),
    ("format_code", "Format the given files with the project's formatter and report which changed.",
     "paths (array of strings, required)"),
    ("lint", "Run the project's linter on the given files and return its findings.", "paths (array of strings)"),
    ("show_definition", "Find where a function, class or variable is defined and return its source.",
     "name (string, required): a dotted name, e.g. 'package.module.function'"),
    ("find_references", "List every place a function, class or variable is used.", "name (string, required)"),
]
RULES = [
    "Think about what the task needs before you act, and say in one sentence what you will do next.",
    "Call one tool at a time, as a single line of JSON: {\"tool\": NAME, \"arguments\": {...}}.",
    "Read a file before you change it, and change only what the task needs.",
    "After a change, run the tests that cover it; if they fail, read the failure before you try again.",
    "Never invent the output of a tool: wait for the observation.",
    "Keep secrets out of commands and files; never print an environment variable's value.",
    "When the task is done, answer with a short summary of what changed and how you checked it.",
]
AGENT_TASKS = [
    "The function parse_date in utils/dates.py fails on ISO dates with a time zone. Fix it.",
    "Add a --verbose flag to the command line in cli.py that prints each file as it is processed.",
    "The test test_export_csv is flaky. Find out why and make it deterministic.",
    "Rename the module helpers.py to text_helpers.py and update every import.",
    "Find where the configuration file is read and add support for a TOML file beside the JSON one.",
    "Write a unit test for the function merge_intervals in algorithms.py covering empty input and overlaps.",
    "The README's install command is out of date. Check setup.cfg and correct it.",
    "Profile the function build_index and make it faster without changing its output.",
]
OBSERVATIONS = [
    "Observation: {\"exit_code\": 0, \"stdout\": \"src/\\nsrc/app.py 4120\\nsrc/utils/ 3 files\\ntests/ 12 files\"}",
    "Observation: {\"lines\": [\"def handler(event):\", \"    value = event.get('date')\", \"    return parse(value)\"]}",
    "Observation: {\"exit_code\": 1, \"stdout\": \"1 failed, 41 passed\", \"stderr\": \"AssertionError: 3 != 4\"}",
    "Observation: {\"matches\": [\"src/app.py:12: from utils import helpers\", \"tests/test_app.py:3: import helpers\"]}",
    "Observation: {\"exit_code\": 0, \"stdout\": \"42 passed in 3.1s\"}",
]


@dataclass(frozen=True)
class Script:
    """One conversation: the messages before its first user turn, then its user turns in order;
    `seen`: an earlier conversation of the run sent the same task (an agent sent its task again)."""
    opening: tuple[dict, ...]
    turns: tuple[str, ...]
    seen: bool = False

    def tagged(self, tag: str) -> "Script":
        """The same conversation, its first message beginning with `tag`."""
        if self.opening:
            first = dict(self.opening[0], content=f"{tag} {self.opening[0]['content']}")
            return Script((first, *self.opening[1:]), self.turns, self.seen)
        return Script((), (f"{tag} {self.turns[0]}", *self.turns[1:]), self.seen)


def chat_scripts(count: int, questions: list[Prompt] | None = None) -> list[Script]:
    """`count` conversations of CHAT_QUESTIONS MT-Bench questions each, their categories taken
    round robin so that a conversation changes subject as a user's does."""
    questions = round_robin(_by_category(questions if questions is not None else load_all("mtbench")))
    need = count * CHAT_QUESTIONS
    if len(questions) < need:
        raise ValueError(f"{count} chat conversations need {need} questions; the data set has {len(questions)}")
    return [Script((), tuple(turn for q in questions[i * CHAT_QUESTIONS:(i + 1) * CHAT_QUESTIONS] for turn in q.turns))
            for i in range(count)]


def _by_category(prompts: list[Prompt]) -> list[list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    return list(groups.values())


def agent_system_prompt() -> str:
    """The fixed system prompt every agent call begins with (about 1,000 tokens)."""
    tools = "\n\n".join(f"### {name}\n{what}\nArguments: {arguments}." for name, what, arguments in TOOLS)
    rules = "\n".join(f"{i}. {rule}" for i, rule in enumerate(RULES, 1))
    return ("You are a careful software engineering agent working in a user's repository. You act only through "
            "the tools below, one call at a time, and you read each observation before your next step.\n\n"
            f"## Tools\n\n{tools}\n\n## Rules\n\n{rules}")


def agent_scripts(count: int) -> list[Script]:
    """`count` agent loops: the shared system prompt, a task, then AGENT_CALLS - 1 observations.
    Past len(AGENT_TASKS) loops the tasks come round again with other observations: `seen`."""
    system = {"role": "system", "content": agent_system_prompt()}
    return [Script((system,), (AGENT_TASKS[i % len(AGENT_TASKS)],
                               *(OBSERVATIONS[(i + k) % len(OBSERVATIONS)] for k in range(AGENT_CALLS - 1))),
                   seen=i >= len(AGENT_TASKS))
            for i in range(count)]


def scripts(scenario: str, count: int) -> list[Script]:
    if scenario == "chat":
        return chat_scripts(count)
    if scenario == "agent":
        return agent_scripts(count)
    raise ValueError(f"no conversations for scenario {scenario!r}")
