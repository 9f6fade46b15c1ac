"""The drafter a benchmark measures: the config's own, with the suffix drafter's cache of recent outputs off.

The benchmark runs the same prompts again and again (every mode, every repeat, the warm-up), so a cache of
recent outputs would hand the drafter the very answer it is being measured on. Serving keeps the cache:
repeated and templated requests are what it is for.
"""

from __future__ import annotations


def bench_drafter_spec(config):
    """`config.drafter` (a `cluster.config.schema.DrafterSpec`) with the output cache off."""
    return config.drafter.model_copy(update={"suffix_cache_tokens": 0})


def bench_drafter_setup(config):
    """The `actors.drafting.DrafterSetup` the in-process benchmark builds its drafter from."""
    from cluster.serving.decoder import unit_setup

    return unit_setup(config.model_copy(update={"drafter": bench_drafter_spec(config)}))["drafter"]


def drafter_label(spec) -> str:
    """How results.json names the drafter (`spec`: a DrafterSpec)."""
    if spec.kind == "ngram":
        return f"ngram ({spec.prompt_lookup_min}-{spec.prompt_lookup_max})"
    if spec.kind == "suffix":
        return (f"suffix (min confidence {spec.suffix_min_confidence:g}, depth {spec.suffix_max_depth}, "
                f"output cache off in the benchmark)")
    return f"{spec.kind} {spec.source or ''}".strip()
