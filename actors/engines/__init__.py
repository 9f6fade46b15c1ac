"""Engines execute the target (and model drafters): sequences by id over a KV cache.

- `native/`: specserve's own torch forward (Llama family) over a slot KV cache, with Megatron tensor
  parallelism; the light embedded default and the reference other engines are tested against.

An engine satisfies `actors.contracts.Engine`, or provides a whole `actors.contracts.TargetBackend`.
Nothing here imports Ray.
"""
