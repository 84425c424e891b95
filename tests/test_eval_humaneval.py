import time

from specee.eval.humaneval_exec import check_humaneval, extract_code

PROBLEM = {
    "task_id": "HumanEval/test",
    "prompt": "from typing import List\n\n\ndef total(numbers: List[int]) -> int:\n    \"\"\"Sum of numbers.\"\"\"\n",
    "entry_point": "total",
    "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
}


def test_correct_solution_passes():
    result = check_humaneval(PROBLEM, "    return sum(numbers)\n")
    assert (result.passed, result.status) == (True, "passed")


def test_wrong_solution_fails_with_the_assertion():
    result = check_humaneval(PROBLEM, "    return len(numbers)\n")
    assert (result.passed, result.status) == (False, "failed")
    assert "AssertionError" in result.detail


def test_crashing_solution_is_an_error():
    result = check_humaneval(PROBLEM, "    return numbers +\n")
    assert (result.passed, result.status) == (False, "error")
    assert "SyntaxError" in result.detail


def test_infinite_loop_is_killed_within_the_timeout():
    start = time.monotonic()
    result = check_humaneval(PROBLEM, "    while True:\n        pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert (result.passed, result.status) == (False, "timeout")
    assert elapsed < 1.0 + 5.0


def test_socket_use_fails():
    completion = (
        "    import socket\n"
        "    socket.create_connection(('127.0.0.1', 9))\n"
        "    return sum(numbers)\n"
    )
    result = check_humaneval(PROBLEM, completion)
    assert not result.passed
    assert "network access is disabled" in result.detail
    raw = "    import _socket\n    _socket.socket()\n    return sum(numbers)\n"
    assert "network access is disabled" in check_humaneval(PROBLEM, raw).detail


def test_memory_limit_stops_a_huge_allocation():
    result = check_humaneval(PROBLEM, "    block = bytearray(8 * 1024 ** 3)\n    return sum(numbers)\n", memory_mb=512)
    assert result.status == "error" and "MemoryError" in result.detail


def test_runs_in_a_throwaway_directory_with_an_empty_environment():
    completion = (
        "    import os\n"
        "    assert sorted(os.listdir('.')) == ['harness.py', 'solution.py']\n"
        "    assert 'HOME' not in os.environ\n"
        "    return sum(numbers)\n"
    )
    assert check_humaneval(PROBLEM, completion).status == "passed"


def test_extract_code_body_from_python_fence():
    answer = "Here you go:\n```python\n    return sum(numbers)\n```\nThis sums the list."
    code = extract_code(answer, PROBLEM["prompt"])
    assert code == "    return sum(numbers)\n"
    assert check_humaneval(PROBLEM, code).passed


def test_extract_code_full_function_replaces_the_stub():
    answer = (
        "Sure!\n```python\ndef total(numbers):\n    result = 0\n    for n in numbers:\n        result += n\n"
        "    return result\n```\nAnd a usage example:\n```\nprint(total([1]))\n```"
    )
    code = extract_code(answer, PROBLEM["prompt"])
    assert code.lstrip().startswith("def total(numbers):") and "print" not in code
    assert check_humaneval(PROBLEM, code).passed


def test_extract_code_unfenced_text_is_used_as_is():
    assert extract_code("    return sum(numbers)\n", PROBLEM["prompt"]) == "    return sum(numbers)\n"
    unfenced_function = "def total(numbers):\n    return sum(numbers)\n"
    assert check_humaneval(PROBLEM, extract_code(unfenced_function, PROBLEM["prompt"])).passed


def test_extract_code_prefers_python_block_and_handles_unclosed_fence():
    answer = "```text\nnot code\n```\n```python\n    return sum(numbers)\n"
    assert extract_code(answer, PROBLEM["prompt"]) == "    return sum(numbers)\n"


def test_memory_blow_up_is_stopped_by_the_childs_own_limit():
    completion = "    hog = bytearray(512 * 1024 * 1024)\n    return sum(numbers)\n"
    result = check_humaneval(PROBLEM, completion, memory_mb=256)
    assert (result.passed, result.status) == (False, "error")
    assert "MemoryError" in result.detail


def test_no_preexec_fn_in_the_executor():
    """preexec_fn can deadlock a threaded parent: the limits live in the child's harness."""
    import inspect

    import specee.eval.humaneval_exec as executor

    assert "preexec_fn" not in inspect.getsource(executor.check_humaneval)
    assert "setrlimit" in executor.HARNESS
