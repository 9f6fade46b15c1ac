"""actors.loading: sources, cache of the embedded SmolLM2, model_info, and the SmolLM2 greedy check."""

from __future__ import annotations

import time

import pytest
import torch

from actors.engines.native.engine import Engine
from actors.engines.native import load_model
from actors.sources import converted_dir, embedded_gguf, load_tokenizer, model_info


def test_model_info_reads_config_only(tiny_llama_dir):
    info = model_info(tiny_llama_dir)
    assert info["vocab_size"] == 49152 and info["num_attention_heads"] == 4 and info["num_key_value_heads"] == 2
    assert info["eos_token_ids"] == [2] and info["max_position_embeddings"] == 512


def test_tokenizer_of_a_directory_is_smollm2s(tiny_llama_dir, smollm2_tokenizer):
    tok = load_tokenizer(tiny_llama_dir)
    assert tok("hello world")["input_ids"] == smollm2_tokenizer("hello world")["input_ids"]


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(source="/no/such/dir"), "source"),
        (dict(source="/no/such/file.gguf"), "source"),
        (dict(source="embedded:nope"), "source"),
        (dict(dtype="float8"), "dtype"),
        (dict(tp_size=3), "tp_size"),  # 3 ranks > 2 kv heads
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
    ],
)
def test_bad_arguments_are_value_errors(tiny_llama_dir, kwargs, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        load_model(**{"source": tiny_llama_dir, **kwargs})


def test_bfloat16_loads(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, dtype="bfloat16")
    logits = Engine(model).forward_last(["a"], [[1, 2, 3]])
    assert model.dtype == torch.bfloat16 and logits.shape == (1, 49152)
    assert logits.dtype == (torch.float32 if model.packed else torch.bfloat16)  # packed: see model.py


@pytest.mark.slow
def test_embedded_smollm2_greedy_equals_transformers():
    """Converted once (~25 s, then cached); later loads read the cache in seconds."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # 2 threads on 2 busy shared cores is several times slower
    started = time.perf_counter()
    model, tokenizer = load_model("embedded:smollm2")
    assert (converted_dir(embedded_gguf("embedded:smollm2")) / "model.safetensors").is_file()
    info = model_info("embedded:smollm2")
    assert info["vocab_size"] == 49152 and info["eos_token_ids"] == [tokenizer.eos_token_id] == [2]
    cached_load_s = time.perf_counter() - started

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = prompt["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(converted_dir(embedded_gguf("embedded:smollm2")), dtype=torch.float32)
    # explicit attention_mask: pad_token_id is <|im_end|> (2), which the chat prompt contains; without it
    # generate() would infer a mask that hides those tokens
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = ref[0, len(prompt) :].tolist()

    engine = Engine(model, max_slots=1)
    out, feed = [], prompt
    for _ in range(20):
        feed = [int(engine.forward_last(["x"], [feed])[0].argmax())]
        out.append(feed[0])
    assert out == ref, (tokenizer.decode(out), tokenizer.decode(ref))
    assert cached_load_s < 60
