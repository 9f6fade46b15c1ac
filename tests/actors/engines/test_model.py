"""Parity of actors.engines.native.model.CausalLM with transformers on tiny random models (fp32, atol 1e-4).

Vocabularies are small (256) here for speed; tests/conftest.py's tiny Llama uses SmolLM2's 49152.
"""

from __future__ import annotations

import pytest
import torch

from actors.engines.native.engine import Engine
from actors.engines.native.loading import build_model

ATOL = 1e-4  # fp32 logits, ours vs transformers (logits have std ~1.6, observed max error ~1e-5)
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # larger than default so logits are O(1) and errors show
)


def _hf_model(kind: str, **overrides):
    import transformers as tf

    configs = {
        "llama": lambda: tf.LlamaConfig(**BASE, tie_word_embeddings=True, **overrides),
        "llama3_rope": lambda: tf.LlamaConfig(
            **BASE,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        "llama_bias": lambda: tf.LlamaConfig(**BASE, attention_bias=True, mlp_bias=True),
        "mistral": lambda: tf.MistralConfig(**BASE, sliding_window=5, head_dim=24),
        "qwen2": lambda: tf.Qwen2Config(**BASE),
        "qwen3": lambda: tf.Qwen3Config(**BASE, head_dim=16),
    }
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(configs[kind](), attn_implementation="eager").eval()
    for name, p in model.named_parameters():  # random biases / norm weights, so a missing one cannot hide
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    return model


def _ours(hf):
    return build_model(hf.config, hf.state_dict())


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "llama_bias", "mistral", "qwen2", "qwen3"])
def test_full_and_incremental_logits_match_transformers(kind):
    hf = _hf_model(kind)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [40, V]
    engine = Engine(_ours(hf), max_slots=2)
    full = engine.forward(["a"], [ids[0].tolist()])[0]  # [40, V]
    torch.testing.assert_close(full, ref, atol=ATOL, rtol=0)
    # prefill 30, then one token at a time, then a block of 4 (decode and scoring reuse the cache)
    steps = [engine.forward_last(["b"], [ids[0, :30].tolist()])[0]]
    steps += [engine.forward(["b"], [[t]])[0, 0] for t in ids[0, 30:36].tolist()]
    block = engine.forward(["b"], [ids[0, 36:].tolist()])[0]
    torch.testing.assert_close(torch.stack(steps), ref[29:36], atol=ATOL, rtol=0)
    torch.testing.assert_close(block, ref[36:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
def test_ragged_batch_equals_one_sequence_at_a_time(kind, graphs):
    hf = _hf_model(kind)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 3, 14, 6)]
    extra = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 2, 3)]
    alone = Engine(_ours(hf), max_slots=4)
    expected = []
    for i, (p, e) in enumerate(zip(prompts, extra)):
        alone.forward([f"s{i}"], [p])
        expected.append(alone.forward([f"s{i}"], [e])[0, : len(e)])
    batched = Engine(_ours(hf), max_slots=8, graphs=graphs)  # fixed-shape: slot space, dummy rows, no capture
    ids = [f"s{i}" for i in range(4)]
    batched.forward(ids, prompts)
    batched.release("s1")  # s3 moves from slot 3 into slot 1; s1 comes back in slot 3
    batched.forward(["s1"], [prompts[1]])
    assert [batched._slot[i] for i in ids] == [0, 3, 2, 1]
    for order in ([2, 0], [3, 1]):  # caller order differs from slot order; slots {0, 2} are not contiguous
        got = batched.forward([ids[i] for i in order], [extra[i] for i in order])
        for row, i in enumerate(order):
            torch.testing.assert_close(got[row, : len(extra[i])], expected[i], atol=ATOL, rtol=0)
    tails = batched.forward(ids, [[7, 8, 9]] * 4, num_logits=[1, 2, 3, 1])
    assert tails.shape == (4, 3, 256)


def test_engine_greedy_equals_transformers_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from actors.engines.native import load_model

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model, tokenizer = load_model(tiny_llama_dir)
    prompt = tokenizer("The capital of France is")["input_ids"]
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = ref[0, len(prompt) :].tolist()
    engine = Engine(model, max_slots=1)
    out, feed = [], prompt
    for _ in range(16):
        feed = [int(engine.forward_last(["x"], [feed])[0].argmax())]
        out.append(feed[0])
    assert out == ref
