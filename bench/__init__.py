"""Benchmarks: each prints one JSON object whose ratios compare against a baseline
measured in the same run (never absolute timing targets: these machines are shared)."""
