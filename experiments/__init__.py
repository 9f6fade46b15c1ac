"""Experiments: the A/B report (`ab_report`, `specserve ab report`) with which verification ran per arm
(`verification_share`), and task-suite evaluation (`eval`, `specserve eval`). Instruments: they read what the
serving path (cluster/serving: arm routing, the audit) records; nothing in the product imports them.
Methods: docs/experiments.md.
"""
