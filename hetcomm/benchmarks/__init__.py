"""Benchmarks behind `hetcomm bench` (tables in the nccl-tests style; ratios
measured side by side in one run, never asserted in tests)."""
