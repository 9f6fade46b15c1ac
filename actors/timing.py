"""Where one request's time goes: the hops of `usage.speculative.timing_s`.

Each hop is seconds of one request's life, measured where it happens, and the hops do not overlap, so their sum
is at most the request's time as its client sees it (the rest is HTTP, Serve's proxy and the crossings of the
unit's messages). A hop an engine does not expose is None, never an estimate. The meanings, in order:

- `tokenize`: the ingress renders the chat template and encodes the prompt.
- `ingress_to_unit`: the ingress calls the unit's handle → the unit starts the request (wall clocks of two
  processes: exact on one host).
- `queue`: waiting for a batch slot. `prefill`: admitted → the prompt cached and its first token sampled.
- `first_token`: the unit started the request → its first token reached the decoder, less `queue` and `prefill`
  (where those are None, it holds them).
- `plan`, `draft`, `score`, `verify`: the rounds the request took part in, each round's parts summed (a round
  counts whole for every row of its batch, which waited for all of it).
- `decode`: first token → last token, less plan, draft, score and verify (commits, the loop, the stream).
- `detokenize_sse`: token ids to text (the decoder) and OpenAI chunks or the body (the ingress), for the last
  token and after it; an earlier chunk's runs while the next round does (or, in the unit's own loop, inside
  `decode`), so counting it here would count that time twice.
- `end`: last token → the request's final message, the work of its end that still precedes the last byte.

`end_deferred` (records and exports only, not the response): the end's work done after the final message
(freeing caches and drafter state, the record to telemetry, the policy's flush), which no client waits for.
"""

from __future__ import annotations

from collections.abc import Mapping

HOPS = ("tokenize", "ingress_to_unit", "queue", "prefill", "first_token", "plan", "draft", "score", "verify",
        "decode", "detokenize_sse", "end")
ROUND_PARTS = ("plan", "draft", "score", "verify")
END_DEFERRED = "end_deferred"


def hops(measured: Mapping[str, float | None]) -> dict[str, float | None]:
    """Every hop in order, None where not measured, clamped at 0 (clocks of two processes may disagree)."""
    return {hop: None if measured.get(hop) is None else max(0.0, float(measured[hop])) for hop in HOPS}


def add(timing: Mapping[str, float | None], hop: str, seconds: float) -> dict[str, float | None]:
    """`timing` with `seconds` added to `hop` (a None hop becomes `seconds`)."""
    out = dict(timing)
    out[hop] = (out.get(hop) or 0.0) + seconds
    return out
