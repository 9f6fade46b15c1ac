"""For test modules that need vLLM (`target.engine: vllm`): skip them where vLLM is not installed, unless
SPECSERVE_REQUIRE_VLLM=1 (the README's test command sets it, so CI fails rather than skips)."""

from __future__ import annotations

import os

import pytest


def require_vllm_or_skip() -> None:
    from actors.engines.vllm import require_vllm

    try:
        require_vllm()
    except ImportError as err:
        if os.environ.get("SPECSERVE_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(err), allow_module_level=True)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
