"""`specserve eval`: task suites scored per arm, paired statistics, and the speed–quality frontier.

- `suites`: the Suite plug-in contract (problems, prompt, score), the registry and `module:object` loading.
- `humaneval`: HumanEval as completion, as chat, and as a copy-heavy rewrite of the canonical solutions.
- `sandbox`: runs model-written code with its tests in a subprocess (time and memory limits, no network).
- `stats`: paired bootstrap intervals and McNemar's exact test.
- `backends`: completions from a running service (OpenAI client, arm forced by header) or an in-process unit.
- `runner`: suite × arms, interleaved by problem, one resumable JSONL row per answer.
- `report`: results.json, report.md, frontier.png; the A/B report's quality section; the bench's quality delta.
- `cli`: the `specserve eval` command.
"""
