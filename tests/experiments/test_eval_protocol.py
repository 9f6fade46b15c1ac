"""The selection / held-out protocol, the offline suites and the output measures, with a scripted backend.

The backend answers the `arith` suite by a rule per arm, so every figure the protocol writes is known exactly.
"""

from __future__ import annotations

import json

import pytest

from experiments.eval.backends import Completion
from experiments.eval.measures import copy_rate, repetition_rate, row_measures
from experiments.eval.protocol import (
    PROTOCOL_FILE,
    ProtocolError,
    choose_arm,
    protocol_markdown,
    run_protocol,
    split_problems,
)
from experiments.eval.suites import load_suite
from experiments.eval.synthetic import ArithmeticSuite, LookupSuite


def _sum(prompt) -> tuple[int, int]:
    words = prompt.messages[0]["content"].split()
    return int(words[2]), int(words[4].rstrip("?"))


class RuleBackend:
    """exact answers right on even a, `fast` like exact but twice as fast and worded differently, `bad` wrong
    always and fastest, `long` never ends (cut by max_tokens)."""

    description = "rules"
    arms = ("exact", "fast", "bad", "long")

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def arm_settings(self):
        return {a: {"verification": "exact" if a == "exact" else "asd", "asd": None} for a in self.arms}

    def check_arms(self, arms):
        if set(arms) - set(self.arms):
            raise ValueError("arm: unknown")

    def complete(self, request):
        a, b = _sum(request.prompt)
        self.calls.append((request.arm, f"{a}+{b}"))
        right = a + b if a % 2 == 0 else a + b + 1
        text = {"exact": f"{right}", "fast": f"The answer is {right}.", "bad": "0", "long": f"{right}"}[request.arm]
        seconds = {"exact": 1.0, "fast": 0.5, "bad": 0.1, "long": 1.0}[request.arm]
        finish = "length" if request.arm == "long" else "stop"
        return Completion(text, output_tokens=10, seconds=seconds, speculative=None, finish_reason=finish,
                          served_arm=request.arm)

    def close(self):
        pass


def test_the_offline_suites_are_fixed_by_their_seed_and_score_exactly():
    a, b = ArithmeticSuite(problems=20), ArithmeticSuite(problems=20)
    assert [p.data for p in a.problems()] == [p.data for p in b.problems()]
    assert [p.data for p in ArithmeticSuite(problems=20, seed=1).problems()] != [p.data for p in a.problems()]
    p = a.problems()[0]
    total = p.data["answer"]
    assert a.score(p, f"{p.data['a']} + {p.data['b']} = {total}").passed
    assert not a.score(p, f"The answer is {total}, or maybe {total + 1}").passed  # the last integer counts
    assert not a.score(p, "").passed and a.score(p, "no digits").detail == "no integer"
    lookup = load_suite("lookup")
    q = lookup.problems()[3]
    others = [n for n in q.data["names"] if n != q.data["answer"]]
    assert lookup.score(q, f"{q.data['answer']}.").passed
    assert not lookup.score(q, f"{others[0]} or {q.data['answer']}").passed  # the first name counts
    assert isinstance(load_suite("arith"), ArithmeticSuite) and isinstance(lookup, LookupSuite)


def test_the_split_depends_on_the_seed_and_ids_only():
    ids = [f"p{i}" for i in range(40)]
    s = split_problems(ids, seed=3)
    assert s == split_problems(list(ids), seed=3)
    assert set(s.selection) | set(s.held_out) == set(ids) and not set(s.selection) & set(s.held_out)
    assert len(s.held_out) == 20
    assert split_problems(ids, seed=4).held_out != s.held_out
    with pytest.raises(ValueError):
        split_problems(ids, seed=0, held_out_share=1.0)


def test_text_measures():
    assert repetition_rate("a b c a b c a b c") == pytest.approx(1 - 3 / 7)
    assert repetition_rate("one two") == 0.0
    assert copy_rate("the cat sat on the mat", "the cat sat here") == pytest.approx(1 / 2)
    row = row_measures("x", "a b c", "length", nll=(3.0, 2))
    assert row["truncated"] and row["nll"] == 1.5 and row["nll_tokens"] == 2


def test_the_protocol_chooses_on_selection_and_judges_the_choice_once_on_held_out(tmp_path):
    suite, backend = ArithmeticSuite(problems=24), RuleBackend()
    result = run_protocol(suite, backend, ["exact", "fast", "bad"], tmp_path, split_seed=7,
                          likelihood=lambda prompt, text: (2.0 * len(text), len(text)), resamples=200)
    held = set(result["split"]["held_out"])
    ids = {f"{p.data['a']}+{p.data['b']}": p.id for p in suite.problems()}
    assert result["chosen"] == "fast"  # "bad" is faster but fails the score rule
    assert result["verdicts"]["bad"]["eligible"] is False
    # the grid never saw a held-out problem; only the reference and the chosen arm saw them
    assert len(backend.calls) == 12 * 3 + 12 * 2
    assert not {ids[p] for _, p in backend.calls[:36]} & held
    assert {ids[p] for _, p in backend.calls[36:]} == held
    assert {arm for arm, _ in backend.calls[36:]} == {"exact", "fast"}
    h = result["held_out"]
    assert h["n_pairs"] == 12 and h["score"]["diff"] == 0.0 and h["mcnemar"]["p_value"] == 1.0
    assert h["hash_divergence"]["share"] == 1.0  # every text differs, the score does not
    assert h["speed"]["ratio"] == pytest.approx(2.0) and h["nll"]["diff"] == pytest.approx(0.0)
    assert json.loads((tmp_path / PROTOCOL_FILE).read_text())["split"]["seed"] == 7
    assert "Held-out (12 problems" in protocol_markdown(result)
    calls = len(backend.calls)
    run_protocol(suite, backend, ["exact", "fast", "bad"], tmp_path, split_seed=7, resamples=200)
    assert len(backend.calls) == calls  # a rerun resumes: nothing is asked twice


def test_the_protocol_stops_before_held_out_when_max_tokens_cuts_the_reference(tmp_path):
    backend = RuleBackend()
    with pytest.raises(ProtocolError, match="max-tokens"):
        run_protocol(ArithmeticSuite(problems=10), backend, ["long", "fast"], tmp_path, resamples=100)
    assert json.loads((tmp_path / PROTOCOL_FILE).read_text())["stopped"] == "max_tokens"
    assert not (tmp_path / "held-out").exists()


def test_no_eligible_arm_chooses_the_reference():
    report = {"reference": "exact", "paired": {"bad": {"score": {"diff": -0.3}, "mcnemar": {"b": 6, "c": 0,
                                                                                               "p_value": 0.03},
                                                       "speed": {"ratio": 3.0}}}}
    chosen, verdicts = choose_arm(report)
    assert chosen == "exact" and verdicts["bad"]["why"] == "score difference below −margin"


def test_the_ab_reports_quality_section_shows_the_measures_beside_score_and_speed(tmp_path):
    from experiments.eval.report import quality_section, read_eval_report

    result = run_protocol(ArithmeticSuite(problems=12), RuleBackend(), ["exact", "fast"], tmp_path,
                          likelihood=lambda prompt, text: (1.0 * len(text), len(text)), resamples=100)
    section = quality_section(read_eval_report(tmp_path))  # a protocol's directory: its held-out results
    assert section["rows"][0]["n"] == len(result["split"]["held_out"])
    fast = next(r for r in section["rows"] if r["arm"] == "fast")
    assert fast["hash_divergence"] == 1.0 and fast["nll_diff"] == pytest.approx(0.0) and fast["truncated"] == 0
    assert fast["copy_rate_mean"] == 0.0 and fast["output_tokens_mean"] == 10
    assert "hash divergence" in section["markdown"] and "NLL/token" in section["markdown"]


def test_target_likelihood_is_the_teacher_forced_nll_of_the_completion(tiny_llama_dir):
    import torch

    from experiments.eval.likelihood import TargetLikelihood
    from experiments.eval.suites import EvalPrompt

    scorer = TargetLikelihood(str(tiny_llama_dir))
    prompt = EvalPrompt(prompt="one two three")
    ids = scorer.prompt_ids(prompt)
    with torch.inference_mode():
        logits = scorer.model(torch.tensor([ids])).logits[0, -1]  # [vocab]
    greedy, other = int(logits.argmax()), int(logits.argmin())
    for token in (greedy, other):
        text = scorer.tokenizer.decode([token])
        if scorer.tokenizer.encode(text, add_special_tokens=False) != [token]:
            pytest.skip("the token does not re-tokenize to itself")
    total, n = scorer.nll(prompt, scorer.tokenizer.decode([greedy]))
    assert n == 1 and total == pytest.approx(float(-torch.log_softmax(logits, -1)[greedy]), rel=1e-4)
    # the target's own greedy token is its most likely one: any other output costs more nats
    assert scorer.nll(prompt, scorer.tokenizer.decode([other]))[0] > total
    assert scorer.nll(prompt, "") == (0.0, 0)
