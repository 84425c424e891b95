"""Quality checks on generated text: GSM8K final answers, MMLU letters, token-level agreement."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number as written in an answer: "-3", "1,234.50", "$18"; a minus only when it is not the
# binary operator of "5-3". Thousands groups must be exactly three digits, so "1,2,3" is a list.
NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# Where an answer announces its final number; the last such marker wins.
ANSWER_MARKERS = (
    re.compile(r"####"),
    re.compile(r"\\boxed\{"),
    re.compile(r"answer is", re.IGNORECASE),
)


def parse_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


def final_number(text: str) -> str | None:
    """The answer's final number: the first after the last answer marker, else the last one."""
    for marker in ANSWER_MARKERS:
        positions = [m.end() for m in marker.finditer(text)]
        if positions:
            after = NUMBER.search(text, positions[-1])
            if after:
                return after.group()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def gsm8k_correct(generated_text: str, reference_answer: str) -> bool:
    """Exact match of the final number, so "$1,200." and "1200.00" both match "1200"."""
    generated, reference = final_number(generated_text), parse_number(reference_answer)
    return generated is not None and reference is not None and parse_number(generated) == reference


# "The answer is (B)", "Answer: C", "answer is option D"
ANNOUNCED_CHOICE = re.compile(r"answer(?:\s+is)?\s*[:\-]?\s*(?:option\s+)?\(?([ABCD])\b", re.IGNORECASE)
STANDALONE_LETTER = re.compile(r"(?<![\w'])\(?([ABCD])(?![\w'])")
# "A" in "A good question ..." is the article, not a choice.
ARTICLE_A = re.compile(r"A\s+(?!is\b)[a-z]")


def mmlu_choice(generated_text: str) -> str | None:
    """The letter A-D an answer chooses: an announced "answer is X", else the first standalone one."""
    # The last announcement wins: "the answer is not A ... so the answer is B".
    announced = [m.group(1) for m in ANNOUNCED_CHOICE.finditer(generated_text) if m.group(1).isupper()]
    if announced:
        return announced[-1]
    for match in STANDALONE_LETTER.finditer(generated_text):
        if not ARTICLE_A.match(generated_text, match.start(1)):
            return match.group(1)
    return None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two token sequences differ; the shorter length if one is a prefix."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
