"""Pure verification and γ-policy maths: torch in, torch out, no Ray, no models.

- `policies.exact`: greedy and sampled (Leviathan) verification, `process_logits`.
- `policies.asd`: approximate speculative decoding with per-request `RegretLedger`s.
- `policies.scores`: `TargetScores`, the compact form of target logits that crosses actor boundaries.
- `policies.gamma`: the speedup model and `GammaPolicy`, which picks γ per request.
"""

from policies.verdict import PAD_TOKEN_ID, Verdict

__all__ = ["PAD_TOKEN_ID", "Verdict"]
