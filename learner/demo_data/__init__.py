"""Synthetic data sets of the CPU demos and tests: seeded, pure generators of records the product reads.

Demo code only: nothing under `learner/` except this package imports it (scripts, bench and tests do)."""
