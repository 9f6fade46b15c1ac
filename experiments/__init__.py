"""Experiments: A/B arm routing (`ab`), the quality audit (`audit`), the A/B report (`report`) and task-suite
evaluation (`eval`)."""
