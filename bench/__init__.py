"""The benchmark suite (`specserve bench`, `bench.run`) and the single-unit actors benchmark (`actors_bench`).

workloads (prompts) → harness (in-process runs per mode) and http_bench / hf_peer (the other paths) →
sections (what is measured) → speedup (α, c, v fit) and summary (ratios, goals) → report (Markdown, plots).
The bench uses the product (policies, actors, cluster) and experiments.eval; nothing in the product imports it.
Method and figures: docs/benchmarks.md; the reliability section: docs/reliability.md.
"""
