"""Offline suites generated from a seed: small scored tasks a 135M-parameter model half solves.

HumanEval cannot tell a drop on a model that scores 0% on it, and it needs a download and a sandbox. These
suites need neither: each problem is drawn from a `random.Random` seeded by the suite's name and seed, so the same seed gives the
same problems on every machine, and each is scored by an exact rule that never raises.

- `arith` (`ArithmeticSuite`): "What is a + b?" with a, b in [1, `high`], each ordered pair at most once (the
  pairs shuffled by `random.Random(f"arith/{seed}")`, so problem i does not depend on how many are asked for);
  the answer is the completion's last integer (the GSM8K convention: models show working before the result).
- `lookup` (`LookupSuite`): k "<name> lives in <city>." facts, then "Who lives in <city>?"; the answer is the
  candidate name that appears first in the completion (listing every name is not an answer). The answer is
  copied from the prompt, which is what prompt-lookup drafts propose, so a relaxed token that picks a wrong
  name shows here.

Why they are fair proxies, and what they do not show: docs/experiments.md, "Offline suites".
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from experiments.eval.suites import EvalPrompt, Problem, Score

NAMES = ("Anna", "Tom", "Lee", "Maria", "Omar", "Ines", "Paul", "Yuki", "Ravi", "Greta", "Hugo", "Lina")
CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Riga", "Kyoto", "Dakar", "Hanoi", "Bern", "Turin")
_INTEGER = re.compile(r"-?\d+")
DEFAULT_PROBLEMS = 200
DEFAULT_MAX_TOKENS = 64
STOP = ("\n\n",)  # the answer is the first paragraph; what follows is the model talking on


class ArithmeticSuite:
    """`arith`: one addition per problem, scored by the completion's last integer (module docstring)."""

    binary = True

    def __init__(self, problems: int = DEFAULT_PROBLEMS, seed: int = 0, high: int = 19,
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        if not 1 <= problems <= high * high or max_tokens < 1:
            raise ValueError(f"problems, high, max_tokens: need 1 <= problems <= high², max_tokens >= 1, got "
                             f"{problems}, {high}, {max_tokens}")
        self.name = "arith" if (seed, high) == (0, 19) else f"arith-s{seed}-h{high}"
        self.seed, self.high, self.max_tokens = seed, high, max_tokens
        pairs = [(a, b) for a in range(1, high + 1) for b in range(1, high + 1)]
        random.Random(f"arith/{seed}").shuffle(pairs)
        self._problems = [Problem(f"arith/{i}", {"a": a, "b": b, "answer": a + b})
                          for i, (a, b) in enumerate(pairs[:problems])]

    def problems(self) -> Sequence[Problem]:
        return list(self._problems)

    def prompt(self, problem: Problem) -> EvalPrompt:
        question = f"What is {problem.data['a']} + {problem.data['b']}? Answer with the number only."
        return EvalPrompt(messages=({"role": "user", "content": question},), max_tokens=self.max_tokens, stop=STOP)

    def score(self, problem: Problem, completion: str) -> Score:
        numbers = _INTEGER.findall(completion or "")
        if not numbers:
            return Score.of_pass(False, "no integer")
        last = int(numbers[-1])
        return Score.of_pass(last == problem.data["answer"], f"last integer {last}")


class LookupSuite:
    """`lookup`: who lives in a city, among `people` facts (module docstring)."""

    binary = True

    def __init__(self, problems: int = DEFAULT_PROBLEMS, seed: int = 0, people: int = 3,
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        if problems < 1 or max_tokens < 1 or not 2 <= people <= min(len(NAMES), len(CITIES)):
            raise ValueError(f"problems, people, max_tokens: got {problems}, {people}, {max_tokens}")
        self.name = "lookup" if (seed, people) == (0, 3) else f"lookup-s{seed}-k{people}"
        self.seed, self.people, self.max_tokens = seed, people, max_tokens
        self._problems = [self._draw(i) for i in range(problems)]

    def _draw(self, i: int) -> Problem:
        rng = random.Random(f"lookup/{self.seed}/{i}")  # problem i alone: it does not depend on how many
        names, cities = rng.sample(NAMES, self.people), rng.sample(CITIES, self.people)
        asked = rng.randrange(self.people)
        return Problem(f"lookup/{i}", {"names": names, "cities": cities, "city": cities[asked],
                                       "answer": names[asked]})

    def problems(self) -> Sequence[Problem]:
        return list(self._problems)

    def prompt(self, problem: Problem) -> EvalPrompt:
        d = problem.data
        facts = " ".join(f"{n} lives in {c}." for n, c in zip(d["names"], d["cities"]))
        question = f"{facts}\nWho lives in {d['city']}? Answer with the name only."
        return EvalPrompt(messages=({"role": "user", "content": question},), max_tokens=self.max_tokens, stop=STOP)

    def score(self, problem: Problem, completion: str) -> Score:
        found = [(m.start(), name) for name in problem.data["names"]
                 for m in [re.search(rf"\b{re.escape(name)}\b", completion or "")] if m]
        if not found:
            return Score.of_pass(False, "no candidate name")
        first = min(found)[1]
        return Score.of_pass(first == problem.data["answer"], f"first name {first}")

