"""Records that cross sub-packages of cluster/: written by one concern, read by another.

`AuditRecord` is written by the quality audit (`cluster.serving.audit`), aggregated by the telemetry hub
(`cluster.observability.telemetry`) and read back from the export by the A/B report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class AuditRecord:
    """One audited request: an ASD output compared with the exact reference arm's output of the same prompt.

    `asd_tokens` and `ref_tokens` are the lengths (token counts) of the two outputs, not the tokens.
    """

    request_id: str
    arm: str  # the ASD arm that served the request
    reference_arm: str  # the exact arm the replay ran on
    exact_match: bool
    common_prefix: int  # tokens equal from the start
    edit_distance: int  # token Levenshtein distance
    asd_tokens: int
    ref_tokens: int
    regret_spent: float
    unit: str = ""  # the unit that served the ASD request (metric label)

    @property
    def prefix_agreement(self) -> float:
        """common_prefix / the longer output, in [0, 1]; 1 when both are empty."""
        longest = max(self.asd_tokens, self.ref_tokens)
        return self.common_prefix / longest if longest else 1.0

    @property
    def normalized_edit_distance(self) -> float:
        """edit_distance / the longer output, in [0, 1]; 0 when both are empty."""
        longest = max(self.asd_tokens, self.ref_tokens)
        return self.edit_distance / longest if longest else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> AuditRecord:
        """Inverse of `to_dict`; unknown keys are ignored so older readers accept newer exports."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in known})
