"""Verification: BF16 vs the INT2 cache with OSCAR rotations and baselines, metrics, report, plot."""
