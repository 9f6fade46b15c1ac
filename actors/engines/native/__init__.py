"""The native engine: our own Llama-family forward (`model`), its slot KV cache (`kv_cache`), sequences by id
(`engine.Engine`), Megatron sharding (`sharding`) and weight loading (`loading`). Torch only."""

from actors.engines.native.engine import Engine
from actors.engines.native.loading import load_model

__all__ = ["Engine", "load_model"]
