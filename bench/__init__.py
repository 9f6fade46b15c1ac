"""Benchmarks: `specserve bench` (bench.run) and the single-unit actors benchmark (actors_bench).

workloads (prompts) → harness (in-process runs per mode) and http_bench / hf_peer (the other paths) →
sections (what is measured) → speedup (α, c, v fit) and summary (ratios, goals) → report (Markdown, plots).
"""
