"""The package's engines: one specserve unit on vLLM (n-gram drafts, ASD verifications logged), and vLLM's own
greedy output of the package's prompts, computed by a plain vLLM engine in a spawned process while the unit
starts."""

from __future__ import annotations

import pytest

from . import ENGINE, MAX_TOKENS, POLICY, SOURCE, prompts


@pytest.fixture(scope="package")
def tokenizer():
    from actors.sources import load_tokenizer

    return load_tokenizer(SOURCE)


@pytest.fixture(scope="package")
def reference(tokenizer):
    """A future of vLLM's own greedy output (no speculation, no specserve settings), same weights, dtype and
    eager mode."""
    from actors.sources import model_info, resolve
    from tests.vllm_support import require_vllm_or_skip, vllm_greedy_in_background

    require_vllm_or_skip()
    return vllm_greedy_in_background(str(resolve(SOURCE)), prompts(tokenizer), MAX_TOKENS,
                                     list(model_info(SOURCE)["eos_token_ids"]), max_model_len=1024, **ENGINE)


@pytest.fixture(scope="package")
def unit(reference):
    from actors.drafting import DrafterSetup
    from actors.engines.vllm.unit import VllmUnit
    from actors.setup import TargetSetup

    unit = VllmUnit(unit="test-vllm", setup=TargetSetup(SOURCE, max_slots=64, max_seq_len=1024, engine_kwargs=ENGINE),
                    drafter=DrafterSetup(kind="ngram"), policy=POLICY, record_asd=True).start()
    yield unit
    unit.close_sync()


@pytest.fixture(scope="package")
def plain_greedy(unit, reference) -> list[list[int]]:
    return reference.result()
