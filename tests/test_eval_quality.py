import pytest

from specee.eval.quality import first_divergence, gsm8k_correct, mmlu_choice


@pytest.mark.parametrize(
    "text, reference, correct",
    [
        ("She sells 9 eggs at $2 each.\n#### 18", "18", True),
        ("9 * 2 = 18, so she makes $18.", "18", True),
        ("The profit is 200,000 - 130,000 = $70,000.", "70000", True),
        ("The answer is 1,200. Checking: 1200 - 5 = 1195", "1200", True),  # marker beats last number
        ("#### 7\nbut then again 9 minutes", "7", True),
        ("Total: 18.00", "18", True),
        ("The temperature drops to -5 degrees.", "-5", True),
        ("We need 5-3 = 2 more", "2", True),
        ("So the result is \\boxed{42}. (that took 3 steps)", "42", True),
        ("She makes $16 every day.", "18", False),
        ("#### 17", "18", False),
        ("I do not know.", "18", False),
        ("1,2,3 are the sizes", "123", False),  # a list, not a thousands-separated number
    ],
)
def test_gsm8k_correct(text, reference, correct):
    assert gsm8k_correct(text, reference) is correct


@pytest.mark.parametrize(
    "text, letter",
    [
        ("B", "B"),
        ("(C) because the rest are wrong", "C"),
        ("D. Not wrong, Not wrong", "D"),
        ("A good question. The answer is (D).", "D"),
        ("Answer: B", "B"),
        ("I first thought A, but the answer is C.", "C"),
        ("A is correct.", "A"),
        ("The correct option is C.", "C"),
        ("A careful reading shows B fits best.", "B"),
        ("none of these", None),
        ("a cat sat", None),
        ("", None),
    ],
)
def test_mmlu_choice(text, letter):
    assert mmlu_choice(text) == letter


@pytest.mark.parametrize(
    "a, b, index",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([9, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3, 4], 2),
        ([1, 2, 3], [1], 1),
        ([], [4], 0),
    ],
)
def test_first_divergence(a, b, index):
    assert first_divergence(a, b) == index
    assert first_divergence(b, a) == index  # symmetric
