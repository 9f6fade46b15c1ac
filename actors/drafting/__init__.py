"""Drafters: propose γ tokens per sequence behind one small interface (`actors.contracts.Drafter`).

- `ngram.NgramDrafter`: prompt lookup; microseconds, runs in the coordinator's process.
- `suffix.SuffixDrafter`: suffix-automaton matching over the request and a cache of recent outputs, with a
  confidence per draft token that sets each row's draft length; microseconds, in the coordinator's process.
- `model.ModelDrafter`: a small causal LM with its own engine; in its own Ray actor on a cluster.
- kind 'vllm': vLLM's own proposer (`method`: draft_model, EAGLE, MTP) inside the target's vLLM worker, which
  `actors.engines.vllm` attaches to; nothing of it runs here.

`make_drafter` is the one place a drafter is built from its settings (the in-process unit, the drafter actor
and the benchmarks all call it); `LocalDrafter` is the coordinator's async view of an in-process drafter.
A drafter proposes for a batch of `DraftRequest`s and returns one `DraftBatch`; draft ids beyond a row's own
length are `PAD_TOKEN_ID`, and `draft_lens[b]` may be below the γ asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.contracts import DraftBatch, DraftRequest, Drafter
from actors.drafting.model import ModelDrafter, check_vocab
from actors.drafting.ngram import NgramDrafter, ngram_lookup
from actors.drafting.suffix import SuffixDrafter

__all__ = ["DrafterSetup", "LocalDrafter", "ModelDrafter", "NgramDrafter", "SuffixDrafter", "check_vocab",
           "make_drafter", "ngram_lookup"]

DRAFTER_KINDS = ("ngram", "suffix", "model", "vllm", "none")


@dataclass(frozen=True)
class DrafterSetup:
    """How a unit drafts: `kind` ngram | suffix | model | vllm | none, the in-process drafters' settings, the model
    drafter's own dtype, device and actor, and for kind 'vllm' vLLM's proposer (`method`, `source`, and the rest
    of vLLM's speculative settings in `engine_kwargs`)."""

    kind: str = "ngram"
    source: str | None = None  # model drafter's source (as target sources)
    dtype: str = "float32"
    device: str = "cpu"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_max_depth: int = 32  # longest context suffix the suffix drafter matches
    suffix_min_confidence: float = 0.4  # a suffix draft stops before a token less likely than this
    suffix_cache_tokens: int = 65536  # the unit's cache of recent outputs (0: off)
    resources: dict = field(default_factory=dict)  # Ray resources of the drafter actor: num_cpus, num_gpus, memory_gb
    engine: str = "native"  # what runs a model drafter: native, or vllm (actors.engines.vllm.drafter)
    engine_kwargs: dict = field(default_factory=dict)  # engine vllm: vLLM's engine arguments; kind vllm: speculative
    method: str | None = None  # kind vllm: vLLM's speculative method (draft_model, eagle, eagle3, mtp)

    def __post_init__(self):
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.kind == "model" and not self.source:
            raise ValueError("source is required when kind is 'model'")
        if self.kind == "vllm" and not self.method:
            raise ValueError("method is required when kind is 'vllm'")

    @property
    def in_target_engine(self) -> bool:
        """vLLM's own proposer drafts, inside the target's vLLM engine (kind 'vllm')."""
        return self.kind == "vllm"

    def speculative_config(self, gamma_max: int) -> dict:
        """Kind 'vllm': vLLM's `speculative_config`, drafting up to `gamma_max` tokens a step."""
        from actors.sources import resolve

        model = str(resolve(self.source)) if self.source else None
        return {**self.engine_kwargs, "method": self.method, "model": model,
                "num_speculative_tokens": max(1, gamma_max)}


def make_drafter(setup: DrafterSetup, *, max_slots: int, max_seq_len: int | None) -> Drafter | None:
    """The drafter `setup` describes, in this process (None for kind 'none')."""
    if setup.kind == "vllm":
        raise ValueError("drafter.kind 'vllm' runs inside the target's vLLM engine: it needs target.engine 'vllm'")
    if setup.kind == "ngram":
        return NgramDrafter(setup.prompt_lookup_min, setup.prompt_lookup_max)
    if setup.kind == "suffix":
        return SuffixDrafter(setup.suffix_max_depth, setup.suffix_min_confidence, setup.suffix_cache_tokens)
    if setup.kind == "model" and setup.engine == "vllm":
        from actors.engines.vllm.drafter import VllmDrafter

        return VllmDrafter(setup.source, setup.dtype, max_seq_len, max_slots, setup.engine_kwargs)
    if setup.kind == "model":
        from actors.engines.native import Engine, load_model

        model, _ = load_model(setup.source, setup.dtype, setup.device)
        return ModelDrafter(Engine(model, max_slots, max_seq_len), name=setup.source)
    return None


class LocalDrafter:
    """A drafter in the coordinator's process, behind the async `DrafterBackend` contract."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.free_drafts = drafter.free_drafts

    async def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        return self.drafter.propose(requests)

    async def release(self, seq_id: str) -> None:
        self.drafter.release(seq_id)

    async def recover(self) -> None:
        """An in-process drafter does not die apart from the process."""

    async def close(self) -> None:
        pass
